"""The built wheel holds the product and the adapter author's kit, and nothing of r3bridge's own
test lab (``testlab/``, ``tests/``): built from a copy of this checkout with ``pip wheel``, the way
a user's ``pip install .`` builds it, then read as a zip."""
from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

import r3bridge

REPO = Path(__file__).resolve().parents[2]
# never copied: VCS data, virtualenvs, build outputs and caches (not part of a checkout)
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".hypothesis", ".ruff_cache", ".dev", "out")

# what the product and the kit must ship (wheel paths)
PRODUCT = [
    "r3bridge/__init__.py", "r3bridge/py.typed", "r3bridge/batch/schema.py", "r3bridge/config.py",
    "r3bridge/megatron/__init__.py", "r3bridge/cli/main.py", "r3bridge/cli/demo.py",
    "r3bridge/demo/hf_engine.py", "r3bridge/demo/hf_to_mcore.py", "r3bridge/demo/job.py",
    "r3bridge/testing/kit/conformance.py", "r3bridge/testing/harness/dist.py", "r3bridge/testing/harness/cpu_shim.py",
    "r3bridge/adapters/__init__.py", "r3bridge/adapters/verl/__init__.py",
    "r3bridge/adapters/skyrl/__init__.py", "r3bridge/adapters/areal/__init__.py",
    "r3bridge/adapters/_template/__init__.py", "r3bridge/configs/__init__.py", "r3bridge/configs/r3bridge.yaml",
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore_venvs = lambda d, names: {n for n in names if (Path(d) / n / "pyvenv.cfg").exists()}  # noqa: E731
    shutil.copytree(REPO, src, ignore=lambda d, names: set(_NOT_SOURCE(d, names)) | ignore_venvs(d, names))
    # --no-build-isolation: the build backend (setuptools >= 77, dependency group `test`) is the
    # installed one, so the test needs no network
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", "-w", str(tmp / "out")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = (tmp / "out").glob("r3bridge-*.whl")
    with zipfile.ZipFile(built) as zf:
        yield zf


def _files(wheel: zipfile.ZipFile) -> list[str]:
    return [n for n in wheel.namelist() if not n.endswith("/")]


def _package_files(wheel: zipfile.ZipFile) -> list[str]:
    return [n for n in _files(wheel) if ".dist-info/" not in n]


def test_no_test_lab_or_test_file_is_shipped(wheel):
    files = _package_files(wheel)
    lab_modules = {p.name for p in (REPO / "testlab").glob("*.py") if p.name != "__init__.py"}
    assert lab_modules, "testlab/ has no modules: this check would prove nothing"
    shipped_lab = [f for f in files if PurePosixPath(f).name in lab_modules]
    assert not shipped_lab, f"test-lab modules in the wheel: {shipped_lab}"
    tops = {f.split("/", 1)[0] for f in files}
    assert tops == {"r3bridge"}, f"top-level entries besides r3bridge/: {sorted(tops - {'r3bridge'})}"
    tests = [f for f in files if PurePosixPath(f).name.startswith("test_") or PurePosixPath(f).name == "conftest.py"
             or "/tests/" in f]
    assert not tests, f"test files in the wheel: {tests}"


def test_product_and_kit_are_shipped(wheel):
    files = set(_package_files(wheel))
    missing = [f for f in PRODUCT if f not in files]
    assert not missing, f"missing from the wheel: {missing}"
    # every module of the package's source folders, so a new subpackage left out of
    # [tool.setuptools] packages fails here instead of at a user's import
    sources = {"r3bridge": REPO / "r3bridge", "r3bridge/adapters": REPO / "adapters", "r3bridge/configs": REPO / "configs"}
    expected = {f"{prefix}/{p.relative_to(root).as_posix()}" for prefix, root in sources.items()
                for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    assert expected - files == set()


def test_the_defaults_file_ships_as_it_is_in_the_checkout(wheel):
    assert wheel.read("r3bridge/configs/r3bridge.yaml") == (REPO / "configs" / "r3bridge.yaml").read_bytes()


def test_the_installed_package_finds_its_defaults_file():
    """Through the installed package (here the editable install of `make install`), not a path
    into the checkout."""
    import importlib.resources

    found = importlib.resources.files("r3bridge.configs") / "r3bridge.yaml"
    assert found.read_bytes() == (REPO / "configs" / "r3bridge.yaml").read_bytes()


def test_metadata_declares_version_python_license_and_commands(wheel):
    (meta_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(wheel.read(meta_name))
    assert meta["Version"] == r3bridge.__version__          # one source: r3bridge/__init__.py
    assert meta["Requires-Python"] == ">=3.11"
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel.namelist())
    extras = set(meta.get_all("Provides-Extra"))
    assert {"megatron", "demo", "plot", "verl", "skyrl", "areal"} <= extras
    assert "test" not in extras                             # test tools: [dependency-groups]
    (entry_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    entry_points = wheel.read(entry_name).decode()
    assert "r3bridge = r3bridge.cli.main:main" in entry_points
    assert "r3bridge = r3bridge.adapters.verl" in entry_points

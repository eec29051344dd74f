"""A command whose optional dependency is missing exits 2 with one line naming the package and the
extra to install: no traceback, and for `r3bridge demo` before any rank is spawned.

Each case runs the CLI in a fresh interpreter in which the named modules cannot be imported
(``sys.modules[name] = None``: what Python itself does for a module known to be absent), so the
check sees exactly what a user's environment without the package shows."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import r3bridge

REPO = Path(__file__).resolve().parents[2]

# blocks the modules, runs the CLI, then reports whether the demo's rank machinery was imported
_WRAPPER = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from r3bridge.cli.main import main
code = main(sys.argv[2:])
print("spawn-machinery-imported=" + str("r3bridge.testing.harness.dist" in sys.modules or "r3bridge.demo.job" in sys.modules))
raise SystemExit(code)
"""


def _run(blocked: list[str], argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WRAPPER, ",".join(blocked), *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.parametrize(("blocked", "named", "absent"), [
    (["transformers"], "transformers", "megatron-core"),
    (["megatron"], "megatron-core", "transformers"),
    (["megatron", "transformers"], "megatron-core and transformers", None),
])
def test_demo_without_its_engine_names_the_package_and_the_demo_extra(tmp_path, blocked, named, absent):
    proc = _run(blocked, ["demo", "--json", "--steps", "1"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc)
    assert f"needs {named}, not installed" in line
    assert 'pip install "r3bridge[demo]"' in line
    if absent:
        assert absent not in line            # only what is really missing is named
    # stopped before the rank machinery was even imported, let alone a rank spawned
    assert proc.stdout.strip() == "spawn-machinery-imported=False"
    assert not list(tmp_path.iterdir())      # no plot, no partial output


@pytest.mark.parametrize("command", ["inspect", "diff"])
def test_plot_without_matplotlib_names_the_plot_extra(tmp_path, command):
    batch = r3bridge.ReplayBatch.from_ragged([torch.tensor([[[0, 1]], [[2, 3]]])], num_experts=4, layer_ids=[1])
    route_file = tmp_path / "routes.r3b"
    route_file.write_bytes(batch.to_bytes())
    files = [str(route_file)] * (2 if command == "diff" else 1)
    proc = _run(["matplotlib"], [command, *files, "--plot", str(tmp_path / "out.png")], tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc)
    assert "--plot needs matplotlib, not installed" in line
    assert 'pip install "r3bridge[plot]"' in line
    assert not (tmp_path / "out.png").exists()


def test_the_check_passes_where_the_packages_are_installed():
    """The same check in this environment (the test set-up installs the demo extra) lets the
    command through: it is the missing package, not the check, that stops the runs above."""
    from r3bridge.cli._common import installed, require

    assert installed("megatron.core") and installed("transformers")
    require("r3bridge demo", "demo", {"megatron.core": "megatron-core", "transformers": "transformers"})
    assert not installed("r3bridge_no_such_module")


def test_demo_te_spec_without_transformer_engine_names_it(tmp_path):
    """`--spec te` on a machine without Transformer Engine (this one): one line, exit 2, no rank."""
    argv = ["demo", "--json", "--steps", "1", "--device", "cuda", "--spec", "te"]
    proc = _run(["transformer_engine"], argv, tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc)
    assert "--spec te needs transformer-engine" in line and "transformer-engine[pytorch]" in line
    assert proc.stdout.strip() == "spawn-machinery-imported=False"
    assert not list(tmp_path.iterdir())


def test_demo_te_spec_needs_cuda_and_one_cp_rank(tmp_path):
    from r3bridge.demo.job import DemoOptions, layout_problem

    proc = _run([], ["demo", "--json", "--steps", "1", "--spec", "te"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "--spec te needs --device cuda" in _one_error_line(proc)
    assert "--spec te runs with --cp 1" in layout_problem(1, 1, None, 1, 2, 1, DemoOptions(layer_spec="te"))
    assert layout_problem(1, 1, None, 1, 2, 1, DemoOptions()) is None

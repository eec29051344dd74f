"""The guides' command lines work as written, from any folder, with an editable or an installed
(not editable) r3bridge (issue 32 item 2).

Each example script the guides tell users to run is executed by bash from a folder outside the
checkout, with ``python`` / ``python3`` standing for ``testlab/guide_dry_run.py``: the script's
own command line runs through the entry point it names and the framework's own parser and checks,
and stops where the cluster would start (GPUs, Ray, SGLang, vLLM).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRY_RUN = ROOT / "testlab" / "guide_dry_run.py"

SCRIPTS = [
    ("examples/skyrl/run_r3.sh", ["trainer.logger=console"], "skyrl replay_mode=R3"),
    ("examples/skyrl/run_r2.sh", ["trainer.logger=console"], "skyrl replay_mode=R2"),
    ("examples/areal/run_r3.sh", [], "areal replay_mode=R3"),
    ("examples/areal/run_r3.sh", ["r3bridge.replay_mode=R2", "rollout.return_routed_experts=false"],
     "areal replay_mode=R2"),
    ("examples/verl/run_qwen3_30b_a3b_r3.sh", [], "verl replay_mode=R3"),
    ("examples/verl/run_qwen3_30b_a3b_r2.sh", [], "verl replay_mode=R2"),
]


def _shims(folder: Path, pythonpath: str | None) -> dict[str, str]:
    bindir = folder / "bin"
    bindir.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        shim = bindir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{DRY_RUN}" "$@"\n')
        shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("R3BRIDGE_CONFIG", "R3BRIDGE_REPLAY_MODE")}
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    env.update(HF_MODEL_PATH="/models/Qwen3-30B-A3B", TRAIN_DATA_PATH="/data/gsm8k/train.parquet")
    # the dry run imports testlab from the checkout; r3bridge comes from `pythonpath` when given
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(ROOT / "testlab")) if p)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    """r3bridge built as a wheel and installed (not editable) into a folder that shadows the editable
    install on PYTHONPATH."""
    target = tmp_path_factory.mktemp("installed")
    # pip's own build isolation: the build backend pyproject names (setuptools >= 68), from the registry
    # or pip's cache; the venv's own setuptools may be older
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(ROOT)],
                   check=True, timeout=900)
    return str(target)


def _run(script: str, extra: list[str], env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run(["bash", str(ROOT / script), *extra], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{script} failed from {cwd}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script, extra, want", SCRIPTS, ids=[f"{s}{'+' if e else ''}" for s, e, _ in SCRIPTS])
def test_guide_command_from_another_folder(tmp_path, script, extra, want):
    out = _run(script, extra, _shims(tmp_path, None), cwd=tmp_path)
    assert f"GUIDE-OK {want}" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("script, extra, want", [SCRIPTS[0], SCRIPTS[2], SCRIPTS[4]],
                         ids=["skyrl", "areal", "verl"])
def test_guide_command_with_an_installed_r3bridge(tmp_path, installed, script, extra, want):
    probe = subprocess.run([sys.executable, "-c", "import r3bridge.adapters.skyrl.config as m; print(m.__file__)"],
                           env=_shims(tmp_path, installed), cwd=tmp_path, capture_output=True, text=True)
    assert probe.stdout.startswith(installed), probe.stdout + probe.stderr       # not the checkout's
    out = _run(script, extra, _shims(tmp_path, installed), cwd=tmp_path)
    assert f"GUIDE-OK {want}" in out, out[-3000:]


@pytest.mark.slow
def test_guide_command_from_the_checkout_root(tmp_path):
    out = _run("examples/skyrl/run_r3.sh", ["trainer.logger=console"], _shims(tmp_path, None), cwd=ROOT)
    assert "GUIDE-OK skyrl replay_mode=R3" in out


# ------------------------------------------------------------------ "Try it on CPU" (fresh virtualenv)
FRESH = ("verl", "skyrl", "areal")


def fresh_venv_block(framework: str) -> list[str]:
    """The ```bash block after ``<!-- fresh-venv: FRAMEWORK -->`` in docs/use-with-FRAMEWORK.md,
    as scripts/guides_fresh_venv.sh reads it."""
    lines = (ROOT / "docs" / f"use-with-{framework}.md").read_text().splitlines()
    start = lines.index(f"<!-- fresh-venv: {framework} -->")
    assert lines[start + 1] == "```bash", lines[start + 1]
    end = lines.index("```", start + 2)
    return lines[start + 2:end]


def _pip_args(line: str) -> list[str]:
    return line.split("#", 1)[0].split()[2:]


@pytest.mark.parametrize("framework", FRESH)
def test_fresh_venv_block_installs_the_readme_line_and_runs_the_cpu_step_elsewhere(framework):
    """The block scripts/guides_fresh_venv.sh follows (issue 32's done-criterion): a new virtualenv,
    the README's install line for the framework (from the checkout, not editable), then the CPU step
    from another folder than the checkout."""
    block = fresh_venv_block(framework)
    assert block[0].startswith("R3BRIDGE=") and " VENV=" in block[0], block[0]
    assert block[1] == 'python3 -m venv "$VENV" && . "$VENV/bin/activate"', block[1]
    pips = [_pip_args(line) for line in block if line.startswith("pip install")]
    # README: pip install ".[framework]" (a torch==X+cpu next to it only guards against a CUDA torch)
    assert [f'"$R3BRIDGE[{framework}]"'] in [[a for a in p if not a.startswith("torch==")] for p in pips], pips
    assert not [p for p in pips if "-e" in p or "--editable" in p], pips
    readme = (ROOT / "README.md").read_text()
    assert f'pip install ".[{framework}]"' in readme
    cd, _, run = block[-1].partition(" && ")
    assert cd.startswith("cd ") and "$R3BRIDGE" not in cd, block[-1]
    if framework == "verl":      # verl's own launch line, rehearsed (tests/adapters/test_verl_e2e.py runs it)
        assert run == 'bash "$R3BRIDGE/examples/verl/run_cpu_rehearsal.sh"', run
        assert "python -m r3bridge.adapters.verl.main_ppo" in (ROOT / "examples/verl/run_cpu_rehearsal.sh").read_text()
        return
    assert run == f'python "$R3BRIDGE/testlab/cpu_step.py" {framework}', run
    from testlab.cpu_step import FRAMEWORKS
    assert framework in FRAMEWORKS


@pytest.mark.parametrize("framework", FRESH)
def test_fresh_venv_block_pins_what_the_framework_release_pins(framework):
    """torch and every package the block adds for the CPU step, against the release's own metadata
    (the installed wheel): a pin the framework would refuse fails here, not in a user's virtualenv."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement
    from packaging.version import Version

    dist = distribution(framework)
    own: dict[str, list[Requirement]] = {}
    for line in dist.requires or []:
        req = Requirement(line)
        own.setdefault(req.name, []).append(req)
    for line in fresh_venv_block(framework):
        if not line.startswith("pip install"):
            continue
        for arg in _pip_args(line):
            if arg.startswith(("-", '"$R3BRIDGE')) or arg.startswith("http"):
                continue
            req = Requirement(arg)
            pinned = [v.version for v in req.specifier if v.operator == "=="]
            applies = ({"extra": ""}, {"extra": "skyrl-train"}) if framework == "skyrl" else ({"extra": ""},)
            for theirs in own.get(req.name, []):
                if theirs.marker is not None and not any(theirs.marker.evaluate(env) for env in applies):
                    continue
                for version in pinned:
                    assert Version(version) in theirs.specifier or not theirs.specifier, (framework, arg, str(theirs))
            if framework == "skyrl" and req.name != "torch":   # what SkyRL's skyrl-train extra brings
                extra = [r for r in own.get(req.name, []) if r.marker and r.marker.evaluate({"extra": "skyrl-train"})]
                assert extra, f"{arg}: not in skyrl {dist.version}'s skyrl-train extra"
                assert not pinned or str(extra[0].specifier) == str(req.specifier), (arg, str(extra[0]))


def test_areal_guide_says_its_megatron_engine_needs_python_312_as_areal_declares():
    """AReaL 1.0.4 installs on 3.11, but `areal.engine.megatron_engine` imports megatron.bridge at
    module level and AReaL declares megatron-bridge only for Python >= 3.12 (seen in a fresh
    virtualenv: `trainer_class()` -> No module named 'megatron.bridge'). The guide and the README
    must say so while the installed release's metadata and code say so."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    dist = distribution("areal")
    bridge = [Requirement(r) for r in dist.requires or [] if Requirement(r).name == "megatron-bridge"]
    assert bridge, "areal no longer requires megatron-bridge: revisit the guide's Python note"
    env = {"extra": "megatron", "platform_machine": "x86_64", "sys_platform": "linux"}
    assert not any(r.marker.evaluate({**env, "python_full_version": "3.11.7"}) for r in bridge)
    assert all(r.marker.evaluate({**env, "python_full_version": "3.12.3"}) for r in bridge)
    engine = dist.locate_file("areal/engine/megatron_engine.py").read_text()
    assert "\nfrom megatron.bridge import" in engine           # at module level, not inside a function
    assert "a real AReaL Megatron job needs Python 3.12" in (ROOT / "docs" / "use-with-areal.md").read_text()
    assert "a real AReaL Megatron\njob needs Python 3.12" in (ROOT / "README.md").read_text()


@pytest.mark.slow
def test_cpu_step_runs_from_another_folder_with_an_installed_r3bridge(tmp_path, installed):
    """The last line of the guides' "Try it on CPU" block (SkyRL's: the quickest of the three;
    scripts/guides_fresh_venv.sh runs all three in fresh virtualenvs): from a folder outside the
    checkout, r3bridge imported from the installed wheel, not the checkout, replay on and every
    checked router row dispatching the rollout's route."""
    env = {k: v for k, v in os.environ.items() if k not in ("R3BRIDGE_CONFIG", "R3BRIDGE_REPLAY_MODE")}
    env["PYTHONPATH"] = installed                  # shadows the editable install, as a site-packages copy would
    proc = subprocess.run([sys.executable, str(ROOT / "testlab" / "cpu_step.py"), "skyrl", "--trace-dir", "routes"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"from {installed}/r3bridge" in out, out[:500]
    # --trace-dir reaches the worker as R3BRIDGE_CONFIG, merged with the runner's section (issue 39)
    assert "r3bridge (SkyRL policy worker, pid " in out and \
        "): replay_mode=R3 (from config + environment (R3BRIDGE_CONFIG): trace_dir)" in out
    assert "r3bridge/replay_mode=3" in out and "r3bridge/update/coverage=" in out
    assert " 0 mismatching" in out and "cpu_step: OK" in out
    read = subprocess.run([sys.executable, "-m", "r3bridge", "inspect", str(tmp_path / "routes"), "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr
    import json
    trace = json.loads(read.stdout)
    assert trace["framework"] == "skyrl" and trace["mode"] == "R3" and \
        {p["pass"].split(".")[0] for p in trace["passes"]} == {"compute_log_prob", "update"}

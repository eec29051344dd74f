"""The guides' command lines work as written, from any folder, with an editable or an installed
(not editable) r3bridge (issue 32 item 2, issue 39 item 1).

SkyRL's and AReaL's example scripts run as written, with the real ``python`` / ``python3``: r3bridge's
launcher, the framework's own parser and checks, and r3bridge's check of what the framework's launcher
needs. On this CPU machine (Python 3.11, no accelerator) both stop there, each in one line per reason
and before anything starts, which is what is asserted: SkyRL's Megatron workers need Python 3.12 and
Megatron-Bridge, AReaL's local launcher needs an accelerator and SGLang (docs/use-with-skyrl.md,
docs/use-with-areal.md, "What runs where"). verl's scripts run with ``python`` standing for
``testlab/guide_dry_run.py``, up to where the cluster would start.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRY_RUN = ROOT / "testlab" / "guide_dry_run.py"

SCRIPTS = [
    ("examples/verl/run_qwen3_30b_a3b_r3.sh", [], "verl replay_mode=R3"),
    ("examples/verl/run_qwen3_30b_a3b_r2.sh", [], "verl replay_mode=R2"),
]


def _env(pythonpath: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("R3BRIDGE_CONFIG", "R3BRIDGE_REPLAY_MODE")}
    env.update(HF_MODEL_PATH="/models/Qwen3-30B-A3B", TRAIN_DATA_PATH="/data/gsm8k/train.parquet")
    # `python` / `python3` in the scripts: this test run's interpreter (make test does not activate the venv)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    else:
        env.pop("PYTHONPATH", None)
    return env


def _shims(folder: Path, pythonpath: str | None) -> dict[str, str]:
    bindir = folder / "bin"
    bindir.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        shim = bindir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{DRY_RUN}" "$@"\n')
        shim.chmod(0o755)
    env = _env(None)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
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


def _run(script: str, extra: list[str], env: dict[str, str], cwd: Path, *, rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(ROOT / script), *extra], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == rc, f"{script} from {cwd}: exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("script, extra, want", SCRIPTS, ids=[s for s, _, _ in SCRIPTS])
def test_guide_command_from_another_folder(tmp_path, script, extra, want):
    proc = _run(script, extra, _shims(tmp_path, None), cwd=tmp_path)
    assert f"GUIDE-OK {want}" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_verl_guide_command_with_an_installed_r3bridge(tmp_path, installed):
    probe = subprocess.run([sys.executable, "-c", "import r3bridge.adapters.verl.config as m; print(m.__file__)"],
                           env=_shims(tmp_path, installed), cwd=tmp_path, capture_output=True, text=True)
    assert probe.stdout.startswith(installed), probe.stdout + probe.stderr       # not the checkout's
    proc = _run(SCRIPTS[0][0], [], _shims(tmp_path, installed), cwd=tmp_path)
    assert "GUIDE-OK verl replay_mode=R3" in proc.stdout + proc.stderr


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-4000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.slow
def test_skyrl_guide_command_as_written_refuses_in_one_line_before_ray(tmp_path, installed):
    """examples/skyrl/run_r3.sh from another folder, r3bridge installed (not editable): SkyRL's parser,
    r3bridge's section announced, SkyRL's validate_cfg, then one line saying why SkyRL's Megatron workers
    cannot start on this Python (they would each die in Ray on SkyRL's import)."""
    proc = _run("examples/skyrl/run_r3.sh", ["trainer.logger=console"], _env(installed), cwd=tmp_path, rc=2)
    assert "r3bridge (SkyRL launcher, pid " in proc.stderr and "): replay_mode=R3 (from config)" in proc.stderr
    (line,) = _errors(proc)
    assert line.startswith("error: SkyRL's Megatron job cannot start here: "), line
    assert "Python 3.11" in line and "megatron.bridge" in line and "Run it on Python 3.12" in line
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr    # Ray never started


@pytest.mark.slow
def test_skyrl_guide_command_with_a_typo_refuses_in_one_line(tmp_path):
    """examples/skyrl/run_r2.sh from the checkout root (editable r3bridge), a mistyped mode appended."""
    proc = _run("examples/skyrl/run_r2.sh", ["trainer.r3bridge.replay_mode=R4"], _env(None), cwd=ROOT, rc=2)
    (line,) = _errors(proc)
    assert line == ("error: ConfigError: trainer.r3bridge: replay_mode must be one of off, R2, R3 (off also spelled "
                    "disabled or false); got 'R4'"), line


@pytest.mark.slow
def test_areal_guide_command_as_written_announces_and_refuses_before_launch(tmp_path, installed):
    """examples/areal/run_r3.sh from another folder, r3bridge installed: AReaL's parser reads the guide's
    YAML, r3bridge's section is announced at launch, then one line per thing AReaL's local launcher
    would fail on here (no accelerator) or wait for silently (no SGLang), before it starts anything."""
    proc = _run("examples/areal/run_r3.sh", [], _env(installed), cwd=tmp_path, rc=2)
    assert "r3bridge (AReaL launcher, pid " in proc.stderr and "): replay_mode=R3 (from config)" in proc.stderr
    errors = _errors(proc)
    assert [e.split(";")[0] for e in errors] == [
        "error: AReaL's local launcher needs an accelerator",
        "error: allocation_mode starts sglang servers (areal.experimental.inference_service.sglang.launch_server), "
        "but the 'sglang' package is not installed here: AReaL's launcher would wait 1200 s for servers that never "
        "start"], errors
    assert "LocalLauncher INFO" not in proc.stdout + proc.stderr               # AReaL's launcher never started


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


TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _torch_lines(framework: str) -> tuple[str, str, str]:
    """The block's torch line, the version it installs, and the line after it (r3bridge's)."""
    block = fresh_venv_block(framework)
    pips = [line for line in block if line.startswith("pip install")]
    return pips[0], pips[0].split()[2].split("==")[1], pips[1]


@pytest.mark.parametrize("framework", FRESH)
def test_fresh_venv_block_installs_the_readme_line_and_runs_the_cpu_step_elsewhere(framework):
    """The block scripts/guides_fresh_venv.sh follows (issue 32's done-criterion): a new virtualenv,
    torch's CPU build, the README's install line for the framework (from the checkout, not editable)
    guarded against a CUDA torch, then the CPU step from another folder than the checkout."""
    block = fresh_venv_block(framework)
    assert block[0].startswith("R3BRIDGE=") and " VENV=" in block[0], block[0]
    assert block[1] == 'python3 -m venv "$VENV" && . "$VENV/bin/activate"', block[1]
    torch_line, version, r3_line = _torch_lines(framework)
    # the torch line: the CPU index, nothing else from it; one torch line per torch version, README included
    assert torch_line.startswith(f"pip install torch=={version}") and torch_line.endswith(f" --index-url {TORCH_CPU_INDEX}")
    readme = (ROOT / "README.md").read_text()
    assert torch_line in readme, torch_line
    # r3bridge's line: the README's install line, and torch pinned as the CPU build, so a failed torch
    # line stops it ("No matching distribution") instead of pulling the CUDA build
    args = _pip_args(r3_line)
    assert args[0] == f'"$R3BRIDGE[{framework}]"' and f"torch=={version}+cpu" in args, r3_line
    # megatron-core pinned to the suite's release: Python 3.12 resolves 0.19.2, whose `import megatron.core`
    # needs triton, which torch's CPU build lacks (testlab.cpu_step.environment_problems says so)
    from importlib.metadata import version as installed_version
    assert f"megatron-core=={installed_version('megatron-core')}" in args, r3_line
    readme_cpu_lines = [line for line in readme.splitlines() if line.startswith('pip install ".[') and "+cpu" in line]
    assert readme_cpu_lines and all(f"megatron-core=={installed_version('megatron-core')}" in line
                                    for line in readme_cpu_lines), readme_cpu_lines
    assert f'pip install ".[{framework}]"' in readme
    pips = [_pip_args(line) for line in block if line.startswith("pip install")]
    assert not [p for p in pips if "-e" in p or "--editable" in p], pips
    torch_pins = [a for p in pips for a in p if a.startswith("torch==")]
    assert torch_pins == [f"torch=={version}", f"torch=={version}+cpu"], torch_pins     # no other torch anywhere
    cd, _, run = block[-1].partition(" && ")
    assert cd.startswith("cd ") and "$R3BRIDGE" not in cd, block[-1]
    if framework == "verl":      # verl's own launch line, rehearsed (tests/adapters/test_verl_e2e.py runs it)
        assert run == 'bash "$R3BRIDGE/examples/verl/run_cpu_rehearsal.sh"', run
        assert "python -m r3bridge.adapters.verl.main_ppo" in (ROOT / "examples/verl/run_cpu_rehearsal.sh").read_text()
        return
    # the CPU step, and (SkyRL, AReaL) its route trace read back: the guide's trace_dir, on a CPU
    assert run == f'python "$R3BRIDGE/testlab/cpu_step.py" {framework} --trace-dir routes && r3bridge inspect routes', run
    from testlab.cpu_step import FRAMEWORKS
    assert framework in FRAMEWORKS


def test_the_torch_of_verl_and_skyrl_blocks_is_the_one_make_install_installs():
    makefile = (ROOT / "Makefile").read_text()
    constraints = (ROOT / "constraints.txt").read_text().splitlines()
    for framework in ("verl", "skyrl"):
        _, version, _ = _torch_lines(framework)
        assert f'"torch=={version}+cpu"' in makefile and f"torch=={version}" in constraints, framework


def _drivers(*, index_reachable: bool) -> dict[str, list[str]]:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "guides_fresh_venv.sh"), "--print", *FRESH],
                         env={**os.environ, "TORCH_INDEX_OK": "1" if index_reachable else "0"},
                         capture_output=True, text=True, check=True, timeout=60).stdout
    drivers: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("## "):
            drivers[line[3:]] = []
        else:
            drivers[next(reversed(drivers))].append(line)
    return drivers


def test_the_fresh_venv_script_runs_each_block_as_written():
    """scripts/guides_fresh_venv.sh (run by hand: minutes and GBs) reads each guide's block into the
    commands it runs: every line after the first, verbatim and in order, R3BRIDGE the checkout and VENV
    a new folder; when download.pytorch.org is unreachable, the torch line asks the configured index
    for the CPU build only (torch==X+cpu), never for whatever torch it serves."""
    for reachable in (True, False):
        drivers = _drivers(index_reachable=reachable)
        assert sorted(drivers) == sorted(FRESH)
        for framework, driver in drivers.items():
            block = fresh_venv_block(framework)
            assert f"R3BRIDGE='{ROOT}'; VENV='" in driver[2] and f"/{framework}/venv'" in driver[2], driver[2]
            torch_line, version, _ = _torch_lines(framework)
            wanted = list(block[1:])
            if not reachable:
                i = wanted.index(torch_line)
                wanted[i] = re.sub(rf"(^| )torch=={re.escape(version)}( |$)", rf"\1torch=={version}+cpu\2",
                                   torch_line.replace(f" --index-url {TORCH_CPU_INDEX}", ""))
            ran = [line for line in driver[4:] if not line.startswith(("__t0=", "__rc="))]
            assert ran == wanted, (framework, reachable, ran, wanted)


@pytest.mark.parametrize("framework", FRESH)
def test_fresh_venv_block_pins_what_the_framework_release_pins(framework):
    """torch and every package the block adds for the CPU step, against the release's own metadata
    (the installed wheel): a pin the framework would refuse fails here, not in a user's virtualenv."""
    import tomllib
    from importlib.metadata import distribution
    from importlib.metadata import version as installed_version

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
            if req.name == framework:          # the release the CPU step runs, pinned (SkyRL 0.4 on 3.12: not)
                assert pinned == [dist.version], (arg, dist.version)
                continue
            if req.name == "megatron-core":    # r3bridge's own extra names it: the suite's release, in its range
                assert pinned == [installed_version("megatron-core")], (arg, installed_version("megatron-core"))
                extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
                ours = [r for r in map(Requirement, extra[framework]) if r.name == "megatron-core"]
                assert ours and all(Version(pinned[0]) in r.specifier for r in ours), (arg, [str(r) for r in ours])
                continue
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
    assert "A real AReaL Megatron job needs **Python 3.12**" in (ROOT / "docs" / "use-with-areal.md").read_text()
    assert "3.12 for a real SkyRL or AReaL Megatron job" in " ".join((ROOT / "README.md").read_text().split())


def test_skyrl_guide_says_a_megatron_job_needs_python_312_as_skyrl_declares():
    """SkyRL 0.3.0 declares Python >= 3.11 but its megatron extra brings Megatron-Bridge (which its
    Megatron worker imports at module level) only on Python >= 3.12; the guide, the README and the
    launcher's refusal must say so while the installed release's metadata and code say so."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    dist = distribution("skyrl")
    bridge = [Requirement(r) for r in dist.requires or [] if Requirement(r).name == "megatron-bridge"]
    assert bridge, "skyrl no longer requires megatron-bridge: revisit the guide's Python note"
    env = {"extra": "megatron", "sys_platform": "linux"}
    assert not any(r.marker.evaluate({**env, "python_version": "3.11"}) for r in bridge)
    assert all(r.marker.evaluate({**env, "python_version": "3.12"}) for r in bridge)
    worker = dist.locate_file("skyrl/backends/skyrl_train/workers/megatron/megatron_worker.py").read_text()
    assert "\nfrom megatron.bridge import AutoBridge" in worker        # at module level
    assert "A real SkyRL Megatron job needs **Python 3.12**" in (ROOT / "docs" / "use-with-skyrl.md").read_text()
    assert "3.12 for a real SkyRL or AReaL Megatron job" in " ".join((ROOT / "README.md").read_text().split())





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
    # what the guide says the block prints is what it prints (steps from 1, inspect's columns, its
    # verdict): every line of the guide's "Expected" block that elides nothing, the folder aside
    text = subprocess.run([sys.executable, "-m", "r3bridge", "inspect", "routes"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr
    guide = (ROOT / "docs" / "use-with-skyrl.md").read_text()
    start = guide.index("```\n", guide.index("Expected, after SkyRL's"))
    expected = guide[start + 4:guide.index("```", start + 4)].splitlines()
    printed = (out + text.stdout).replace(str(tmp_path / "routes"), "/tmp/routes").splitlines()
    verbatim = [line for line in expected if "..." not in line]
    assert len(verbatim) >= 6 and all(line in printed for line in verbatim), \
        [line for line in verbatim if line not in printed]
    elided = [part.strip(" ,") for line in expected if "..." in line for part in line.split("...")]
    assert [part for part in elided if part and part not in "\n".join(printed)] == []

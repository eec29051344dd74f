"""`r3bridge demo`: the main job, run for real (HF transformers rollout engine, megatron-core
trainer, CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

KEYS = {"route_agreement", "k3_kl", "abs_diff", "F2", "F5", "replay_coverage"}


def _env_without_matplotlib(tmp_path) -> dict:
    """Every process of the run (the CLI and its spawned ranks) finds a matplotlib that cannot
    be imported, as on an install without it."""
    fake = tmp_path / "no_mpl" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), env.get("PYTHONPATH", "")])
    return env


def _run(args: list[str], env=None, module: str = "r3bridge.cli.main") -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", module, "demo", *args], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _json(proc) -> dict:
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    assert len(lines) == 1, f"--json must print exactly one JSON object, got:\n{proc.stdout}"
    return json.loads(lines[0])


def test_demo_json_without_matplotlib_shows_replay_working(tmp_path):
    env = _env_without_matplotlib(tmp_path)
    check = subprocess.run([sys.executable, "-c", "import matplotlib"], env=env, capture_output=True)
    assert check.returncode != 0                      # the block works
    out = _json(_run(["--json", "--steps", "1"], env=env))
    assert set(out) == {"off", "R2", "R3"}
    for mode, m in out.items():
        assert set(m) == KEYS, mode
    # the trainer's own routers disagree with the engine's (other kernels, bf16 weights)...
    assert out["off"]["route_agreement"] < 0.99
    assert out["off"]["replay_coverage"] == 0.0
    # ...with R3 every router dispatches exactly the engine's routes on every valid row
    assert out["R3"]["route_agreement"] == 1.0
    assert out["R2"]["route_agreement"] == 1.0
    assert out["R3"]["replay_coverage"] > 0.95
    # and the train-vs-rollout mismatch drops
    assert out["R3"]["k3_kl"] < out["off"]["k3_kl"] / 3
    assert out["R3"]["abs_diff"] < out["off"]["abs_diff"]
    # R2 removes the update-staleness part of the drift (its routes are the trainer's own at theta_old)
    assert out["R2"]["k3_kl"] < out["off"]["k3_kl"]


def test_plain_run_without_matplotlib_prints_the_table_and_skips_the_plot(tmp_path):
    env = _env_without_matplotlib(tmp_path)
    plot = tmp_path / "demo.png"
    proc = _run(["--mode", "R3", "--steps", "1", "--tp", "2", "--plot", str(plot)], env=env, module="r3bridge")
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["mode", "route_agreement", "agreement/mean"]   # the metrics' names
    assert lines[1].split()[:2] == ["R3", "1.0000"]
    assert "matplotlib is not installed: the plot is skipped" in proc.stderr
    assert "[r3bridge demo] step 1/1 mode R3 done" in proc.stderr     # progress on stderr
    assert not plot.exists()


def test_demo_interleaved_pipeline_with_lagging_engine_and_plot(tmp_path):
    # VPP runs each update as pp micro-batches (the interleaved schedule needs >= pp); two steps, so
    # the second rollout comes from weights one step behind the trainer
    plot = tmp_path / "demo.png"
    out = _json(_run(["--json", "--steps", "2", "--mode", "R2", "--pp", "2", "--vpp", "2", "--plot", str(plot)]))
    assert out["R2"]["route_agreement"] == 1.0 and out["R2"]["replay_coverage"] == 1.0
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--vpp", "2"], "--vpp N needs N >= 2 and --pp >= 2"),
    (["--pp", "3"], "pp x vpp = 3 must divide"),
    (["--tp", "4"], "--tp must divide"),
    (["--lag", "-1"], "--lag must be >= 0"),
])
def test_demo_rejects_impossible_layouts_before_starting(args, message):
    proc = subprocess.run([sys.executable, "-m", "r3bridge.cli.main", "demo", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "[r3bridge demo]" not in proc.stderr

"""testlab/cpu_step.py's verdict: R2 / R3 fail on any mismatching (token, layer) pair; replay off
reports the same comparison as the baseline, never as a failure (issue 39: `--mode off` printed FAILED)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from testlab.cpu_step import report

ROOT = Path(__file__).resolve().parents[2]

RES = {"metrics": [{"r3bridge/update/coverage": 0.98}],
       "steps": [{"what": "step0 compute_log_prob + update", "checked": 200, "mismatching": 150, "first": ["x"]}]}


def test_off_is_a_baseline_not_a_failure():
    lines, rc = report(RES, "off")
    assert rc == 0 and "FAILED" not in "\n".join(lines)
    assert lines[-1].startswith("cpu_step: BASELINE (replay off): 75% of the (token, layer) pairs routed differently")
    assert "150 routed differently by the trainer's own router (baseline, replay off)" in lines[1]


def test_replay_fails_on_a_mismatch_and_passes_without():
    lines, rc = report(RES, "R3")
    assert rc == 1 and lines[-1] == "cpu_step: FAILED" and "150 mismatching: ['x']" in lines[1]
    ok = {"metrics": [], "steps": [{**RES["steps"][0], "mismatching": 0, "first": []}]}
    assert report(ok, "R2") == (["step0 compute_log_prob + update: 200 (token, layer) pairs checked against the "
                                  "routes they had to dispatch, 0 mismatching", "cpu_step: OK"], 0)


def test_what_python_312_resolves_for_a_cpu_is_refused_in_one_line_each_naming_the_pin():
    """Python 3.12 resolves megatron-core 0.19 (0.17+ are 3.12-only), which imports triton that torch's
    CPU build lacks, and (without the guide's pin) SkyRL 0.4, whose wrapper imports Megatron-Bridge:
    each is said before a rank starts, naming what to install; this environment has neither."""
    from testlab.cpu_step import environment_problems

    assert environment_problems("skyrl") == [] and environment_problems("areal") == []
    versions = {"megatron-core": "0.19.2", "skyrl": "0.4.0"}
    problems = environment_problems("skyrl", installed=versions.get, importable=lambda name: False)
    assert [p.split(":")[0] for p in problems] == [
        "megatron-core 0.19.2 imports triton (megatron/core/transformer/moe/ops/paged_stash.py), which torch's CPU "
        "build does not bring",
        "SkyRL 0.4.0's MegatronModelWrapper imports megatron.bridge at module level (skyrl/backends/skyrl_train/"
        "workers/megatron/megatron_model_wrapper.py), and Megatron-Bridge needs Transformer Engine (a GPU)"]
    assert "pip install megatron-core==0.16.1" in problems[0] and "pip install skyrl==0.3.0" in problems[1]
    assert environment_problems("areal", installed=versions.get, importable=lambda name: False) == problems[:1]
    assert environment_problems("skyrl", installed={"megatron-core": "0.17.0"}.get, importable=lambda n: False) == []
    assert environment_problems("skyrl", installed=versions.get, importable=lambda name: True) == []


def test_skyrl_04_installed_is_refused_before_a_rank_starts():
    """SkyRL 0.4.0's wheel (make install's build/skyrl04) ahead on the path, as `pip install .[skyrl]` leaves
    it on Python 3.12: one line naming the pin, exit 2 (was: a rank's traceback, No module named 'megatron.bridge')."""
    sk04 = os.environ.get("R3BRIDGE_SKYRL04", str(ROOT / "build" / "skyrl04"))
    assert (Path(sk04) / "skyrl").is_dir(), f"SkyRL 0.4 not found in {sk04} (make install puts it there)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([sk04, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "testlab" / "cpu_step.py"), "skyrl"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: SkyRL 0.4.0's MegatronModelWrapper imports megatron.bridge"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "pip install skyrl==0.3.0" in proc.stderr
    assert "cpu_step: skyrl" not in proc.stdout                    # nothing started

"""testlab/cpu_step.py's verdict: R2 / R3 fail on any mismatching (token, layer) pair; replay off
reports the same comparison as the baseline, never as a failure (issue 39: `--mode off` printed FAILED)."""
from __future__ import annotations

from testlab.cpu_step import report

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

"""The GPU grid never hangs: scripts/gpu/nccl_grid.py (lanes of scripts/gpu/nccl_conformance.py)
run on CPU/gloo with one rank failing on purpose and another hanging.

``failfast_tp2_sp`` is the grid's own fail-fast cell: rank 1 raises in its first training
micro-batch while rank 0 waits in the training step's collectives; it passes when the failure is
reported with that rank and every rank is gone within seconds of the raise. ``int_freq_2`` hangs on
rank 0 (``R3BRIDGE_CONFORMANCE_FAULT``): killed at the cell timeout (100 s: the fail-fast cell must
first build its model and run a forward-only pass on a loaded 2-core box). The two cells run in two
lanes at the same time and the driver merges the lanes' results.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_failed_or_hung_rank_aborts_its_cell_and_the_grid_goes_on(tmp_path):
    env = dict(os.environ, R3BRIDGE_CONFORMANCE_FAULT="int_freq_2:0:hang",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/nccl_grid.py"), "--device", "cpu", "--spec", "local",
                           "--cells", "failfast_tp2_sp,int_freq_2", "--cell-timeout", "60", "--deadline", "240",
                           "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=400)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "nccl_grid.json").read_text())
    assert res["all_pass"] is False
    cells = res["releases"]["installed"]["cells"]
    assert len(res["releases"]["installed"]["lanes"]) == 2          # the two cells ran side by side
    failfast, hung = cells["failfast_tp2_sp"], cells["int_freq_2"]
    # the failure shown on purpose: reported with its rank, every rank gone right after the raise
    assert failfast["pass"] is True and failfast["failed_rank"] == 1, failfast
    assert "injected fault: cell failfast_tp2_sp rank 1" in failfast["error"]
    assert failfast["all_ranks_ended_s_after_fault"] < 30
    assert hung["pass"] is False and hung["error"].startswith("timeout"), hung
    assert 60 <= hung["aborted_after_s"] < 60 + 30
    assert "failfast_tp2_sp" in (tmp_path / "nccl_grid.md").read_text()
    assert elapsed < 300


def _step_comparison(maxdiff: float) -> dict:
    return {"grads_equal": maxdiff == 0.0, "losses_equal": True, "terms_equal": True, "only_one_side": [],
            "differing": [] if maxdiff == 0.0 else ["0:decoder.layers.0.mlp.router.weight"], "grad_maxdiff": maxdiff,
            "params": 10}


def _rank(r2: float, r3: float = 0.0, spread: float | None = None, broken: float | None = None) -> dict:
    g = {"native_route_errors": [], "r3_differs_from_native": True,
         "r2_vs_native": _step_comparison(r2), "r3_vs_forced": _step_comparison(r3)}
    if spread is not None:
        g["native_spread"] = _step_comparison(spread)
    if broken is not None:
        g["broken_vs_native"], g["broken_route_errors"] = _step_comparison(broken), []
    return {"grad": g}


def test_gradient_verdict_is_bit_equal_or_bounded_by_the_native_spread():
    """How nccl_conformance reports a cell's gradient check: "bit-equal"; a difference within 2x the
    native step's own run-to-run spread (non-reproducible kernels) as a bound; anything else, a
    difference where the native step is reproducible, or a broken backward not caught, fails."""
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    from nccl_conformance import gradient_verdict

    v = gradient_verdict([_rank(0.0), _rank(0.0, broken=0.5)])
    assert v["r2_vs_native"] == v["r3_vs_forced"] == "bit-equal" and v["broken_backward"] == "caught"
    assert v["gradient_pass"]
    v = gradient_verdict([_rank(1e-3, spread=1e-3), _rank(0.0, spread=0.0)])
    assert v["r2_vs_native"].startswith("bound: max |d| 0.001 <= 2 x native spread 0.001") and v["gradient_pass"]
    assert not gradient_verdict([_rank(1e-2, spread=1e-3)])["gradient_pass"]          # past the bound
    assert not gradient_verdict([_rank(1e-7, spread=0.0)])["gradient_pass"]           # native is exact
    v = gradient_verdict([_rank(0.0, broken=0.0)])
    assert v["broken_backward"] == "NOT CAUGHT" and not v["gradient_pass"]
    assert gradient_verdict([{"refused": "x"}]) == {"gradient_check": "not run"}

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

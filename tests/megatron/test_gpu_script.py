"""scripts/gpu/nccl_conformance.py never hangs: run on CPU/gloo with faults injected on one rank.

One cell raises on rank 1 (the other rank would wait in a collective), the next hangs on rank 0:
both are reported with the failing rank and the run goes on to the next cell in new processes.
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


def test_failed_or_hung_rank_aborts_its_cell_and_the_run_goes_on(tmp_path):
    out = tmp_path / "grid.json"
    env = dict(os.environ, R3BRIDGE_CONFORMANCE_FAULT="ep2:1:raise,int_freq_2:0:hang",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/nccl_conformance.py"), "--device", "cpu",
                           "--cells", "ep2,int_freq_2", "--cell-timeout", "75", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=400)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["all_pass"] is False
    raised, hung = res["cells"]["ep2"], res["cells"]["int_freq_2"]
    assert raised["pass"] is False and raised["failed_rank"] == 1
    assert "injected fault: cell ep2 rank 1" in raised["error"]
    # killed as soon as rank 1 reported, not after the process-group timeout (= cell timeout)
    assert raised["aborted_after_s"] < 75
    assert hung["pass"] is False and hung["error"].startswith("timeout")
    assert 75 <= hung["aborted_after_s"] < 75 + 30
    assert elapsed < 300

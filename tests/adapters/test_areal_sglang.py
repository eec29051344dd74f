"""``scripts/gpu/areal_actor.py --rollout sglang`` on CPU: everything but SGLang itself (issue 46, item 1).

AReaL 1.0.4's own rollout path (its ``RemoteSGLangEngine`` with r3bridge's ``SGLangEngineMixin``, its
``WorkflowExecutor`` running its ``MultiTurnWorkflow`` with r3bridge's ``WorkflowMixin``, aiohttp,
its pause / resume and resubmit loop) against ``testlab.sglang_http_stub``, a CPU stand-in
started with the very command line the device starts ``sglang.launch_server`` with; then AReaL's
``MegatronPPOActor`` trains on those trajectories, R3 and R2, every router row checked. The device
run swaps the stand-in for the real server (docs/gpu-results/sglang-0.5.12/README.md, "AReaL's actor").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from testlab.areal_sglang import RecordedRollout, SGLangServer, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu", "areal_actor.py")


def _run(args: list, out: str, timeout: int = 600) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, *args, "--out", out], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


def test_a_server_that_dies_fails_fast_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "print('cuda init failed: no kernel image', flush=True); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with status 3 before it was ready.*no kernel image"):
        with SGLangServer(cmd, free_port(), str(tmp_path / "log"), timeout=60):
            pass


def test_a_server_that_never_answers_is_killed_at_the_timeout(tmp_path):
    cmd = [sys.executable, "-c", "import time; print('loading weights', flush=True); time.sleep(120)"]
    server = SGLangServer(cmd, free_port(), str(tmp_path / "log"), timeout=3)
    with pytest.raises(RuntimeError, match=r"(?s)not ready after 3 s.*loading weights"):
        with server:
            pass
    assert server.proc.poll() is not None          # its process group was killed


def test_dry_run_builds_the_areal_objects_and_the_server_command(tmp_path):
    got = _run(["--rollout", "sglang", "--dry-run", "--server-pythonpath", "/tmp/site-sglang"], str(tmp_path), 300)
    cmd = got["server_command"]
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag in ("--enable-return-routed-experts", "--skip-tokenizer-init", "--disable-cuda-graph",
                 "--disable-piecewise-cuda-graph"):
        assert flag in cmd
    assert cmd[cmd.index("--attention-backend") + 1] == "triton"
    assert cmd[cmd.index("--sampling-backend") + 1] == "pytorch"
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.25"
    assert got["server_pythonpath"] == "/tmp/site-sglang"
    assert got["engine_config"]["return_routed_experts"] is True
    assert "r3bridge.adapters.areal.hooks.SGLangEngineMixin" in got["engine_class"]
    assert "areal.engine.sglang_remote.RemoteSGLangEngine" in got["engine_class"]
    assert "areal.workflow.multi_turn.MultiTurnWorkflow" in got["workflow_class"]
    assert got["model"] == {"num_layers": 4, "moe_layer_ids": [0, 1, 2, 3], "num_experts": 8, "topk": 2}
    assert [e["turns"] for e in got["episodes"]] == [1, 2, 3, 1, 2, 3, 1, 2]
    assert all(max(e["prompt_ids"]) < 128 for e in got["episodes"])


def test_areal_actor_on_areals_own_rollout_path(tmp_path):
    got = _run(["--device", "cpu", "--rollout", "sglang", "--server-module", "testlab.sglang_http_stub",
                "--steps", "1", "--max-new-tokens", "48"], str(tmp_path))
    assert got["ok"], json.dumps(got)[:4000]
    checks = got["rollout_sglang"]["checks"]
    assert checks["stitching_problems"] == []
    assert checks["multi_turn_samples"] == 5 and checks["samples"] == 8
    assert checks["resubmitted_samples"] > 0 and checks["cached_rows"] > 0
    for mode in ("R3", "R2"):
        m = got["modes"][mode]
        assert m["router_rows_mismatched"] == 0 and m["router_rows_checked"] > 0, mode
        assert m["dispatch_errors"] == [] and m["dispatch_compared"] > 0, mode
        assert m["calls"]["update/recompute"] > 0, mode
    assert (tmp_path / "sglang_server.log").exists()

    # the payloads rebuild the same rollout; a trajectory whose routes differ from them is caught
    with open(tmp_path / "areal_sglang_payloads.json") as f:
        doc = json.load(f)
    from r3bridge.adapters.areal.codec import ROUTES_KEY
    from r3bridge.adapters.areal.sequence_last import sequence_last_routes

    want = RecordedRollout.from_payloads(doc).expected()
    assert int(want.valid.sum()) == checks["rows"]
    trajs = [{"input_ids": torch.tensor([t]), ROUTES_KEY: sequence_last_routes(want.select([i]), [len(t)])}
             for i, t in enumerate(doc["trajectory_tokens"])]
    assert RecordedRollout.from_payloads(doc, trajs).checks()["stitching_problems"] == []
    bad = trajs[3][ROUTES_KEY]                    # [1, L, K, S]: sample 3, layer 2, token 5, one expert swapped
    bad[0, 2, 0, 5] = next(e for e in range(doc["num_experts"]) if e not in bad[0, 2, :, 5].tolist())
    problems = RecordedRollout.from_payloads(doc, trajs).checks()["stitching_problems"]
    assert problems == [f"sample 3: 1 of {int(want.select([3]).valid.sum())} rows differ from the recorded first-seen routes"]



def test_the_servers_port_leaves_room_for_sglangs_grpc_port():
    """SGLang 0.5.12 opens its gRPC port at the HTTP port + 10000 and refuses one over 65535: the
    device's first run drew 65167 from the kernel's ephemeral range and the server never started."""
    import socket

    for _ in range(20):
        port = free_port()
        assert 20000 <= port <= 65535 - 10000
        with socket.socket() as s:                     # the gRPC port was free when it was drawn
            s.bind(("127.0.0.1", port + 10000))

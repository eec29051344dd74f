"""``scripts/gpu/areal_actor.py --rollout sglang`` on CPU: everything but SGLang itself (issue 46, item 1).

AReaL 1.0.4's own rollout path (its ``RemoteSGLangEngine`` with r3bridge's ``SGLangEngineMixin``, its
``WorkflowExecutor`` running its ``MultiTurnWorkflow`` with r3bridge's ``WorkflowMixin``, aiohttp,
its pause / resume and resubmit loop) against ``testlab.sglang_http_stub``, a CPU stand-in
started with the very command line the device starts ``sglang.launch_server`` with; then AReaL's
``MegatronPPOActor`` trains on those trajectories, R3 and R2, every router row checked. The device
run swaps the stand-in for the real server (docs/gpu-results/sglang-0.5.12/README.md, "AReaL's actor").
"""
from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from r3bridge import PayloadError, RouteValueError
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
    device's first run drew 56167 from the kernel's ephemeral range (its gRPC port 66167) and the server never started."""
    import socket

    for _ in range(20):
        port = free_port()
        assert 20000 <= port <= 65535 - 10000
        with socket.socket() as s:                     # the gRPC port was free when it was drawn
            s.bind(("127.0.0.1", port + 10000))


# ------------------------------------------------------------- the device run's payloads (CPU fixture)
# What SGLang 0.5.12 returned to AReaL 1.0.4's client on the H200 (tests/fixtures/sglang_areal/README.md):
# every attempt's request tokens, output tokens and meta_info, the trajectories' tokens; areal_actor.json
# is what that run reported.
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "sglang_areal")


def _recorded() -> tuple[dict, dict]:
    with open(os.path.join(FIXTURE, "areal_sglang_payloads.json")) as f:
        doc = json.load(f)
    with open(os.path.join(FIXTURE, "areal_actor.json")) as f:
        report = json.load(f)
    return doc, report


def _requests_of(doc: dict, tokens: list) -> list[list[dict]]:
    """One trajectory's requests (its turns), each its attempts in the order sent: the attempts whose
    request tokens open the trajectory; an aborted attempt is resubmitted by AReaL's client with its
    output appended to the request, until one finishes."""
    own = [a for a in doc["attempts"] if tokens[:len(a["input_ids"])] == a["input_ids"]]
    requests, current = [], []
    for a in own:
        if current:
            prev = current[-1]
            assert a["input_ids"] == prev["input_ids"] + prev["output_ids"], "a resubmit is not its attempt continued"
        current.append(a)
        if a["meta_info"]["finish_reason"]["type"] != "abort":
            requests.append(current)
            current = []
    assert current == [], "a trajectory ends in an aborted attempt"
    return requests


class _RecordedClient:
    """AReaL's client replaying recorded responses: each attempt's response through AReaL's own
    ``SGLangBackend.parse_generation_response`` (``self.backend``, which r3bridge's rollout hook
    wraps to see each attempt), accumulated as ``RemoteInfEngine.agenerate`` does (output tokens
    appended, the attempts' routes concatenated: AReaL #1207) into AReaL's ``ModelResponse``."""

    def __init__(self) -> None:
        from testlab.areal_env import import_areal

        self.backend = import_areal("areal.engine.sglang_remote").SGLangBackend()
        self._response = import_areal("areal.api.io_struct").ModelResponse

    async def agenerate(self, attempts: list[dict]) -> object:
        output, routes = [], []
        for a in attempts:
            # SGLang's meta_info as recorded, its output_token_logprobs back from the recorded ids
            meta = dict(a["meta_info"], output_token_logprobs=[[0.0, t, None] for t in a["output_ids"]])
            got = self.backend.parse_generation_response({"meta_info": meta})
            output += got.output_tokens
            if got.routed_experts is not None:
                routes.append(got.routed_experts)
        return self._response(input_tokens=list(attempts[0]["input_ids"]), output_tokens=output,
                              output_versions=[0] * len(output), stop_reason=got.stop_reason,
                              routed_experts=np.concatenate(routes) if routes else None)


class _RecordedEpisode:
    """A workflow whose episode sends the trajectory's recorded requests, turn by turn, and returns
    its tokens (``MultiTurnWorkflow``'s ``[1, S]`` ``input_ids``)."""

    async def arun_episode(self, engine, data):
        for request in data["requests"]:
            await engine.agenerate(request)
        return {"input_ids": torch.tensor([data["tokens"]])}


def _adapter_trajectories(doc: dict) -> list[dict]:
    """Each recorded trajectory through AReaL's backend and r3bridge's ``WorkflowMixin`` (its
    resubmit dedup at the backend, its multi-turn stitching), as the device's rollout ran them."""
    from r3bridge.adapters.areal import workflow_class

    workflow = workflow_class(_RecordedEpisode, doc["hf_config"])()
    return [asyncio.run(workflow.arun_episode(_RecordedClient(), {"index": i, "tokens": tokens,
                                                                   "requests": _requests_of(doc, tokens)}))
            for i, tokens in enumerate(doc["trajectory_tokens"])]


def _with_row(doc: dict, attempt: int, row: int, layer: int, slot: int, expert: int) -> dict:
    bad = copy.deepcopy(doc)
    meta = bad["attempts"][attempt]["meta_info"]
    ids = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").copy()
    ids = ids.reshape(-1, doc["num_hidden_layers"], doc["topk"])
    ids[row, layer, slot] = expert
    meta["routed_experts"] = base64.b64encode(ids.tobytes()).decode()
    return bad


def test_every_recorded_attempt_decodes_as_sglang_0_5_12_ships_it():
    from r3bridge.engines.route_formats import decode_engine_routes

    doc, report = _recorded()
    assert len(doc["attempts"]) == report["rollout_sglang"]["attempts"] == 27
    layers, topk = doc["num_hidden_layers"], doc["topk"]
    for i, a in enumerate(doc["attempts"]):
        meta = a["meta_info"]
        got = decode_engine_routes("sglang", meta, version="0.5.12", num_hidden_layers=layers, topk=topk, seq=i)
        assert got.format == "sglang-int32-base64" and got.start_row == 0, i
        # every attempt, aborted ones too, routed each of its tokens but the last (from row 0)
        assert got.routes.shape == (meta["prompt_tokens"] + meta["completion_tokens"] - 1, layers, topk), i
        assert (len(a["input_ids"]), len(a["output_ids"])) == (meta["prompt_tokens"], meta["completion_tokens"]), i
        plain = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(got.routes.shape)
        assert (got.routes == plain).all(), i
        assert ((plain >= 0) & (plain < doc["num_experts"])).all(), i
        assert (plain[..., 0] != plain[..., 1]).all(), i

    # an attempt cut short by one row is refused naming the attempt and both row counts
    short = dict(doc["attempts"][20]["meta_info"])
    short["routed_experts"] = base64.b64encode(base64.b64decode(short["routed_experts"])[:-4 * layers * topk]).decode()
    with pytest.raises(PayloadError, match=r"sequence 20: routed_experts has 126 rows, expected 127"):
        decode_engine_routes("sglang", short, version="0.5.12", num_hidden_layers=layers, topk=topk, seq=20)


def test_the_recorded_rollout_rebuilds_the_device_runs_counts():
    doc, report = _recorded()
    device = report["rollout_sglang"]["checks"]
    want = RecordedRollout.from_payloads(doc).expected()
    # every token of every trajectory but its last has a first-seen route, whatever attempt routed it first
    assert want.rows_per_seq == [len(t) - 1 for t in doc["trajectory_tokens"]]
    assert int(want.valid.sum()) == device["rows"] == 1012

    got = RecordedRollout.from_payloads(doc, _adapter_trajectories(doc)).checks()
    assert got["stitching_problems"] == [] and got["ok"]
    for key in ("attempts", "turns", "resubmits", "resubmitted_samples", "multi_turn_samples", "samples",
                "cached_rows", "cached_rows_differing", "overlap_rows", "overlap_rows_differing", "rows"):
        assert got[key] == device[key], key
    # what the device run reported, and what it means: resubmits and later turns served from SGLang's
    # radix cache, every cached row the same as where it was first seen
    assert (got["resubmits"], got["resubmitted_samples"], got["multi_turn_samples"]) == (12, 7, 5)
    assert got["cached_rows"] == 996 and got["cached_rows_differing"] == 0
    per = got["per_sample"]
    assert any(s["turns"] > 1 and s["resubmits"] > 0 for s in per)       # both stitchings in one sample


def test_a_recorded_row_changed_is_refused_at_its_row():
    doc, _ = _recorded()
    # attempt 26: sample 2's last turn (after two others and one resubmit); its last row, 229, is
    # routed by no other attempt: the trajectory replays it
    meta = doc["attempts"][26]["meta_info"]
    last = meta["prompt_tokens"] + meta["completion_tokens"] - 2
    assert last == len(doc["trajectory_tokens"][2]) - 2
    with pytest.raises(RouteValueError, match=rf"AReaL sample index=2, turn \d.*row {last} \(token {last}\), layer 1: expert ids \[8, \d\] out of range"):
        _adapter_trajectories(_with_row(doc, 26, last, 1, 0, doc["num_experts"]))

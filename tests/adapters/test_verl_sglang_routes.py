"""verl 0.9.1's SGLang rollout reading SGLang 0.5.12's routes through r3bridge
(``r3bridge.adapters.verl.sglang_routes``), on the payloads a real SGLang 0.5.12 returned on the H200
(tests/fixtures/sglang/, docs/gpu-results/sglang-0.5.12).

verl's own reading of them fails (``meta_info["routed_experts"].numpy()`` on SGLang's base64 string):
the first test shows it on the recorded payload, then that the wrapped tokenizer manager hands verl's
very same line an array with the rows the replay needs, equal to what ``ReplayBatch.from_sglang``
decodes, and read by the adapter's first-seen reader as verl's agent loop reads them. SGLang itself cannot
run here: the manager wrapped is a stand-in that streams the recorded outputs as SGLang's
``TokenizerManager.generate_request`` does (an async generator of ``{"output_ids", "meta_info"}``).
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from r3bridge import ReplayBatch
from r3bridge.adapters.verl.rollout import VerlRollout
from r3bridge.adapters.verl.sglang_routes import (
    RoutesReadingTokenizerManager,
    check_sglang_rollout,
    register_sglang_rollout,
    sglang_release,
    verl_routes,
)
from r3bridge.errors import ConfigError, LayerMappingError, PayloadError

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "sglang")


def load(case: str) -> dict:
    with open(os.path.join(FIXTURES, f"sglang_routes_{case}.json")) as f:
        return json.load(f)


class RecordedTokenizerManager:
    """Streams recorded SGLang outputs by request id, as ``TokenizerManager.generate_request`` yields them."""

    def __init__(self, outputs: dict[str, dict]) -> None:
        self.outputs = outputs
        self.server_status = "Up"

    async def generate_request(self, obj, request=None):
        yield self.outputs[obj.rid]


def _served(p: dict, *, version: str = "0.5.12", moe_layer_ids=None, start: int = 0) -> list:
    """Each recorded request through the wrapped manager and verl 0.9.1's own reading
    (async_sglang_server.py:683-686: ``output["meta_info"]["routed_experts"].numpy()``)."""
    outputs = {f"r{i}": {"output_ids": o, "meta_info": m} for i, (o, m) in enumerate(zip(p["outputs"], p["meta_info"]))}

    def read(out, **kw):
        return verl_routes(out, version=version, num_hidden_layers=p["num_hidden_layers"], topk=p["topk"],
                           moe_layer_ids=moe_layer_ids, **kw)

    manager = RoutesReadingTokenizerManager(RecordedTokenizerManager(outputs), read=read)

    async def one(rid: str):
        obj = SimpleNamespace(rid=rid, return_routed_experts=True, routed_experts_start_len=start)
        output = await manager.generate_request(obj, None).__anext__()
        captured = output.get("meta_info", {}).get("routed_experts", None)
        return captured.numpy() if captured is not None else None

    return [asyncio.run(one(rid)) for rid in outputs]


@pytest.mark.parametrize("case", ["chunked_prefill", "radix_cache"])
def test_recorded_routes_reach_verls_agent_loop_as_the_rows_the_replay_needs(case):
    p = load(case)
    with pytest.raises(AttributeError, match="'str' object has no attribute 'numpy'"):
        p["meta_info"][0]["routed_experts"].numpy()          # verl 0.9.1's reading, unwrapped
    got = _served(p, moe_layer_ids=p["moe_layer_ids"])
    want = ReplayBatch.from_sglang(p["meta_info"], num_experts=p["num_experts"], num_layers=p["num_hidden_layers"],
                                   topk=p["topk"], moe_layer_ids=p["moe_layer_ids"], engine_version=p["version"])
    rollout = VerlRollout(num_experts=p["num_experts"], moe_layer_ids=p["moe_layer_ids"],
                          num_hidden_layers=p["num_hidden_layers"], topk=p["topk"])
    for i, arr in enumerate(got):
        tokens = len(p["prompts"][i]) + len(p["outputs"][i])
        assert arr.shape == (tokens - 1, p["num_hidden_layers"], p["topk"]) and arr.dtype == np.int32
        # SGLang's own layout, read independently: flat int32 [tokens - 1, layers, K]
        raw = np.frombuffer(base64.b64decode(p["meta_info"][i]["routed_experts"]), dtype=np.int32)
        assert np.array_equal(arr, raw.reshape(-1, p["num_hidden_layers"], p["topk"]))
        routes, valid = want.sequence(i)
        assert bool(valid.all()) and torch.equal(torch.from_numpy(arr[:, p["moe_layer_ids"]]).to(routes.dtype), routes)
        assert int(arr.max()) < p["num_experts"] and int(arr.min()) >= 0
        stitched, report = rollout.sample_rows([arr], sample=f"r{i}")      # the adapter's agent-loop reading
        assert np.array_equal(stitched, arr) and report.total_disagreeing == 0


def test_what_verls_sglang_path_cannot_read_is_refused():
    dense = load("e320_dense_middle")          # SGLang 0.5.12 ran experts on the checkpoint's dense layer 2
    with pytest.raises(LayerMappingError, match=r"SGLang request 'r0'.*layers \[2\] are dense"):
        _served(dense, moe_layer_ids=dense["moe_layer_ids"])
    turn2 = load("prompt_start")              # request 1 asked for rows from token 22: verl's rows start at 0
    with pytest.raises(PayloadError, match="routed_experts_start_len=22"):
        _served(turn2, start=22)
    with pytest.raises(PayloadError, match="SGLang request 'r1'.*has 13 rows, expected 35"):
        _served({**turn2, "prompt_start": [0, 0]})          # 13 rows where tokens - 1 = 35: the row count says so
    p = load("radix_cache")
    out = {"output_ids": p["outputs"][0], "meta_info": p["meta_info"][0]}
    kw = dict(num_hidden_layers=4, topk=4, request="x")
    twice = {**out, "meta_info": {**out["meta_info"], "routed_experts": base64.b64encode(
        out["meta_info"]["routed_experts"].encode()).decode()}}
    with pytest.raises(PayloadError, match="SGLang 0.5.12 ships sglang-int32-base64.*dynamo #10543"):
        verl_routes(twice, version="0.5.12", **kw)
    raw = {**out, "meta_info": {**out["meta_info"], "routed_experts": torch.from_numpy(
        verl_routes(out, version="0.5.12", **kw).numpy().copy())}}
    with pytest.raises(PayloadError, match="from 0.5.11 the tokenizer manager hands base64"):
        verl_routes(raw, version="0.5.12", **kw)
    assert verl_routes(raw, version="0.5.10", **kw).shape == (49, 4, 4)      # before 0.5.11: the raw tensor
    with pytest.raises(PayloadError, match="no meta_info"):
        verl_routes({"output_ids": [1]}, version="0.5.12", **kw)
    with pytest.raises(PayloadError, match="lacks 'completion_tokens'"):
        verl_routes({"meta_info": {"prompt_tokens": 3, "routed_experts": ""}}, version="0.5.12", **kw)
    with pytest.raises(PayloadError, match="not a version"):
        verl_routes(out, version="latest", **kw)


def test_the_release_is_read_or_refused():
    assert str(sglang_release("0.5.12")) == "0.5.12"
    with pytest.raises(ConfigError, match="engine_version"):
        sglang_release("0.5.x")
    try:
        import sglang  # noqa: F401
    except ImportError:        # this box: SGLang is not installed, and nothing is guessed
        with pytest.raises(ConfigError, match="no SGLang release found"):
            sglang_release(None)


def test_the_rollout_settings_r3bridge_reads_and_verls_registry(monkeypatch):
    check_sglang_rollout({"enable_rollout_routing_replay": True, "skip_tokenizer_init": True})
    check_sglang_rollout({"enable_rollout_routing_replay": False, "skip_tokenizer_init": False})
    with pytest.raises(ConfigError, match="skip_tokenizer_init=False.*routed_experts_capturer"):
        check_sglang_rollout(SimpleNamespace(enable_rollout_routing_replay=True, skip_tokenizer_init=False))
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from r3bridge.adapters.verl import sglang_routes

    monkeypatch.setitem(RolloutReplicaRegistry._registry, "sglang", RolloutReplicaRegistry._registry["sglang"])
    first = register_sglang_rollout()
    assert RolloutReplicaRegistry._registry["sglang"] is sglang_routes._load_sglang_replica
    assert register_sglang_rollout() is False and (first or RolloutReplicaRegistry._registry["sglang"] is not None)
    assert RolloutReplicaRegistry._registry["vllm"] is not sglang_routes._load_sglang_replica

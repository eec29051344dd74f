"""What a real SGLang 0.5.12 returned on an H200 (``tests/fixtures/sglang/``, recorded by
``scripts/gpu/sglang_routes.py``; docs/gpu-results/sglang-0.5.12) through r3bridge's decoders.

Every file is SGLang's ``meta_info`` as ``Engine.generate`` handed it back (base64 int32,
``skip_tokenizer_init``), with the requests' token ids and the model's facts. The model is
rebuilt here from its config and seed (``sglang_routes.write_checkpoint``: the same weights the
engine served), so the engine's routes are compared with the HF model's own top-k on the CPU.
"""
from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest

from r3bridge import ReplayBatch
from r3bridge.engines.route_formats import decode_engine_routes
from r3bridge.errors import LayerMappingError
from r3bridge.rollout.stitching import rollout_routes
from testlab.gpu_scripts import gpu_script
from testlab.sglang_payloads import sglang_format_problems

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "sglang")
MODEL_A_CASES = ("chunked_prefill", "radix_cache", "prompt_start")


def load(case: str) -> dict:
    with open(os.path.join(FIXTURES, f"sglang_routes_{case}.json")) as f:
        return json.load(f)


def _batch(p: dict) -> ReplayBatch:
    return ReplayBatch.from_sglang(p["meta_info"], num_experts=p["num_experts"], num_layers=p["num_hidden_layers"],
                                   topk=p["topk"], moe_layer_ids=p["moe_layer_ids"], start_rows=p["prompt_start"],
                                   engine_version=p["version"])


@pytest.mark.parametrize("case", MODEL_A_CASES)
def test_recorded_payloads_are_in_sglangs_format_and_decode(case):
    p = load(case)
    assert p["recorded"] and p["engine"] == "sglang" and p["version"] == "0.5.12"
    for i, m in enumerate(p["meta_info"]):
        assert sglang_format_problems(m, num_hidden_layers=p["num_hidden_layers"], topk=p["topk"],
                                      num_experts=p["num_experts"], moe_layer_ids=p["moe_layer_ids"],
                                      start=p["prompt_start"][i]) == []
        assert m["prompt_tokens"] == len(p["prompts"][i]) and m["completion_tokens"] == len(p["outputs"][i])
    b = _batch(p)
    assert b.rows_per_seq == [len(q) + len(o) - 1 - s for q, o, s in zip(p["prompts"], p["outputs"], p["prompt_start"])]
    assert b.start_rows == p["prompt_start"] and bool(b.valid.all())


def test_radix_cache_hits_return_the_first_computations_prompt_rows():
    """SGLang 0.5.12 returns the cached prefix's rows (39 of 40 prompt tokens served from the radix
    cache), equal to what the first request computed."""
    first, again = load("chunked_prefill"), load("radix_cache")
    assert [m["cached_tokens"] for m in again["meta_info"]] == [39, 39]
    rows = len(again["prompts"][0]) - 1
    ref = decode_engine_routes("sglang", first["meta_info"][3], version="0.5.12", num_hidden_layers=4, topk=4).routes
    for m in again["meta_info"]:
        got = decode_engine_routes("sglang", m, version="0.5.12", num_hidden_layers=4, topk=4).routes
        np.testing.assert_array_equal(got[:rows], ref[:rows])


def test_a_start_offset_turn_stitches_onto_the_first():
    p = load("prompt_start")
    turns = [decode_engine_routes("sglang", m, version="0.5.12", start_row=s, num_hidden_layers=4, topk=4).routes
             for m, s in zip(p["meta_info"], p["prompt_start"])]
    assert p["prompt_start"][1] == len(p["prompts"][0]) + len(p["outputs"][0]) - 1       # turn 1's last sampled token
    b = rollout_routes([turns], num_experts=p["num_experts"], moe_layer_ids=p["moe_layer_ids"],
                       start_rows=[p["prompt_start"]])
    assert b.rows_per_seq == [len(p["prompts"][1]) + len(p["outputs"][1]) - 1] and bool(b.valid.all())


def test_a_dense_layer_the_engine_ran_as_moe_is_refused():
    """SGLang 0.5.12's Qwen3-MoE ignores ``mlp_only_layers``: the checkpoint's dense layer 2 ran as
    an MoE layer (ids on it, 320-expert ids up to 318): the engine served another model, refused."""
    p = load("e320_dense_middle")
    assert p["moe_layer_ids"] == [0, 1, 3]
    probs = sglang_format_problems(p["meta_info"][0], num_hidden_layers=4, topk=4, num_experts=320,
                                   moe_layer_ids=[0, 1, 3])
    assert probs == ["dense layers [2] hold non-zero ids"]
    raw = np.frombuffer(base64.b64decode(p["meta_info"][0]["routed_experts"]), "<i4")
    assert raw.max() > 255                                    # int32 on the wire: ids above uint8
    with pytest.raises(LayerMappingError, match=r"layers \[2\] are dense in the trainer's model .* engine ran experts "
                                                r"there, so it serves a different model .*SGLang 0.5.12's Qwen3-MoE"):
        _batch(p)


def test_sglangs_routes_are_the_hf_models_own_routing():
    """The HF model rebuilt from the same config and seed (fp32, CPU) picks the same top-k set as
    SGLang (bf16, H200) on most (row, layer) pairs; the first layer, before bf16 drift accumulates,
    nearly always."""
    import torch

    routes = gpu_script("sglang_routes")
    p = load("chunked_prefill")
    torch.manual_seed(0)
    ref = routes.build_reference(routes.hf_config(32, ()), seed=11)
    b = _batch(p)
    agree = total = 0
    first_layer = []
    for i, (q, o) in enumerate(zip(p["prompts"], p["outputs"])):
        want = routes.hf_routes(ref, q + o, p["moe_layer_ids"])
        got = b.routes[int(b.offsets[i]):int(b.offsets[i + 1])].numpy().astype(np.int64)
        eq = (np.sort(got, -1) == np.sort(want, -1)).all(-1)
        agree, total = agree + int(eq.sum()), total + eq.size
        first_layer.append(eq[:, 0].mean())
    assert agree / total > 0.9 and min(first_layer) >= 0.95, (agree / total, first_layer)


def test_sglangs_routes_replay_exactly_in_megatron():
    """The recorded SGLang routes (model A's three cases) replayed under R3 in the megatron-core
    model converted from the HF model the engine served (one gloo rank, local spec, fp32): every
    router row dispatches exactly the engine's routes; the native pass is reported beside."""
    from r3bridge.testing.harness.dist import Layout, spawn_layouts
    from testlab.sglang_payloads import replay_recorded_rank

    [[out]] = spawn_layouts(replay_recorded_rank, world_size=1, layouts=[Layout()],
                            args=(MODEL_A_CASES, 11), timeout=600)
    for case in MODEL_A_CASES:
        o = out[case]
        assert o["result"] == "exact", (case, o)
        assert o["r3_rows"] > 0 and o["r3_mismatching_rows"] == 0 and not o["errors"], (case, o)
        assert 0.5 < o["native_agreement"] <= 1.0, (case, o)

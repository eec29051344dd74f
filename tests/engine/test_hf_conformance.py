"""R3 with a real, independent rollout engine (HF transformers Qwen3-MoE, bf16 weights) against
the converted megatron-core trainer on 1 rank, TP2, PP2 x VPP2, CP2 (MoE-only layers) and EP2.

Per layout, in one process set (testlab/hf_checks.py): the converter's model computes the
HF model's log-probs and top-k sets (fp32, same weights); then off and R3 training passes over a
rollout from real generate() calls (batched left-padded prompts, a multi-turn sample, an aborted and
resubmitted request, a sample with a tail no call routed), routes reaching the trainer only through
ReplayBatch.from_sglang / from_vllm and stitch."""
from __future__ import annotations

import pytest

from r3bridge.testing.harness.dist import Layout, spawn_layouts
from testlab.hf_checks import conformance_rank

LAYOUTS = {"1rank": (1, Layout()), "tp2": (2, Layout(tp=2)), "pp2_vpp2": (2, Layout(pp=2, vpp=2)),
           "cp2": (2, Layout(cp=2)), "ep2": (2, Layout(ep=2))}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    out = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        res = spawn_layouts(conformance_rank, world_size=world, layouts=[LAYOUTS[n][1] for n in names], timeout=900)
        out.update(zip(names, res))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_converted_trainer_computes_what_the_engine_model_computes(results, name):
    for rank, r in enumerate(results[name]):
        e = r["equivalence"]
        assert e["router"]["moe_router_score_function"] == "softmax"
        assert e["router"]["moe_router_pre_softmax"] is False          # HF norm_topk_prob=True
        assert e["router"]["moe_router_topk"] == 2 and e["router"]["num_moe_experts"] == 8
        assert e["router"]["moe_router_num_groups"] is None and e["router"]["moe_router_topk_scaling_factor"] is None
        for lid, total in e["topk_total"].items():
            assert total > 0 and e["topk_same"][lid] / total > 0.99, (rank, lid)
        if "max_abs_logprob_diff" in e:            # last pipeline stage
            assert e["max_abs_logprob_diff"] < 1e-4, e


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_r3_dispatches_exactly_the_engine_routes(results, name):
    lasts = []
    for rank, r in enumerate(results[name]):
        o = r["r3"]
        assert o["stitch_overlap"] > 0
        assert o["valid_rows"] < o["rows"]        # the untracked tail has no route
        for mode in ("off", "R3"):
            assert o[mode]["router_calls"] > 0 and o[mode]["total"] > 0
        # every router dispatched the engine's routes on every valid row under R3 ...
        assert o["R3"]["agree"] == o["R3"]["total"] and o["R3"]["mismatched_rows"] == 0, (rank, o["R3"])
        # ... which the trainer's own router would not have picked everywhere
        assert o["off"]["agree"] < o["off"]["total"], (rank, o["off"])
        assert o["R3"]["metrics"]["r3bridge/agreement/mean"] < 1.0
        assert o["R3"]["metrics"]["r3bridge/native_pairs"] > 0           # invalid rows routed natively
        if "mismatch" in o["R3"]:
            lasts.append(o)
    assert lasts, "no rank reported log-probs"
    for o in lasts:
        off, r3 = o["off"]["mismatch"], o["R3"]["mismatch"]
        assert r3["mismatch/k3_kl"] < off["mismatch/k3_kl"]
        assert r3["mismatch/abs_diff"] < off["mismatch/abs_diff"]

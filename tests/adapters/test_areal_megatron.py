"""AReaL adapter on a real megatron-core model (CPU harness), conformance checks 4 and 5.

``MegatronEngine`` itself cannot be imported here (``mbridge``, and ``areal.infra``'s OpenAI
stack), so the engine is ``tests/adapters/_areal_fixture.StandInMegatronEngine``: its
``_prepare_mb_list`` / ``forward_backward_batch`` for text models, calling AReaL's real
``amend_position_ids``, ``split_padded_tensor_dict_into_mb_list`` (token-balanced, reorders
samples), ``pack_tensor_dict``, ``pad_mb_list`` (per-sequence alignment + a trailing page-padding
"sequence"), ``packed_context_parallel_forward`` and ``unpad_logits``, in AReaL's order. The actor
is ``PPOActor``'s ``compute_logp`` / ``ppo_update`` batching (``batched_call``). r3bridge's
``MegatronEngineMixin`` / ``PPOActorMixin`` are mixed in exactly as in a real job.
Test-only: the harness GPT's learned position embeddings are switched off (AReaL models use RoPE
and feed un-split ``position_ids`` under CP).
"""
from __future__ import annotations

import importlib.util

import pytest

from r3bridge.testing.dist import Layout, spawn_layouts

assert importlib.util.find_spec("areal") is not None, "areal is not installed: run `make install`"

GROUPS = [[0, 3], [1, 2], [4, 5], [6, 7]]
REGROUPED = [[5, 1], [0, 4], [2, 7], [3, 6]]


def _cell(ctx):
    from _areal_fixture import ArealRunner
    from r3bridge.testing.conformance import make_rollout, megatron_r2_check, megatron_r3_check
    from r3bridge.testing.models import ModelSpec, build_model_chunks

    spec = ModelSpec(num_layers=4, moe_layer_freq=[0, 1, 1, 1], attention="identity",
                     moe_token_dispatcher_type="alltoall", extra_config={"variable_seq_lengths": True})
    rollout = make_rollout(11, batch_size=8, num_experts=spec.num_moe_experts, topk=spec.moe_router_topk)
    return {"r3": megatron_r3_check(ctx, ArealRunner(), rollout, GROUPS, build_model_chunks(spec, ctx)),
            "r2": megatron_r2_check(ctx, ArealRunner(), rollout, GROUPS, REGROUPED, build_model_chunks(spec, ctx))}


@pytest.mark.slow
def test_areal_engine_replays_exactly():
    layouts = [Layout(tp=2), Layout(cp=2), Layout(pp=2, vpp=2)]     # SP split, CP zigzag, interleaved VPP
    res = spawn_layouts(_cell, world_size=2, layouts=layouts, timeout=600)
    for lay, per_rank in zip(layouts, res):
        checked = 0
        for r in per_rank:
            assert r["r3"]["errors"] == [], (lay, r["r3"]["errors"])
            checked += r["r3"]["checked_rows"]
            assert r["r3"]["metrics"]["r3bridge/coverage"] > 0.8, (lay, r["r3"]["metrics"])
            assert r["r2"]["agreement"] == pytest.approx(1.0), (lay, r["r2"])
            # the update's driver metrics reach AReaL's stats tracker, tagged by phase
            logged = r["r2"]["framework_metrics"]
            assert logged["r3bridge/update/agreement/mean"] == pytest.approx(1.0), (lay, logged)
            assert logged["r3bridge/update/coverage"] == pytest.approx(r["r2"]["metrics"]["r3bridge/coverage"])
            assert len(r["r2"]["recorded_rows"]) == 8
        assert checked > 0, lay

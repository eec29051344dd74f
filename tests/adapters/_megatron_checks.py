"""Conformance checks 4 and 5 of one adapter runner on the layouts every packed-THD adapter must
pass (TP2 + SP, CP2, PP2 + VPP2), with the assertions they share."""
from __future__ import annotations

from typing import Any, Callable

import pytest

from r3bridge.testing.dist import Layout, spawn_layouts

LAYOUTS = [Layout(tp=2), Layout(cp=2), Layout(pp=2, vpp=2)]     # SP split, CP zigzag, interleaved VPP
GROUPS = [[0, 3], [1, 2], [4, 5], [6, 7]]                       # micro-batches of the compute_log_prob pass
REGROUPED = [[5, 1], [0, 4], [2, 7], [3, 6]]                    # R2 replay re-partitioned differently


def run_checks(ctx: Any, make_runner: Callable[[Any], Any]) -> dict:
    """Rank function body: ``make_runner(rollout)`` builds a fresh MegatronRunner per check."""
    from r3bridge.testing.conformance import make_rollout, megatron_r2_check, megatron_r3_check
    from r3bridge.testing.models import ModelSpec, build_model_chunks

    spec = ModelSpec(num_layers=4, moe_layer_freq=[0, 1, 1, 1], attention="identity",
                     moe_token_dispatcher_type="alltoall", extra_config={"variable_seq_lengths": True})
    rollout = make_rollout(11, batch_size=8, num_experts=spec.num_moe_experts, topk=spec.moe_router_topk)
    return {"r3": megatron_r3_check(ctx, make_runner(rollout), rollout, GROUPS, build_model_chunks(spec, ctx)),
            "r2": megatron_r2_check(ctx, make_runner(rollout), rollout, GROUPS, REGROUPED,
                                    build_model_chunks(spec, ctx))}


def spawn_and_check(rank_fn: Callable[[Any], dict]) -> list[list[dict]]:
    """Run ``rank_fn`` on every layout (2 ranks) and assert checks 4 and 5; returns the results."""
    res = spawn_layouts(rank_fn, world_size=2, layouts=LAYOUTS, timeout=600)
    for lay, per_rank in zip(LAYOUTS, res):
        checked = 0
        for r in per_rank:
            assert r["r3"]["errors"] == [], (lay, r["r3"]["errors"])                                  # (4)
            checked += r["r3"]["checked_rows"]
            assert r["r3"]["metrics"]["r3bridge/coverage"] > 0.8, (lay, r["r3"]["metrics"])
            r2 = r["r2"]                                                                             # (5)
            assert r2["recorded_rows"] is not None and len(r2["recorded_rows"]) == 8, (lay, r2)
            assert r2["agreement"] == pytest.approx(1.0), (lay, r2)
        assert checked > 0, lay
        # replaying the recorded routes re-partitioned reproduces the recording pass's outputs
        diffs = [r["r2"]["max_logprob_diff"] for r in per_rank if r["r2"]["max_logprob_diff"] is not None]
        assert diffs and max(diffs) < 1e-5, (lay, diffs)
    return res

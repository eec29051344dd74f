"""Rank function: what rows without a route do to the router's statistics in an R3 training step.

One micro-batch (packing padding + every ``invalid_every``-th row without a route) through a
MoE-only model (``attention='identity'``: rows never mix, so a row's hidden state depends on its
own token only), aux loss + z-loss on, expert bias optional. Returned per MoE layer: the aux loss
and z-loss megatron's tracker recorded, the expert-bias token counts (``local_tokens_per_expert``,
with expert bias), and the routed-row and all-row counts of the replayed experts from the
harness's own packing reference (``replay_grid.expected_rows``, independent of ``r3bridge.shard``).

``perturb=True`` changes the tokens of every row without a route (routed rows unchanged): with the
mask, nothing in the statistics may move. Used by tests/megatron/test_stats_mask.py and
scripts/padding_mask_effect.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from replay_grid import _install_step, expected_rows, make_routes

from r3bridge.testing.harness.data import make_packed_batch
from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

if TYPE_CHECKING:  # pragma: no cover
    from r3bridge.testing.harness.dist import RankContext


def stats_spec(expert_bias: bool = False, **kw: Any) -> ModelSpec:
    extra: dict[str, Any] = {"moe_z_loss_coeff": 1e-3}
    if expert_bias:
        extra.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    return ModelSpec(attention="identity", moe_aux_loss_coeff=1e-2, extra_config=extra, **kw)


def _tracker_values(name: str) -> list[float]:
    """Per-layer values of one metric in the installed release's MoE tracker."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:                    # 0.16 / 0.17
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        entry = get_moe_layer_wise_logging_tracker().get(name)
        return [] if entry is None else entry["values"].tolist()
    entry = get_moe_metrics_tracker().metrics.get(name)
    return [] if entry is None else entry.values.tolist()


def run_stats_case(ctx: "RankContext", mask: bool, perturb: bool, seq_lens: list[int], pad_to: int,
                   invalid_every: int, spec: ModelSpec) -> dict[str, Any]:
    from r3bridge.megatron import Replayer

    chunks = build_model_chunks(spec, ctx)        # resets megatron's tracker
    rep = Replayer(chunks, mask_unrouted_rows=mask)
    batch = make_packed_batch(seq_lens, spec.vocab_size, 5, pad_to=pad_to)
    routes = make_routes(rep.layout, seq_lens, spec.num_moe_experts, spec.moe_router_topk, 9, invalid_every)
    ref = {lid: expected_rows(batch, routes, ctx, False, lid) for lid in rep.layer_ids}
    valid = next(iter(ref.values()))[1]
    if perturb:
        g = torch.Generator().manual_seed(77)
        other = torch.randint(1, spec.vocab_size, batch.input_ids.shape, generator=g)
        batch.input_ids[:] = torch.where(valid, batch.input_ids, other)
    fs = make_forward_step(ctx, thd=True)
    with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st:
        run_schedule(chunks, [batch], _install_step(st, fs, {id(batch): routes}, {id(batch): list(range(len(seq_lens)))}),
                     forward_only=False)
    routers = {lid: r for c in rep.chunks for lid, r in c.routers.items()}
    return {
        "rows": int(valid.numel()), "routed_rows": int(valid.sum()),
        "aux_loss": _tracker_values("load_balancing_loss"),
        "z_loss": _tracker_values("z_loss"),
        "tokens_per_expert": {lid: routers[lid].local_tokens_per_expert.tolist() for lid in rep.layer_ids
                              if routers[lid].local_tokens_per_expert is not None},
        "expected_routed_counts": {
            lid: torch.bincount(t[v].flatten(), minlength=spec.num_moe_experts).tolist()
            for lid, (t, v) in ref.items()},
        "metrics": dict(st.metrics),
    }


def run_stats_checks(ctx: "RankContext", seq_lens: list[int], pad_to: int, invalid_every: int,
                     spec_kw: dict[str, Any]) -> dict[str, Any]:
    spec = stats_spec(**spec_kw)
    out: dict[Any, Any] = {(mask, perturb): run_stats_case(ctx, mask, perturb, seq_lens, pad_to, invalid_every, spec)
                           for mask in (True, False) for perturb in (False, True)}
    # selective MoE recompute: the statistics are taken in the recompute, outside any forward
    rc = stats_spec(recompute="moe", **spec_kw)
    out["recompute"] = [run_stats_case(ctx, True, p, seq_lens, pad_to, invalid_every, rc) for p in (False, True)]
    out["expert_bias"] = run_stats_case(ctx, True, False, seq_lens, pad_to, invalid_every,
                                        stats_spec(expert_bias=True, **spec_kw))
    return out

"""Replay policies and the router log-ratio on one real CPU megatron model (one rank).

``run_policy_checks`` runs the same micro-batch natively, with hard replay, and with the
threshold policy at ratio ~0 and 1, recording every router call (its routing map, its input
hidden states) and what the driver reported; the test asserts on them."""

from __future__ import annotations

from typing import Any

import torch
from replay_grid import _install_step, make_routes

from r3bridge import shard
from r3bridge.testing.harness.data import make_packed_batch
from r3bridge.testing.harness.dist import RankContext
from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
from r3bridge.testing.harness.probe import RoutingProbe
from r3bridge.testing.harness.schedule import make_forward_step, run_schedule


def _router_inputs(chunks) -> tuple[dict[int, Any], list[Any]]:
    """Each decoder router's input hidden states of the last call, by global layer id."""
    seen: dict[int, Any] = {}
    handles = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is None:
                continue
            lid = router.layer_number - 1

            def hook(module, args, _out, lid=lid):
                seen[lid] = (module, args[0].detach().clone())

            handles.append(router.register_forward_hook(hook))
    return seen, handles


def run_policy_checks(ctx: RankContext) -> dict[str, Any]:
    from r3bridge.megatron import Replayer

    spec = ModelSpec()
    chunks = build_model_chunks(spec, ctx)
    fs = make_forward_step(ctx, thd=False)
    batch = make_packed_batch([13, 7, 20], spec.vocab_size, 1)
    g = torch.Generator().manual_seed(5)
    probe = Replayer(chunks)  # only for the layout; every run below builds its own
    layout = probe.layout
    probe.detach()
    plain = make_routes(layout, batch.seq_lens, spec.num_moe_experts, spec.moe_router_topk, 21, invalid_every=5)
    routes = plain.with_weights(torch.rand(plain.routes.shape, generator=g) * 0.9 + 0.05)
    out: dict[str, Any] = {}

    import torch.distributed as dist

    def run(name: str, action: str, **policy: Any) -> None:
        rep = Replayer(chunks, **policy)
        by, ids = {id(batch): routes if action == "replay" else None}, {id(batch): [0, 1, 2]}
        seen, handles = _router_inputs(chunks)
        reduces, real_all_reduce = [], dist.all_reduce

        def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:     # the step's collectives, counted
            reduces.append(1)
            return real_all_reduce(*args, **kwargs)
        try:
            with RoutingProbe(chunks) as probe:
                with rep.open_pass(action, forward_only=True, route_kind="rollout" if action == "replay" else None) as st:
                    run_schedule(chunks, [batch], _install_step(st, fs, by, ids), forward_only=True)
                    ratio = st.router_log_ratio(0, 0)
                    ratio = None if ratio is None else ratio.clone()
                    dist.all_reduce = counting_all_reduce               # the step ends (metrics) with this block
        finally:
            dist.all_reduce = real_all_reduce
            for h in handles:
                h.remove()
            rep.detach()
        res = {
            "maps": {c.layer_id: c.routing_map for c in probe.calls},
            "metrics": dict(st.metrics),
            "log_ratio": ratio,
            "all_reduces": len(reduces),
            "metrics_groups": len(rep.metrics_groups),
        }
        if name == "hard":
            # the direct computation: the router's own logits (its gating linear) of each row,
            # log-softmax over the K replayed experts, minus the log of the rollout's weights
            targets = shard(routes, rep.layout, batch.seq_lens, cu_seqlens_padded=batch.cu_seqlens_padded)
            direct = torch.zeros(targets.num_rows, dtype=torch.float64)
            for lid, (router, hidden) in seen.items():
                with torch.no_grad():
                    logits = router.gating(hidden).view(-1, spec.num_moe_experts).double()
                idx = targets.indices[lid]
                term = torch.log_softmax(logits.gather(1, idx), -1) - targets.weights[lid].double().log()
                direct += torch.where(targets.valid[:, None], term, 0.0).sum(-1)
            res["direct"] = direct
            res["valid"] = targets.valid
            res["targets"] = targets.indices
        out[name] = res

    run("native", "native")
    run("hard", "replay")
    run("tiny_ratio", "replay", replay_policy="threshold", threshold_ratio=1e-30)
    run("ratio_one", "replay", replay_policy="threshold", threshold_ratio=1.0)
    run("ratio_mid", "replay", replay_policy="threshold", threshold_ratio=0.5)
    return out

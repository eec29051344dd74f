"""Routing-weights replay and recording on one real CPU megatron-core model (one rank).

``run_weights_checks`` runs R3w's two passes (compute_log_prob: the engine's ids replayed, their
combine weights recorded; update: ids and weights replayed) before and after perturbing every
router, the same update without ``replay_weights``, R3 with an engine's weights, R2 with recorded
weights, and the refusals; it keeps every MoE layer's output, the routers' final probs, the
routers' gradients and the driver's metrics for the test to assert on."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from replay_grid import _install_step, make_routes

from r3bridge import shard
from r3bridge.testing.harness.data import make_packed_batch
from r3bridge.testing.harness.dist import RankContext
from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
from r3bridge.testing.harness.probe import RoutingProbe
from r3bridge.testing.harness.schedule import make_forward_step, run_schedule, zero_grads

SCALE = 2.5     # moe_router_topk_scaling_factor: engine weights come before it, recorded ones after


def _moe_layers(chunks) -> dict[int, Any]:
    return {layer.mlp.router.layer_number - 1: layer.mlp for chunk in chunks for layer in chunk.decoder.layers
            if getattr(getattr(layer, "mlp", None), "router", None) is not None}


def _capture(moe: dict[int, Any]) -> tuple[dict[int, dict[str, torch.Tensor]], list[Any]]:
    """Each MoE layer's input and output hidden states ([tokens, hidden]) of the last forward."""
    seen: dict[int, dict[str, torch.Tensor]] = {}
    handles = []
    for lid, layer in moe.items():
        def hook(module, args, out, lid=lid):
            h = args[0]
            seen[lid] = {"input": h.detach().reshape(-1, h.shape[-1]).clone(),
                         "output": out[0].detach().reshape(-1, h.shape[-1]).clone()}
        handles.append(layer.register_forward_hook(hook))
    return seen, handles


def _error(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:          # the test asserts the class and the message
        return type(e).__name__, str(e)
    return "", "no error"


def run_weights_checks(ctx: RankContext) -> dict[str, Any]:
    from r3bridge.megatron import Replayer

    spec = ModelSpec(moe_aux_loss_coeff=0.0, extra_config={"moe_router_topk_scaling_factor": SCALE})
    chunks = build_model_chunks(spec, ctx)
    moe = _moe_layers(chunks)
    fs = make_forward_step(ctx, thd=False, collect_logits=True)
    batch = make_packed_batch([13, 7, 20], spec.vocab_size, 1)
    rep = Replayer(chunks)
    layout = rep.layout
    rollout = make_routes(layout, batch.seq_lens, spec.num_moe_experts, spec.moe_router_topk, 21, invalid_every=5)
    g = torch.Generator().manual_seed(7)
    engine_weights = rollout.with_weights(torch.rand(rollout.routes.shape, generator=g) * 0.4 + 0.05)
    ids = {id(batch): [0, 1, 2]}
    routers = {lid: m.router for lid, m in moe.items()}

    def run(action: str, routes: Any, *, forward_only: bool, route_kind: str | None, **weights: bool) -> dict:
        zero_grads(chunks)
        seen, handles = _capture(moe)
        try:
            with rep.open_pass(action, forward_only=forward_only, route_kind=route_kind, **weights) as st:
                with RoutingProbe(chunks) as probe:     # inside the pass: its hooks run after the driver's
                    res = run_schedule(chunks, [batch], _install_step(st, fs, {id(batch): routes}, ids),
                                       forward_only=forward_only)
        finally:
            for h in handles:
                h.remove()
        grads = {lid: None if r.weight.grad is None else r.weight.grad.clone() for lid, r in routers.items()}
        return {"moe": seen, "probs": {c.layer_id: c.probs.detach().clone() for c in probe.calls},
                "maps": {c.layer_id: c.routing_map.clone() for c in probe.calls},
                "metrics": dict(st.metrics), "recorded": st.recorded, "logits": res[0].logits, "grads": grads}

    out: dict[str, Any] = {"seq_lens": batch.seq_lens, "cu": batch.cu_seqlens_padded.tolist(), "scale": SCALE}
    # R3w: compute_log_prob replays the engine's ids and records their combine weights
    r3w_record = run("replay", rollout, forward_only=True, route_kind="rollout", record_weights=True)
    recorded = r3w_record["recorded"]
    out["r3w_record"] = r3w_record
    out["rollout"] = rollout
    # the update replays ids and weights: once as is, once after every router's weights moved
    out["update_w"] = run("replay", recorded, forward_only=False, route_kind="recorded", replay_weights=True)
    saved = {lid: r.weight.detach().clone() for lid, r in routers.items()}
    with torch.no_grad():
        for r in routers.values():
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * 0.5)
    try:
        out["update_w_moved"] = run("replay", recorded, forward_only=False, route_kind="recorded",
                                    replay_weights=True)
        out["update_ids_moved"] = run("replay", recorded, forward_only=False, route_kind="recorded")
        # the aux loss is computed from the router's logits, not through the combine weights: with
        # it on, the router still gets its gradient under replay_weights
        config = chunks[0].config
        config.moe_aux_loss_coeff = 1e-2
        try:
            out["update_w_aux"] = run("replay", recorded, forward_only=False, route_kind="recorded",
                                      replay_weights=True)
        finally:
            config.moe_aux_loss_coeff = 0.0
        # the direct computation of the first MoE layer's output with the recorded weights: each
        # token's experts (its recorded ids) called on its input, scaled by the recorded weight
        first = min(moe)
        h = out["update_w_moved"]["moe"][first]["input"]
        t = shard(recorded, layout, batch.seq_lens, cu_seqlens_padded=batch.cu_seqlens_padded)
        col = recorded.layer_ids.index(first)
        w = torch.zeros(t.num_rows, spec.moe_router_topk)
        w[t.valid] = recorded.weights[:, col].float()     # one recorded row per real token, in order
        idx = t.indices[first]
        direct = torch.zeros_like(h)
        with torch.no_grad():
            experts = moe[first].experts.local_experts
            for k in range(idx.shape[1]):
                for e in range(len(experts)):
                    rows = (idx[:, k] == e) & t.valid
                    if rows.any():
                        direct[rows] += experts[e](h[rows], w[rows, k])[0]
        out["direct_first_layer"] = (first, direct, t.valid)
    finally:
        with torch.no_grad():
            for lid, r in routers.items():
                r.weight.copy_(saved[lid])

    # R3 with an engine's weights (replay_weights=rollout) beside plain R3 on the same routes
    out["r3_engine_w"] = run("replay", engine_weights, forward_only=False, route_kind="rollout", replay_weights=True)
    out["r3_plain"] = run("replay", engine_weights, forward_only=False, route_kind="rollout")
    out["engine_targets"] = shard(engine_weights, layout, batch.seq_lens, cu_seqlens_padded=batch.cu_seqlens_padded)
    # R2 with weights: the record pass records the trainer's own ids and combine weights
    r2 = run("record", None, forward_only=True, route_kind=None, record_weights=True)
    out["r2_record"] = r2
    out["r2_update_w"] = run("replay", r2["recorded"], forward_only=False, route_kind="recorded",
                             replay_weights=True)

    # the same R3w pair through the phase runner every adapter uses (ReplayConfig.replay_weights):
    # compute_log_prob's result carries the recording, the update replays it
    out["runner"] = _through_phase_runner(rep, chunks, batch, rollout, fs)

    # refusals
    out["err_no_weights"] = _error(lambda: run("replay", rollout, forward_only=False, route_kind="rollout",
                                               replay_weights=True))
    out["err_recorded_without_weights"] = _error(lambda: run(
        "replay", recorded.with_weights(None), forward_only=False, route_kind="recorded", replay_weights=True))
    out["err_rollout_for_recorded"] = _error(lambda: run("replay", engine_weights, forward_only=False,
                                                         route_kind="recorded", replay_weights=True))
    out["err_record_in_update"] = _error(lambda: rep.open_pass("replay", forward_only=False, route_kind="rollout",
                                                               record_weights=True))
    out["err_weights_native"] = _error(lambda: rep.open_pass("native", forward_only=True, replay_weights=True))
    rep.detach()
    # a Replayer configured with a replay_weights setting refuses a pass opened from the action
    # alone (it would replay ids only); the plan carries the flags
    from r3bridge.config import Phase, ReplayConfig
    cfg = ReplayConfig(replay_mode="R3", replay_weights="recorded")
    configured = Replayer.from_config(chunks, cfg)
    try:
        out["err_action_only"] = _error(lambda: configured.open_pass("replay", forward_only=False,
                                                                     route_kind="recorded"))
        out["err_plan_contradicted"] = _error(lambda: configured.open_pass(cfg.plan(Phase.UPDATE), forward_only=False,
                                                                           replay_weights=False))
        p = configured.open_pass(cfg.plan(Phase.UPDATE), forward_only=False)
        out["plan_pass"] = (p.action.value, p.route_kind, p.replay_weights, p.record_weights)
    finally:
        configured.detach()
    # recompute (activation checkpointing) substitutes the recorded weights too: with every router
    # moved, an update with full or MoE recompute gives the same gradients as the one without
    out["recompute"] = _recompute_grads(ctx, spec, chunks, recorded, batch, g)
    return out


def _through_phase_runner(rep, chunks, batch, rollout, fs) -> dict[str, Any]:
    from r3bridge.config import Phase, ReplayConfig
    from r3bridge.megatron import MicroBatch
    from r3bridge.session import PhaseRunner

    runner = PhaseRunner(rep, ReplayConfig(replay_mode="R3", replay_weights="recorded"))

    def micro_batch(routes: Any) -> list[MicroBatch]:
        return [MicroBatch(batch.seq_lens, routes, sample_ids=[0, 1, 2], cu_seqlens_padded=batch.cu_seqlens_padded)]

    with runner.run(Phase.OLD_LOG_PROB, forward_only=True, targets=micro_batch(rollout)) as ps:
        run_schedule(chunks, [batch], fs, forward_only=True)
    old = ps.result
    recorded = old.recorded_for(3)
    with runner.run(Phase.UPDATE, forward_only=False, targets=micro_batch(recorded)) as ps:
        run_schedule(chunks, [batch], fs, forward_only=False)
    return {"plans": (runner.plan(Phase.OLD_LOG_PROB), runner.plan(Phase.UPDATE)), "recorded": recorded,
            "old": old.tagged, "update": ps.result.tagged}


def _recompute_grads(ctx: RankContext, spec: ModelSpec, chunks, recorded, batch, g: torch.Generator) -> dict:
    """Every parameter's gradient of an R3w update (recorded ids and weights replayed) with each
    router moved, without recompute and with each recompute mode, on models of the same weights."""
    from r3bridge.megatron import Replayer

    state = [c.state_dict() for c in chunks]
    noise = {name: torch.randn(p.shape, generator=g) * 0.5 for name, p in chunks[0].named_parameters()
             if name.endswith("router.weight")}
    fs = make_forward_step(ctx, thd=False)
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for mode in (None, "full", "moe"):
        model = chunks if mode is None else build_model_chunks(dataclasses.replace(spec, recompute=mode), ctx)
        for c, sd in zip(model, state):
            c.load_state_dict(sd)
        with torch.no_grad():
            for name, p in model[0].named_parameters():
                if name in noise:
                    p.add_(noise[name])
        rep = Replayer(model)
        zero_grads(model)
        try:
            with rep.open_pass("replay", forward_only=False, route_kind="recorded", replay_weights=True) as st:
                run_schedule(model, [batch], _install_step(st, fs, {id(batch): recorded}, {id(batch): [0, 1, 2]}),
                             forward_only=False)
        finally:
            rep.detach()
        grads[str(mode)] = {n: p.grad.clone() for n, p in model[0].named_parameters() if p.grad is not None}
        for c, sd in zip(model, state):      # the shared model back as it was
            c.load_state_dict(sd)
    return grads

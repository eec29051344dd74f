"""Misuse and peer-bug scenarios of the Megatron driver, run on one real CPU model (one rank).

``run_driver_checks`` returns, per scenario, what happened: the exception type and message, or
the observations the test asserts on. Each scenario is a bug a peer framework shipped or a
driver guard (docs/driver-api.md).
"""
from __future__ import annotations

import traceback
from typing import Any, Callable

from replay_grid import _install_step, make_routes

from r3bridge.testing.harness.data import make_packed_batch
from r3bridge.testing.harness.dist import RankContext
from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
from r3bridge.testing.harness.probe import RoutingProbe
from r3bridge.testing.harness.schedule import make_forward_step, run_schedule, zero_grads

GUARDED_OPTIONS: dict[str, tuple[str, Any]] = {
    "fused_router": ("moe_router_fusion", True),
    "sinkhorn": ("moe_router_load_balancing_type", "sinkhorn"),
    "capacity_factor": ("moe_expert_capacity_factor", 1.0),
    "pad_to_capacity": ("moe_pad_expert_input_to_capacity", True),
    "forced_balancing": ("moe_router_force_load_balancing", True),
    "router_cuda_graph": ("cuda_graph_impl", "local"),
    "partial_recompute": ("num_microbatches_with_partial_activation_checkpoints", 1),
    "overlapped_1f1b": ("overlap_moe_expert_parallel_comm", True),
    "megatron_replay_on": ("moe_enable_routing_replay", True),
}


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    return _outcome_of(fn)


def _outcome_of(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        value = fn()
        return {"ok": True, "value": value}
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return {"ok": False, "type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                "message": str(e), "trace": traceback.format_exc()[-2000:]}


def run_driver_checks(ctx: RankContext) -> dict[str, Any]:
    from r3bridge.megatron import Replayer

    spec = ModelSpec()
    out: dict[str, Any] = {}
    fs = make_forward_step(ctx, thd=False)
    b0 = make_packed_batch([13, 7, 20], spec.vocab_size, 1)
    b1 = make_packed_batch([9, 15, 11], spec.vocab_size, 2, pad_to=40)
    ids = {id(b0): [0, 1, 2], id(b1): [3, 4, 5]}

    # --- orphan routers: a decoder built twice; only the chunks handed to the Replayer replay
    orphan = build_model_chunks(spec, ctx)
    chunks = build_model_chunks(spec, ctx)
    config = chunks[0].config

    # --- guards: each option alone makes Replayer() refuse
    for name, (field, value) in GUARDED_OPTIONS.items():
        old = getattr(config, field)
        extra = {}
        if field == "cuda_graph_impl":
            extra = {"cuda_graph_scope": []}
        olds = {k: getattr(config, k) for k in extra}
        setattr(config, field, value)
        for k, v in extra.items():
            setattr(config, k, v)
        try:
            out[f"guard_{name}"] = _outcome(lambda: Replayer(chunks))
        finally:
            setattr(config, field, old)
            for k, v in olds.items():
                setattr(config, k, v)

    rep = Replayer(chunks)
    layout = rep.layout
    routes0 = make_routes(layout, b0.seq_lens, spec.num_moe_experts, spec.moe_router_topk, 11)
    routes1 = make_routes(layout, b1.seq_lens, spec.num_moe_experts, spec.moe_router_topk, 12)
    by = {id(b0): routes0, id(b1): routes1}

    with RoutingProbe(orphan) as orphan_probe, RoutingProbe(chunks) as probe:
        with rep.open_pass("replay", forward_only=True, route_kind="rollout") as st:
            run_schedule(chunks, [b0], _install_step(st, fs, by, ids), forward_only=True)
        run_schedule(orphan, [b0], fs, forward_only=True)
    out["orphan"] = {
        "orphan_hooks": [r.router_replay is not None for c in orphan for r in _routers(c)],
        "orphan_topk": [c.topk().tolist() for c in orphan_probe.calls],
        "replayed_topk": [c.topk().tolist() for c in probe.calls],
        "targets": {lid: routes0.sequence(0)[0][:, j].sort(-1).values.tolist() for j, lid in enumerate(routes0.layer_ids)},
        "unmanaged": rep.unmanaged_calls,
    }

    # --- forward without install under replay; install twice without a forward
    def forward_without_install():
        with rep.open_pass("replay", forward_only=True, route_kind="rollout"):
            run_schedule(chunks, [b0], fs, forward_only=True)
    out["forward_without_install"] = _outcome(forward_without_install)

    def install_twice():
        with rep.open_pass("replay", forward_only=True, route_kind="rollout") as st:
            st.install(chunks[0], routes0, b0.seq_lens, cu_seqlens_padded=b0.cu_seqlens_padded)
            st.install(chunks[0], routes0, b0.seq_lens, cu_seqlens_padded=b0.cu_seqlens_padded)
    out["install_twice"] = _outcome(install_twice)

    # --- targets whose row count differs from what the router sees
    def wrong_rows():
        with rep.open_pass("replay", forward_only=True, route_kind="rollout") as st:
            def bad_step(it, model):
                batch = next(it)
                st.install(model, routes1, b1.seq_lens)   # b1's plan for b0's tokens
                return fs(iter([batch]), model)
            run_schedule(chunks, [b0], bad_step, forward_only=True)
    out["wrong_rows"] = _outcome(wrong_rows)

    # --- R2 update fed rollout routes; R3 fed recorded routes
    def r2_with_rollout():
        with rep.open_pass("replay", forward_only=False, route_kind="recorded") as st:
            st.install(chunks[0], routes0, b0.seq_lens)
    out["r2_with_rollout_routes"] = _outcome(r2_with_rollout)

    # --- an exception mid-schedule leaves no stale target for the next step
    def raise_mid_schedule():
        with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st:
            calls = {"n": 0}
            def step_fn(it, model):
                calls["n"] += 1
                if calls["n"] == 2:
                    st.install(model, routes1, b1.seq_lens, cu_seqlens_padded=b1.cu_seqlens_padded)
                    raise RuntimeError("data loader failed after install")
                return _install_step(st, fs, by, ids)(it, model)
            run_schedule(chunks, [b0, b1], step_fn, forward_only=False)
    first = _outcome(raise_mid_schedule)
    state_after = rep.active_pass is None
    # the next step replays *other* routes for the same tokens: a stale target of the failed
    # step (routes1) would show up as routes1 rows instead of fresh ones
    fresh = make_routes(layout, b1.seq_lens, spec.num_moe_experts, spec.moe_router_topk, 13)
    with RoutingProbe(chunks) as probe2:
        with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st:
            run_schedule(chunks, [b1], _install_step(st, fs, {id(b1): fresh}, ids), forward_only=False)
    out["stale_after_exception"] = {
        "first": first, "state_clean": state_after,
        "next_topk": [c.topk().tolist() for c in probe2.calls],
        "targets": {lid: fresh.sequence(0)[0][:, j].sort(-1).values.tolist() for j, lid in enumerate(fresh.layer_ids)},
        "stale": {lid: routes1.sequence(0)[0][:, j].sort(-1).values.tolist() for j, lid in enumerate(routes1.layer_ids)},
    }

    # --- rows without a route are routed natively, row by row
    with RoutingProbe(chunks) as native_probe:
        run_schedule(chunks, [b0], fs, forward_only=True)
    half = make_routes(layout, b0.seq_lens, spec.num_moe_experts, spec.moe_router_topk, 11, invalid_every=2)
    with RoutingProbe(chunks) as mixed_probe:
        with rep.open_pass("replay", forward_only=True, route_kind="rollout") as st:
            run_schedule(chunks, [b0], _install_step(st, fs, {id(b0): half}, ids), forward_only=True)
    out["invalid_rows_native"] = {
        "native": [c.topk().tolist() for c in native_probe.calls],
        "mixed": [c.topk().tolist() for c in mixed_probe.calls],
        "valid_seq0": half.sequence(0)[1].tolist(),
        "metrics": st.metrics,
    }

    # --- invalid_rows="error": a row without a route inside a sequence's coverage is refused
    from r3bridge.config import ReplayConfig
    out["second_replayer"] = _outcome(lambda: Replayer(chunks))
    rep.detach()
    strict = Replayer.from_config(chunks, ReplayConfig(invalid_rows="error"))

    def strict_install():
        with strict.open_pass("replay", forward_only=True, route_kind="rollout") as st:
            st.install(chunks[0], half, b0.seq_lens, cu_seqlens_padded=b0.cu_seqlens_padded)
    out["invalid_rows_error"] = _outcome(strict_install)
    strict.detach()

    # --- min_coverage: over the rank's real tokens (half of b0's rows have no route)
    def coverage_install(minimum: float):
        cov = Replayer.from_config(chunks, ReplayConfig(min_coverage=minimum))
        try:
            with cov.open_pass("replay", forward_only=True, route_kind="rollout") as st:
                run_schedule(chunks, [b0], _install_step(st, fs, {id(b0): half}, ids), forward_only=True)
        finally:
            cov.detach()
    out["min_coverage_low"] = _outcome(lambda: coverage_install(0.3))
    out["min_coverage_high"] = _outcome(lambda: coverage_install(0.9))

    # --- degenerate routes and the coverage floor (issue 38 item 1) through the one reader: a
    # zero-row transport (verl's) whose sample 1 has an all-zero row inside its captured rows,
    # and one where the engine returned nothing usable at all (vLLM #54730)
    import torch

    from r3bridge.parallel.handed import HandedRoutes
    clean = make_routes(layout, b0.seq_lens, spec.num_moe_experts, spec.moe_router_topk, 12)

    def zero_transport(values):
        return HandedRoutes.from_packed(values, clean.rows_per_seq, num_experts=clean.num_experts,
                                        layer_ids=clean.layer_ids, no_route="zero",
                                        names=[f"sample {i}" for i in range(clean.num_seqs)])
    broken = clean.routes.to(torch.int16).clone()
    broken[int(clean.offsets[1]) + 3] = 0

    def degenerate_pass(choice: str, values) -> dict:
        rep_d = Replayer.from_config(chunks, ReplayConfig(degenerate_routes=choice))
        try:
            with rep_d.open_pass("replay", forward_only=True, route_kind="rollout") as st:
                def step_fn(it, model):
                    batch = next(it)
                    st.install(model, zero_transport(values), batch.seq_lens, cu_seqlens_padded=batch.cu_seqlens_padded,
                               sample_ids=ids[id(batch)])
                    return fs(iter([batch]), model)
                run_schedule(chunks, [b0], step_fn, forward_only=True)
            return {**st.metrics, "read_stats": rep_d.read_stats.as_dict()}
        finally:
            rep_d.detach()
    out["degenerate_refused"] = _outcome(lambda: degenerate_pass("refuse", broken))
    out["degenerate_native"] = _outcome(lambda: degenerate_pass("native", broken))
    out["coverage_floor"] = _outcome(lambda: degenerate_pass("refuse", torch.zeros_like(broken)))
    # one (row, layer) pair degenerate (layer 0 of sample 1's row 3 only): counted as 1, as the error counts it
    one_pair = clean.routes.to(torch.int16).clone()
    one_pair[int(clean.offsets[1]) + 3, 0] = 0
    out["degenerate_one_pair_refused"] = _outcome(lambda: degenerate_pass("refuse", one_pair))
    out["degenerate_one_pair_native"] = _outcome(lambda: degenerate_pass("native", one_pair))

    # --- samples without routes (issue 50 item 3): vLLM engine arrays where the engine returned 0 rows
    # for a sample (aborted; or a multi-turn tail starting at its last token), under min_coverage and
    # the coverage floor: routed natively, counted apart, never read as a broken engine
    import logging

    import numpy as np

    def aborted_pass(aborted: set, min_coverage: float) -> dict:
        items = [np.zeros((0, len(clean.layer_ids), clean.topk), np.uint8) if i in aborted
                 else clean.sequence(i)[0].numpy() for i in range(clean.num_seqs)]
        starts = [b0.seq_lens[i] - 1 if i in aborted else 0 for i in range(clean.num_seqs)]
        handed = HandedRoutes.from_engine(items, num_experts=clean.num_experts, moe_layer_ids=clean.layer_ids,
                                          layer_axis="moe_only", start_rows=starts)
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("r3bridge").addHandler(handler)
        rep_a = Replayer.from_config(chunks, ReplayConfig(min_coverage=min_coverage))
        try:
            with RoutingProbe(chunks) as probe, rep_a.open_pass("replay", forward_only=True,
                                                                route_kind="rollout") as st:
                run_schedule(chunks, [b0], _install_step(st, fs, {id(b0): handed}, ids), forward_only=True)
            return {"metrics": st.metrics, "log": lines, "topk": [c.topk().tolist() for c in probe.calls]}
        finally:
            rep_a.detach()
            logging.getLogger("r3bridge").removeHandler(handler)
    out["aborted_all"] = _outcome(lambda: aborted_pass({0, 1, 2}, 0.5))
    out["aborted_one"] = _outcome(lambda: aborted_pass({1}, 0.9))

    # --- install() on a step that was never entered: an error, not a silently native forward
    late_rep = Replayer(chunks)
    out["install_not_entered"] = _outcome(
        lambda: late_rep.open_pass("replay", forward_only=True, route_kind="rollout").install(chunks[0], routes0, b0.seq_lens))

    # --- R2 record over two micro-batches with the default sample ids: numbered in install order
    def record_default_ids():
        with late_rep.open_pass("record", forward_only=True) as st:
            def step_fn(it, model):
                batch = next(it)
                st.install(model, None, batch.seq_lens, cu_seqlens_padded=batch.cu_seqlens_padded)
                return fs(iter([batch]), model)
            run_schedule(chunks, [b0, b1], step_fn, forward_only=True)
        return st.recorded.rows_per_seq
    out["record_default_ids"] = _outcome(record_default_ids)
    late_rep.detach()

    # --- a layout that disagrees with the built model (e.g. an HF config read wrongly)
    from r3bridge.parallel.layout import ParallelLayout
    out["layout_mismatch"] = _outcome(lambda: Replayer(chunks, ParallelLayout(spec.num_layers, 2)))

    # --- chunks wrapped in megatron's Float16Module (what a trainer hands over): found and replayed
    import dataclasses

    from megatron.core.transformer.module import Float16Module
    bf16 = build_model_chunks(dataclasses.replace(spec, extra_config={**spec.extra_config, "bf16": True}), ctx)
    wrapped = [Float16Module(c.config, c) for c in bf16]
    rep16 = Replayer(wrapped)
    with RoutingProbe(bf16) as probe16:
        with rep16.open_pass("replay", forward_only=True, route_kind="rollout") as st:
            run_schedule(wrapped, [b0], _install_step(st, fs, by, ids), forward_only=True)
    out["float16module"] = {
        "layers": rep16.layer_ids,
        "replayed_topk": [c.topk().tolist() for c in probe16.calls],
        "targets": {lid: routes0.sequence(0)[0][:, j].sort(-1).values.tolist() for j, lid in enumerate(routes0.layer_ids)},
        "coverage": st.metrics.get("r3bridge/coverage"),
    }
    rep16.detach()

    out.update(_role_checks(ctx, chunks, orphan, routes0, b0))
    out["off_topk_replay"] = _off_topk_replay(ctx)

    # --- version check: the running megatron-core passes
    from r3bridge.megatron import check_megatron
    out["version_ok"] = _outcome(check_megatron)
    return out


def _role_checks(ctx: RankContext, chunks: list, other: list, routes: Any, batch: Any) -> dict[str, Any]:
    """Only the actor replays (r3bridge.megatron.roles): ``other`` is a second model of the same
    process, declared the reference; each scenario is one way routes or replay state cross roles
    (miles #2226, NeMo RL #4083 / #3903)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from r3bridge.megatron import Replayer
    from r3bridge.megatron.hook import RouterHook
    from r3bridge.megatron.roles import check_declared, declare_role, model_routers, role_of

    def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
        return _outcome_of(lambda: (fn(), None)[1])     # what a call returns stays in this process

    rep = Replayer(chunks)
    out: dict[str, Any] = {"role_declare_reference": _outcome(lambda: declare_role(other, "reference"))}
    out["role_replayer_on_reference"] = _outcome(lambda: Replayer(other))
    out["role_replayer_for_teacher"] = _outcome(lambda: Replayer(other, role="teacher"))
    out["role_actor_declared_critic"] = _outcome(lambda: declare_role(chunks, "critic"))

    def routes_to_reference():
        with rep.open_pass("replay", forward_only=True, route_kind="rollout") as st:
            st.install(other[0], routes, batch.seq_lens, cu_seqlens_padded=batch.cu_seqlens_padded)
    out["role_routes_to_reference"] = _outcome(routes_to_reference)

    def swapped(model: list, fn: Callable[[], Any]) -> dict[str, Any]:
        # what TopKRouter.__init__ builds under moe_enable_routing_replay=True: a RouterReplay in
        # megatron's process-global list, driven by every set_global_router_replay_action
        router = _routers(model[0])[0]
        before, router.router_replay = router.router_replay, RouterReplay()
        try:
            return _outcome(fn)
        finally:
            RouterReplay.global_router_replay_instances.remove(router.router_replay)
            router.router_replay = before
    out["role_reference_megatron_replay"] = swapped(other, lambda: check_declared(other, "reference"))
    out["role_actor_hook_replaced"] = swapped(chunks, lambda: rep.open_pass("replay", forward_only=True, route_kind="rollout"))
    rep.detach()

    # MTP (draft) routers of the actor: marked draft, never among the replayed layers, no hook
    mtp = build_model_chunks(ModelSpec(mtp_num_layers=1), ctx)
    rep_mtp = Replayer(mtp)
    drafts = [r for name, r in model_routers(mtp[0]) if ".mtp." in f".{name}"]
    out["role_mtp"] = {"layer_ids": rep_mtp.layer_ids, "drafts": len(drafts),
                       "draft_roles": sorted({str(getattr(role_of(r), "value", None)) for r in drafts}),
                       "draft_hooks": [r.router_replay is not None for r in drafts]}
    rep_mtp.detach()
    # a draft router that holds a replay hook (NeMo RL #3903: MTP layers replayed another layer's
    # routes) makes the actor's Replayer refuse to attach
    drafts[0].router_replay = RouterHook(rep, 0, 0)
    out["role_mtp_hooked"] = _outcome(lambda: Replayer(mtp))
    drafts[0].router_replay = None
    return out


def _off_topk_replay(ctx: RankContext) -> dict[str, Any]:
    """ISEEKYAN/Megatron-LM #79: replayed experts the trainer's own top-k would not pick must keep
    their routing score and pass a gradient to the router (a replay that gathers from the
    post-top-k, scatter-zeroed probs reads zeros there and kills both). R3 targets here are, for
    every token and MoE layer, exactly the experts the native top-k leaves out (4 experts, top-2).
    Pre-softmax scoring (megatron gathers the replayed probs from the dense softmax) and no aux
    loss, so the router's gradient flows only through the replayed experts' probs."""
    import torch

    from r3bridge.batch.schema import ReplayBatch
    from r3bridge.megatron import Replayer

    # router_init_std small: the left-out experts keep a visible share of the dense softmax
    spec = ModelSpec(moe_aux_loss_coeff=0.0, router_init_std=0.05, extra_config={"moe_router_pre_softmax": True})
    model = build_model_chunks(spec, ctx)
    fs = make_forward_step(ctx, thd=False)
    batch = make_packed_batch([9, 6], spec.vocab_size, 3)
    with RoutingProbe(model) as native:
        run_schedule(model, [batch], fs, forward_only=True)
    layers = sorted({call.layer_id for call in native.calls})
    cu = batch.cu_seqlens_padded.tolist()
    per_seq = []
    for s, n in enumerate(batch.seq_lens):
        rows = []
        for call in sorted(native.calls, key=lambda c: c.layer_id):
            chosen = call.routing_map[cu[s]: cu[s] + n - 1]
            rows.append(torch.nonzero(~chosen)[:, 1].view(n - 1, -1))     # the experts native leaves out
        per_seq.append(torch.stack(rows, 1))
    routes = ReplayBatch.from_ragged(per_seq, num_experts=spec.num_moe_experts, layer_ids=layers)
    rep = Replayer(model)
    zero_grads(model)
    with RoutingProbe(model) as probe:
        with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st:
            run_schedule(model, [batch], _install_step(st, fs, {id(batch): routes}, {id(batch): [0, 1]}),
                         forward_only=False)
    rep.detach()
    out: dict[str, Any] = {"layers": layers, "min_prob": {}, "grad_rows": {}, "disjoint": True}
    for call in probe.calls:
        rows = torch.cat([torch.arange(cu[s], cu[s] + n - 1) for s, n in enumerate(batch.seq_lens)])
        want = routes.routes[:, layers.index(call.layer_id)].long()
        nat = native.calls[layers.index(call.layer_id)].routing_map[rows]
        out["disjoint"] &= not bool(nat.gather(1, want).any())
        out["min_prob"][call.layer_id] = float(call.probs[rows].gather(1, want).min())
    routers = {r.layer_number - 1: r for c in model for r in _routers(c)}
    for lid, router in routers.items():
        grad = router.weight.grad
        replayed = sorted(set(routes.routes[:, layers.index(lid)].flatten().tolist()))
        out["grad_rows"][lid] = {e: float(grad[e].abs().sum()) for e in replayed}
    return out


def _routers(chunk) -> list:
    from r3bridge.megatron.discovery import find_routers
    return list(find_routers([chunk])[0].routers.values())

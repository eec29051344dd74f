"""Conformance grid of the Megatron driver: one cell = one parallel layout x model variant.

Each cell runs, on every rank, on a real megatron-core model (CPU gloo here, NCCL on GPUs):

1. an R3 forward-only replay step, then an R3 *training* step under a ``RoutingProbe``: every
   router call (forward and recompute) must dispatch exactly the target routes on valid rows.
   The expected routes come from the harness's own packing (``data.router_row_index``), not from
   ``r3bridge.shard``;
2. an R2 record step (forward-only), then an R2 forward-only replay of the recorded routes: the
   logits must be bit-identical; the recorded ReplayBatch is returned so the test can compare it
   with the TP=PP=CP=1 run of the same weights. With ``Cell.weights`` the record step also records
   the combine weights (``record_weights``, gathered over TP / CP / PP like the ids) and the replay
   replays them (``replay_weights``): the replay's router probs must equal the record's bit for
   bit on every row, and the gathered weights the serial run's;
3. after each step no replay state may remain;
4. the gradient check, replay proven in the backward pass (ROCm/mori #675 broke only the backward:
   forward loss right, gradients wrong). With the same weights and micro-batches, training passes
   from zero gradients compare every parameter's gradient, the losses and megatron's aux-loss
   terms: a native step (routers choose; r3bridge not involved; checked to dispatch exactly R2's
   record) against R2's replay of that record, bit for bit; and the R3 step of 1. (random routes,
   so its gradients differ from the native step's) against the same routes forced without
   r3bridge (``r3bridge.testing.harness.forced_routing``). Both sides keep the rows without a
   route out of the router's statistics (r3bridge's unrouted-row mask; the reference passes
   megatron's ``padding_mask``). If a comparison is not bit-equal a second native step gives the
   native run-to-run spread (scripts/gpu/nccl_conformance.py bounds GPU cells by it);
5. with ``Cell.broken_backward``, a replay step whose backward dispatch moves no payload (injected
   here, never in r3bridge): its routes, loss and aux terms stay right, the gradient check fails.

Results are plain picklable dicts; failures inside a cell are returned as text so one broken
cell does not hide the others.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.testing.harness.data import PackedBatch, align_for, batch_to, make_packed_batch, router_row_index
from r3bridge.testing.harness.dist import Layout, RankContext
from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
from r3bridge.testing.harness.probe import RoutingProbe
from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

SEQ_LENS = [[13, 7, 20], [9, 15, 11], [21, 5, 8]]   # 3 micro-batches, distinct routes each


@dataclass(frozen=True)
class Cell:
    name: str
    layout: Layout
    spec: ModelSpec = field(default_factory=ModelSpec)
    invalid_every: int = 7          # every n-th row of micro-batch 1 has no route
    memory_steps: int = 0           # extra replay steps to check that nothing accumulates
    # "explicit": install() gets the batch's cu_seqlens_padded (what every adapter passes);
    # "layout": it does not, and r3bridge derives the packing from the layout alone
    packing: str = "explicit"
    seq_lens: tuple[tuple[int, ...], ...] | None = None   # None: SEQ_LENS
    # the spec's token dispatcher on every device; False: the device's default (allgather on the
    # CPU harness, alltoall on GPUs: scripts/gpu/nccl_conformance.py)
    pinned_dispatcher: bool = False
    # the gradient check (module docstring, 4.) also in this cell's TP=PP=CP=EP=1 reference run
    serial_grad_check: bool = False
    # 5.: a replay step whose backward dispatch of the replayed tokens moves no payload (mori #675)
    broken_backward: bool = False
    # 2. with routing weights recorded and replayed (record_weights / replay_weights)
    weights: bool = False


def default_cells() -> list[Cell]:
    """The CPU grid (tests/megatron/test_replay_conformance.py); on GPUs it runs with
    :func:`gpu_cells` (scripts/gpu/nccl_conformance.py)."""
    S = ModelSpec
    ident = dict(attention="identity")
    return [
        # TP cells shard the experts too (etp = tp): with etp=1 megatron-core 0.16.1's MoE output
        # under TP2 differs from the TP1 run on CPU (routes diverge from layer 1 on), which would
        # void the recorded-equals-serial check; replay itself is exact either way.
        Cell("tp2_sp", Layout(tp=2, etp=2), S(), serial_grad_check=True, weights=True),
        Cell("cp2", Layout(cp=2), S(**ident)),
        Cell("pp2_1f1b", Layout(pp=2), S(), memory_steps=50),
        Cell("pp2_vpp2", Layout(pp=2, vpp=2), S(num_layers=4), weights=True),
        Cell("ep2", Layout(ep=2), S()),
        # the other dispatcher at EP2, with shared experts and z-loss; its gradient check also runs
        # a replay step whose backward dispatch is broken on purpose (ROCm/mori #675)
        Cell("ep2_alltoall", Layout(ep=2),
             S(moe_token_dispatcher_type="alltoall",
               extra_config={"moe_shared_expert_intermediate_size": 32, "moe_z_loss_coeff": 1e-3}),
             pinned_dispatcher=True, broken_backward=True),
        Cell("tp2_ep2", Layout(tp=2, ep=2, etp=2), S()),
        Cell("first_k_dense", Layout(pp=2), S(num_layers=4, moe_layer_freq=[0, 1, 1, 1])),
        Cell("int_freq_2", Layout(tp=2, etp=2), S(num_layers=4, moe_layer_freq=2)),
        Cell("mtp", Layout(pp=2), S(num_layers=4, mtp_num_layers=1)),
        Cell("full_recompute", Layout(pp=2), S(recompute="full")),
        Cell("moe_recompute", Layout(tp=2, etp=2), S(recompute="moe")),
        Cell("cp2_tp2", Layout(tp=2, cp=2, etp=2), S(**ident), weights=True),
        # > 256 experts: ids travel as int16 (6 per row: 12-byte rows, payload views mid-word)
        Cell("tp2_pp2_int16_ids", Layout(tp=2, pp=2, etp=2), S(num_moe_experts=320, moe_router_topk=6),
             weights=True),
        # four stages: the first has no MoE layer (no router at all on that rank), the last is
        # uneven (3 layers, the middle ones 2). Replaces pp2_uneven_dense_stage in the CPU grid
        # (which runs on GPUs only now, gpu_cells): the same two properties, over four stages.
        Cell("pp4_uneven_dense_stage", Layout(pp=4),
             S(num_layers=9, num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=3,
               moe_layer_freq=[0, 0] + [1] * 7)),
    ]


def gpu_cells() -> list[Cell]:
    """Cells the NCCL grid adds to :func:`default_cells` (scripts/gpu/nccl_conformance.py): kept
    out of the CPU grid because they add nothing there (the allgather dispatcher is the CPU
    harness's default) or because a cell of the CPU grid covers the same property at less cost."""
    S = ModelSpec
    return [
        Cell("pp2_uneven_dense_stage", Layout(pp=2),
             S(num_layers=6, num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=4,
               moe_layer_freq=[0, 0, 1, 1, 1, 1])),
        # the other dispatcher at TP2 x EP2 (alltoall is the GPU default)
        Cell("tp2_ep2_allgather", Layout(tp=2, ep=2, etp=2), S(moe_token_dispatcher_type="allgather"),
             pinned_dispatcher=True),
        # interleaved pipeline with TP2 + SP (two virtual stages of 2 layers per rank)
        Cell("tp2_pp2_vpp2", Layout(tp=2, pp=2, vpp=2, etp=2), S(num_layers=8)),
    ]


def cell_world_size(cell: Cell) -> int:
    lay = cell.layout
    return max(lay.tp * lay.cp * lay.pp, lay.ep * lay.etp * lay.pp)


def make_routes(layout: ParallelLayout, seq_lens: list[int], num_experts: int, topk: int,
                seed: int, invalid_every: int = 0) -> ReplayBatch:
    """Random distinct routes for every MoE layer, rows = seq_len - 1 (engine convention)."""
    g = torch.Generator().manual_seed(seed)
    layers = layout.moe_layer_ids
    rows = [n - 1 for n in seq_lens]
    total = sum(rows)
    scores = torch.rand((total, len(layers), num_experts), generator=g)
    routes = scores.topk(topk, dim=-1).indices
    valid = None
    if invalid_every:
        valid = torch.ones(total, dtype=torch.bool)
        valid[::invalid_every] = False
    return ReplayBatch.from_packed(routes, rows, num_experts=num_experts, layer_ids=layers, valid=valid,
                                   engine="vllm")


def expected_rows(batch: PackedBatch, routes: ReplayBatch, ctx: RankContext, sp: bool, layer: int,
                  sort: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent reference: (target [T, K], valid [T]) of this rank's router rows; each row's ids
    ascending, or (``sort=False``) in the order the routes carry them."""
    idx = router_row_index(batch, tp=ctx.tp, cp=ctx.cp, tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank,
                           sequence_parallel=sp)
    idx = idx.cpu().to(torch.int64)
    cu = batch.cu_seqlens_padded.cpu().to(torch.int64)
    col = routes.layer_ids.index(layer)
    seq = torch.searchsorted(cu[1:], idx, right=True)           # the padded sequence of each row
    pos = idx - cu[seq]                                          # its position in that sequence
    rows = torch.tensor(routes.rows_per_seq, dtype=torch.int64)
    first = torch.zeros(len(rows) + 1, dtype=torch.int64)
    first[1:] = rows.cumsum(0)                                   # each sequence's first route row
    has_row = pos < rows[seq]                                    # padding and the last token: none
    flat = torch.where(has_row, first[seq] + pos, 0)
    valid = has_row & routes.valid[flat].cpu().to(torch.bool)
    ids = routes.routes[flat, col].cpu().to(torch.int64)
    if sort:
        ids = ids.sort(dim=-1).values
    out = torch.where(valid[:, None], ids, 0)
    return out, valid


def _install_step(step, inner, routes_by_batch, ids_by_batch, explicit: bool = True):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        key = id(batch)
        step.install(model, routes_by_batch.get(key), batch.seq_lens,
                     cu_seqlens_padded=batch.cu_seqlens_padded if explicit else None, sample_ids=ids_by_batch[key])
        return inner(iter([batch]), model)
    return forward_step


def _check_probe(probe: RoutingProbe, batches, routes, ctx, sp, recompute: bool, layers,
                 counts: dict[str, int] | None = None) -> list[str]:
    """Errors of every router call; ``counts`` gets the calls and valid rows checked."""
    errors = []
    counts = {} if counts is None else counts
    counts.setdefault("calls", 0)
    counts.setdefault("rows", 0)
    counts.setdefault("mismatching_rows", 0)
    calls = [c for c in probe.calls if not c.mtp]
    for lid in layers:
        mine = [c for c in calls if c.layer_id == lid]
        if recompute:
            fwd = [c for c in mine if not c.grad_enabled]
            rec = [c for c in mine if c.grad_enabled]
            passes = [("forward", fwd), ("recompute", rec)]
        else:
            passes = [("forward", mine)]
        for name, seq in passes:
            if len(seq) != len(batches):
                errors.append(f"layer {lid}: {len(seq)} {name} calls for {len(batches)} micro-batches")
                continue
            for m, call in enumerate(seq):
                want, valid = expected_rows(batches[m], routes[m], ctx, sp, lid)
                got = call.topk().cpu()
                counts["calls"] += 1
                if got.shape != want.shape:
                    errors.append(f"layer {lid} mb {m} {name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
                    continue
                counts["rows"] += int(valid.sum())
                if not torch.equal(got[valid], want[valid]):
                    bad = int((got[valid] != want[valid]).any(1).sum())
                    counts["mismatching_rows"] += bad
                    errors.append(f"layer {lid} mb {m} {name}: {bad} valid rows differ from the targets")
    return errors


def _live_tensors() -> tuple[int, int]:
    """(live tensor objects, bytes of their distinct storages): a count alone misses one tensor
    that keeps growing."""
    gc.collect()
    n, seen, nbytes = 0, set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            n += 1
            try:
                st = o.untyped_storage()
            except (RuntimeError, NotImplementedError):   # e.g. a nested tensor's wrapper
                continue
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                nbytes += st.nbytes()
    return n, nbytes


class _BackwardMovesNoPayload(torch.autograd.Function):
    """The dispatched tokens, unchanged in the forward; in the backward their gradient never
    arrives (zeros: a receive buffer nothing was written to), as ROCm/mori #675's replay-mode
    dispatch did on the way back. Test-only fault injection (the gradient check must catch it)."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.view_as(tokens)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(grad)


def _break_backward_dispatch(chunks) -> list[Any]:
    """Pre-hooks on every decoder MoE layer's experts: their input (the dispatcher's output) goes
    through :class:`_BackwardMovesNoPayload`. Returns the handles."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    def pre(module: torch.nn.Module, args: tuple) -> tuple:
        return (_BackwardMovesNoPayload.apply(args[0]), *args[1:])

    return [layer.mlp.experts.register_forward_pre_hook(pre) for c in chunks for layer in c.decoder.layers
            if isinstance(getattr(layer, "mlp", None), MoELayer)]


def _grads(chunks) -> dict[str, torch.Tensor]:
    return {f"{i}:{n}": p.grad.detach().float().cpu().clone() for i, c in enumerate(chunks)
            for n, p in c.named_parameters() if p.grad is not None}


def _moe_loss_terms() -> dict[str, list[float]]:
    """The aux-loss terms megatron logged in the last pass (per layer, this rank), by name."""
    try:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    except ImportError:   # 0.18+: the tracker moved (its legacy view is the same dict of {"values": ...})
        from megatron.core.transformer.moe.moe_logging import get_moe_layer_wise_logging_tracker
    out = {}
    for name, entry in get_moe_layer_wise_logging_tracker().items():
        values = entry.get("values") if isinstance(entry, dict) else entry
        if torch.is_tensor(values):
            out[name] = values.detach().float().cpu().tolist()
    return out


def _train(chunks, batches, forward_step) -> dict[str, Any]:
    """One training pass (no optimizer step) from zero gradients: losses, gradients, aux terms."""
    from r3bridge.megatron.compat import reset_moe_metrics_tracker
    from r3bridge.testing.harness.schedule import zero_grads

    zero_grads(chunks)
    reset_moe_metrics_tracker()
    res = run_schedule(chunks, batches, forward_step, forward_only=False)
    return {"losses": [r.loss for r in res], "grads": _grads(chunks), "terms": _moe_loss_terms()}


def compare_steps(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Gradients of every parameter, losses and aux-loss terms of two training passes."""
    ga, gb = a["grads"], b["grads"]
    common = sorted(set(ga) & set(gb))
    differing = [n for n in common if not torch.equal(ga[n], gb[n])]
    maxdiff = max([float((ga[n] - gb[n]).abs().max()) for n in differing] or [0.0])
    scale = max([float(ga[n].abs().max()) for n in common] or [0.0])
    return {"grads_equal": not differing and set(ga) == set(gb), "params": len(common),
            "param_names": common, "differing": differing, "only_one_side": sorted(set(ga) ^ set(gb)),
            "grad_maxdiff": maxdiff, "grad_scale": scale,
            "losses_equal": a["losses"] == b["losses"], "terms_equal": a["terms"] == b["terms"],
            "terms": sorted(a["terms"]), "losses": len(a["losses"])}


def _gradient_check(ctx, cell, chunks, rep, batches, routes, rec_by_batch, ids, explicit, sp, thd,
                    r3: dict[str, Any]) -> dict[str, Any]:
    """Replay proven in the backward pass (module docstring, 4. and 5.); ``r3``: the cell's R3
    training step (1.), from zero gradients."""
    from r3bridge.testing.harness.forced_routing import ForcedRouting, ForcedRows

    recompute = cell.spec.recompute is not None
    layers = rep.layer_ids
    inner = make_forward_step(ctx, thd=thd)
    recorded = [rec_by_batch[id(b)] for b in batches]

    def forced(route_list, force: bool) -> ForcedRouting:
        rows = {}
        for lid in layers:
            rows[lid] = []
            for b, r in zip(batches, route_list):
                idx, valid = expected_rows(b, r, ctx, sp, lid, sort=False)
                rows[lid].append(ForcedRows(idx if force else None, valid))
        return ForcedRouting(chunks, rows, mask_unrouted=rep.mask_unrouted_rows)

    out: dict[str, Any] = {}
    # (a) native: the routers' own top-k, with the rows the record has no route for kept out of
    # the statistics as the replay step keeps them (r3bridge's unrouted-row mask), r3bridge not involved
    with RoutingProbe(chunks) as probe, forced(recorded, force=False):
        native = _train(chunks, batches, inner)
    # the routes the native step dispatched are R2's record, router call by router call
    out["native_route_errors"] = _check_probe(probe, batches, recorded, ctx, sp, recompute, layers)
    # (b) R2: the record replayed in the update
    with rep.open_pass("replay", forward_only=False, route_kind="recorded") as st:
        r2 = _train(chunks, batches, _install_step(st, inner, rec_by_batch, ids, explicit))
    out["r2_vs_native"] = compare_steps(native, r2)
    # R3: routes that differ from the router's own, against the same routes forced without r3bridge
    with forced(routes, force=True):
        ref = _train(chunks, batches, inner)
    out["r3_vs_forced"] = compare_steps(ref, r3)
    # the forced routes differ from the router's own: the comparison above is not native vs native
    out["r3_differs_from_native"] = not compare_steps(native, r3)["grads_equal"]
    if cell.broken_backward:
        handles = _break_backward_dispatch(chunks)
        try:
            with RoutingProbe(chunks) as probe_b:
                with rep.open_pass("replay", forward_only=False, route_kind="recorded") as st:
                    broken = _train(chunks, batches, _install_step(st, inner, rec_by_batch, ids, explicit))
        finally:
            for h in handles:
                h.remove()
        out["broken_route_errors"] = _check_probe(probe_b, batches, recorded, ctx, sp, recompute, layers)
        out["broken_vs_native"] = compare_steps(native, broken)
    if not (out["r2_vs_native"]["grads_equal"] and out["r3_vs_forced"]["grads_equal"]):
        # nondeterministic kernels: the bound is the native step's own run-to-run spread
        with forced(recorded, force=False):
            again = _train(chunks, batches, inner)
        out["native_spread"] = compare_steps(native, again)
    for c in chunks:
        for p in c.parameters():
            p.grad = None
    return out


def run_cell(ctx: RankContext, cell: Cell, serial: bool, device: str = "cpu") -> dict[str, Any]:
    """Everything one rank does for one cell (see module docstring)."""
    t0 = time.perf_counter()
    try:
        out = _run_cell(ctx, cell, serial, device)
        out["cell_seconds"] = round(time.perf_counter() - t0, 3)
        return out
    except Exception:  # noqa: BLE001 - reported per cell
        return {"error": traceback.format_exc()}


def _run_cell(ctx: RankContext, cell: Cell, serial: bool, device: str = "cpu") -> dict[str, Any]:
    from r3bridge.megatron import Replayer

    spec = cell.spec
    if serial:  # the reference run has one stage: no uneven split to ask for
        spec = dataclasses.replace(spec, num_layers_in_first_pipeline_stage=None,
                                   num_layers_in_last_pipeline_stage=None)
    chunks = build_model_chunks(spec, ctx)
    # On a GPU the Replayer is attached while the parameters are still on the host and the
    # model moves afterwards, as with a framework's parameter offload / reload: targets and the
    # R2 gather must follow the parameters to the device.
    rep = Replayer(chunks)
    if device != "cpu":
        # without megatron's Float16Module wrapper, local-spec norms (torch LayerNorm) stay fp32:
        # cast the whole chunk to the configured dtype, as the wrapper would
        # (the TE spec too: its learned position embedding is a torch Embedding in fp32, and TE
        # refuses an fp32 input outside autocast)
        dtype = torch.bfloat16 if spec.extra_config.get("bf16") else None
        chunks = [c.to(device=device, dtype=dtype) for c in chunks]
    layout = rep.layout
    sp = bool(layout.sequence_parallel)
    # packed THD input: identity attention, or TE attention (local attention refuses THD)
    thd = spec.attention == "identity" or spec.layer_spec == "te"
    explicit = cell.packing == "explicit"
    seq_lens = [list(x) for x in cell.seq_lens] if cell.seq_lens else SEQ_LENS
    align = align_for(ctx.tp, ctx.cp)
    if explicit and spec.extra_config.get("fp8"):
        # a framework's FP8 THD packing (verl's preprocess_thd_engine with use_fp8_padding):
        # sequences to lcm(16, align), the micro-batch to align * 128, passed as cu_seqlens_padded
        total, align = align * 128, math.lcm(16, align)
        pad_to = max(-(-sum(-(-n // align) * align for n in lens) // total) * total for lens in seq_lens)
    elif explicit:
        pad_to = max(sum(-(-n // align) * align for n in lens) for lens in seq_lens)
    else:
        pad_to = None   # the layout's own per-sequence alignment, nothing else
    batches = [batch_to(make_packed_batch(lens, spec.vocab_size, 100 + m, align=align, pad_to=pad_to), device)
               for m, lens in enumerate(seq_lens)]
    routes = [make_routes(layout, lens, spec.num_moe_experts, spec.moe_router_topk, 7 + m,
                          cell.invalid_every if m == 1 else 0) for m, lens in enumerate(seq_lens)]
    ids, start = {}, 0
    for b in batches:
        ids[id(b)] = list(range(start, start + len(b.seq_lens)))
        start += len(b.seq_lens)
    by_batch = {id(b): r for b, r in zip(batches, routes)}
    from r3bridge.megatron.hook import RouterHook
    # every router module that carries a replay hook, walked from the chunks (not the replayer's
    # own bookkeeping): a layer hooked twice, or an MTP router hooked, shows up here
    hooked = [m.router_replay.layer_id for c in chunks for m in c.modules()
              if isinstance(getattr(m, "router_replay", None), RouterHook)]
    out: dict[str, Any] = {"layers": rep.layer_ids, "hooked_layers": sorted(hooked),
                           "mtp_routers": rep.mtp_router_count}
    hooks_before = [(len(c._forward_pre_hooks), len(c._forward_hooks)) for c in chunks]
    local_layers = rep.layer_ids

    # 1. R3: forward-only replay (a log-prob pass), then a training step with a probe.
    inner = make_forward_step(ctx, thd=thd)
    counts: dict[str, int] = {}
    with RoutingProbe(chunks) as probe_fo:
        with rep.open_pass("replay", forward_only=True, route_kind="rollout") as st:
            run_schedule(chunks, batches, _install_step(st, inner, by_batch, ids, explicit), forward_only=True)
    errors = _check_probe(probe_fo, batches, routes, ctx, sp, False, local_layers, counts)
    with RoutingProbe(chunks) as probe:
        with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st:
            r3_step = _train(chunks, batches, _install_step(st, inner, by_batch, ids, explicit))
    out["r3_errors"] = errors + _check_probe(probe, batches, routes, ctx, sp, spec.recompute is not None,
                                             local_layers, counts)
    out["r3_router_calls_checked"] = counts["calls"]
    out["r3_rows_checked"] = counts["rows"]
    out["r3_mismatching_rows"] = counts["mismatching_rows"]
    out["r3_metrics"] = st.metrics
    out["mtp_calls"] = sum(1 for c in probe.calls if c.mtp)
    # after the steps: no step active, and every module hook a step registered is gone
    out["state_clean"] = rep.active_pass is None and hooks_before == [
        (len(c._forward_pre_hooks), len(c._forward_hooks)) for c in chunks]

    # 2. R2: record in a forward-only pass, replay the recorded routes, logits bit-identical.
    collect = make_forward_step(ctx, thd=thd, collect_logits=True)
    for c in chunks:
        c.eval()
    with RoutingProbe(chunks) as probe_rec:
        with rep.open_pass("record", forward_only=True, record_weights=cell.weights) as rec:
            res_a = run_schedule(chunks, batches, _install_step(rec, collect, {}, ids, explicit), forward_only=True)
    recorded = rec.recorded
    rec_by_batch = {id(b): recorded.select(ids[id(b)]) for b in batches}
    with rep.open_pass("replay", forward_only=True, route_kind="recorded", replay_weights=cell.weights) as st2:
        with RoutingProbe(chunks) as probe_r2:      # inside the pass: it sees the replayed weights
            res_b = run_schedule(chunks, batches, _install_step(st2, collect, rec_by_batch, ids, explicit),
                                 forward_only=True)
    # every router call of the replay dispatched the recorded routes (layers this rank recorded)
    r2_counts: dict[str, int] = {}
    r2_layers = [lid for lid in local_layers if lid in recorded.layer_ids]
    out["r2_errors"] = _check_probe(probe_r2, batches, [rec_by_batch[id(b)] for b in batches], ctx, sp,
                                    False, r2_layers, r2_counts)
    out["r2_router_calls_checked"] = r2_counts["calls"]
    out["r2_rows_checked"] = r2_counts["rows"]
    out["r2_mismatching_rows"] = r2_counts["mismatching_rows"]
    out["r2_logits_equal"] = all(torch.equal(a.logits, b.logits) for a, b in zip(res_a, res_b))
    out["r2_logits_maxdiff"] = max([float((a.logits.float() - b.logits.float()).abs().max()) for a, b in zip(res_a, res_b)] or [0.0])
    out["r2_logits_compared"] = len(res_a)
    out["r2_agreement"] = st2.metrics.get("r3bridge/agreement/mean")
    if cell.weights:
        # every row's final combine weights: the replayed ones are the recorded ones, exactly
        out["r2w_probs_equal"] = [torch.equal(a.probs, b.probs) for a, b in zip(probe_rec.calls, probe_r2.calls)]
        out["r2w_metrics"] = {k: v for k, v in st2.metrics.items() if "pairs" in k}
        out["recorded_weights"] = recorded.weights.cpu()
        recorded = recorded.with_weights(None)  # compared apart: float16 on the wire, ulps apart by layout
    out["recorded"] = recorded.to_bytes()
    for c in chunks:
        c.train()

    # 4. Gradients: R2's replay vs the native step, R3's vs the same routes forced without r3bridge
    if not serial or cell.serial_grad_check:
        t0 = time.perf_counter()
        out["grad"] = _gradient_check(ctx, cell, chunks, rep, batches, routes, rec_by_batch, ids, explicit, sp, thd,
                                      r3_step)
        out["grad"]["seconds"] = round(time.perf_counter() - t0, 3)
        # the forced reference gave every router its r3bridge hook back, and no pass is left open
        out["grad"]["state_clean"] = rep.active_pass is None and sorted(
            m.router_replay.layer_id for c in chunks for m in c.modules()
            if isinstance(getattr(m, "router_replay", None), RouterHook)) == out["hooked_layers"]

    # 3. Nothing accumulates over many steps of every kind: R3 forward-only (a log-prob pass,
    #    SkyRL #1908's leak), R3 training (forward + backward), R2 record + gather.
    if cell.memory_steps and not serial:
        base = None
        for i in range(cell.memory_steps):
            with rep.open_pass("replay", forward_only=True, route_kind="rollout") as st3:
                run_schedule(chunks, batches, _install_step(st3, inner, by_batch, ids), forward_only=True)
            with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st3:
                run_schedule(chunks, batches, _install_step(st3, inner, by_batch, ids), forward_only=False)
            with rep.open_pass("record", forward_only=True) as st3:
                run_schedule(chunks, batches, _install_step(st3, inner, {}, ids), forward_only=True)
            if i == 4:      # after warm-up: gradients, caches and the allocator exist by now
                base = _live_tensors()
                base_bytes = torch.cuda.memory_allocated() if device != "cpu" else 0
        count, nbytes = _live_tensors()
        out["tensor_growth"] = count - base[0]
        out["tensor_bytes_growth"] = nbytes - base[1]
        if device != "cpu":
            out["device_bytes_growth"] = torch.cuda.memory_allocated() - base_bytes
    out["unmanaged_calls"] = rep.unmanaged_calls
    return out


def grid_worker(ctx: RankContext, cells: list[Cell]) -> dict[str, Any]:
    """spawn_layouts calls this once per (cell, parallel|serial) layout of :func:`layouts_for`."""
    i = ctx.layout_index
    return run_cell(ctx, cells[i // 2], serial=bool(i % 2))


def layouts_for(cells: list[Cell]) -> list[Layout]:
    out = []
    for c in cells:
        out += [c.layout, Layout()]
    return out

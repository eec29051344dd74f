"""Ready-made "cells": build a model, run forward-only / train / step / forward-only, probe.

A cell is one (ModelSpec, micro-batch shapes) pair run under whatever layout the rank is in;
:func:`run_cells` is a rank function for :func:`r3bridge.testing.harness.dist.spawn_layouts` taking a
``{Layout: [Cell, ...]}`` plan, so many cells share one set of processes. Every result is
picklable (plain python + CPU tensors) so the test process can compare layouts.

Every DP rank gets the *same* micro-batches, so a dp > 1 layout (e.g. EP2 on 2 ranks) is
numerically the same training step as dp = 1 and can be compared with a TP=PP=1 reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from r3bridge.testing.harness.data import PackedBatch, align_for, make_packed_batch
from r3bridge.testing.harness.models import (
    ModelSpec,
    build_model_chunks,
    canonical_state_dict,
    load_reference_state,
)
from r3bridge.testing.harness.probe import RoutingProbe, topk_indices
from r3bridge.testing.harness.schedule import (
    make_forward_step,
    make_optimizer,
    optimizer_step,
    run_schedule,
    zero_grads,
)

if TYPE_CHECKING:  # pragma: no cover
    from r3bridge.testing.harness.dist import Layout, RankContext


@dataclass
class Cell:
    name: str
    spec: ModelSpec
    seq_lens: list[list[int]]  # one list of sequence lengths per micro-batch
    data_seed: int = 0
    lr: float = 0.1  # SGD step between the two forward-only passes
    collect: bool = True  # return logits / top-k of the forward-only passes
    # Overwrite the deterministic init with this canonical state (load_reference_state).
    load_state: Optional[dict[str, torch.Tensor]] = None
    return_state: bool = False  # return canonical_state_dict at init (needs tp=etp=ep=1)


@dataclass
class CallRecord:
    """One router call as seen by the probe (picklable)."""

    chunk: int
    layer_id: int
    mtp: bool
    grad_enabled: bool
    num_rows: int
    micro_batch: int  # k-th call of this router within its pass/phase
    topk: Optional[torch.Tensor] = None  # [rows, k] int64, ascending per row


@dataclass
class CellResult:
    name: str
    rank: int
    layout: "Layout"
    coords: dict[str, int]  # tp_rank, cp_rank, pp_rank, ep_rank, etp_rank, dp_rank
    sequence_parallel: bool
    routers: list[tuple[int, int, bool]]  # (chunk, layer_id, mtp)
    micro_batches: list[PackedBatch]
    fwd0: list[CallRecord]  # forward-only at init
    train: list[CallRecord]  # training schedule (incl. recompute calls)
    fwd1: list[CallRecord]  # forward-only after one optimizer step
    train_losses: list[float]  # last stage only, else []
    fwd0_losses: list[float]
    fwd1_losses: list[float]
    fwd0_logits: list[torch.Tensor] = field(default_factory=list)  # [T, V] per mb, last stage
    fwd1_logits: list[torch.Tensor] = field(default_factory=list)
    params_without_grad: list[str] = field(default_factory=list)
    grads_finite: bool = True
    state: Optional[dict[str, torch.Tensor]] = None  # canonical state at init, if asked


def cell_micro_batches(cell: Cell, ctx: "RankContext") -> list[PackedBatch]:
    """The cell's micro-batches for this layout: aligned for (tp, cp); all padded to one
    length when megatron needs fixed p2p shapes (pp > 1 without variable_seq_lengths)."""
    align = align_for(ctx.tp, ctx.cp)
    seeds = [cell.data_seed * 1000 + i for i in range(len(cell.seq_lens))]
    mbs = [make_packed_batch(l, cell.spec.vocab_size, s, align=align) for l, s in zip(cell.seq_lens, seeds)]
    if ctx.pp > 1 and cell.spec.moe_token_dispatcher_type == "allgather":
        t = max(b.total for b in mbs)
        mbs = [
            make_packed_batch(l, cell.spec.vocab_size, s, align=align, pad_to=t)
            for l, s in zip(cell.seq_lens, seeds)
        ]
    return mbs


def _records(probe: RoutingProbe, with_topk: bool) -> list[CallRecord]:
    seen: dict[tuple[int, int, bool, bool], int] = {}
    out = []
    for c in probe.calls:
        key = (c.chunk, c.layer_id, c.mtp, c.grad_enabled)
        k = seen.get(key, 0)
        seen[key] = k + 1
        out.append(
            CallRecord(
                c.chunk, c.layer_id, c.mtp, c.grad_enabled, c.num_rows, k,
                topk_indices(c.routing_map) if with_topk else None,
            )
        )
    return out


def run_cell(ctx: "RankContext", cell: Cell) -> CellResult:
    chunks = build_model_chunks(cell.spec, ctx)
    if cell.load_state is not None:
        load_reference_state(chunks, cell.load_state, ctx)
    state = canonical_state_dict(chunks, ctx) if cell.return_state else None
    mbs = cell_micro_batches(cell, ctx)
    thd = cell.spec.attention == "identity"
    fstep = make_forward_step(ctx, thd=thd, collect_logits=cell.collect)
    train_step = make_forward_step(ctx, thd=thd, collect_logits=False)
    opt = make_optimizer(chunks, kind="sgd", lr=cell.lr)

    with RoutingProbe(chunks) as p0:
        r0 = run_schedule(chunks, mbs, fstep, forward_only=True)
    zero_grads(chunks)
    with RoutingProbe(chunks) as pt:
        rt = run_schedule(chunks, mbs, train_step, forward_only=False)
    missing = [
        f"{i}:{n}" for i, c in enumerate(chunks) for n, p in c.named_parameters() if p.grad is None
    ]
    finite = all(bool(torch.isfinite(p.grad).all()) for c in chunks for p in c.parameters() if p.grad is not None)
    optimizer_step(chunks, opt, ctx)
    with RoutingProbe(chunks) as p1:
        r1 = run_schedule(chunks, mbs, fstep, forward_only=True)

    sp = bool(chunks[0].config.sequence_parallel)  # type: ignore[union-attr]
    return CellResult(
        name=cell.name,
        rank=ctx.rank,
        layout=ctx.layout,
        coords=dict(
            tp_rank=ctx.tp_rank, cp_rank=ctx.cp_rank, pp_rank=ctx.pp_rank,
            ep_rank=ctx.ep_rank, etp_rank=ctx.etp_rank, dp_rank=ctx.dp_rank,
        ),
        sequence_parallel=sp,
        routers=[r.key() for r in p0.routers],
        micro_batches=mbs,
        fwd0=_records(p0, cell.collect),
        train=_records(pt, False),
        fwd1=_records(p1, cell.collect),
        train_losses=[r.loss for r in rt],
        fwd0_losses=[r.loss for r in r0],
        fwd1_losses=[r.loss for r in r1],
        fwd0_logits=[r.logits for r in r0 if r.logits is not None],
        fwd1_logits=[r.logits for r in r1 if r.logits is not None],
        params_without_grad=missing,
        grads_finite=finite,
        state=state,
    )


def run_cells(ctx: "RankContext", plan: dict["Layout", list[Cell]]) -> list[CellResult]:
    """Rank function for ``spawn_layouts``: the cells planned for this rank's layout."""
    return [run_cell(ctx, cell) for cell in plan[ctx.layout]]

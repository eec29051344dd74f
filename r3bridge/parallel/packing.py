"""Where each token of a packed micro-batch sits: :class:`PackPlan` (how the trainer pads and
packs the sequences) and the row map of every rank (:func:`rank_positions`, its inverse over all
ranks :func:`token_owners`).

The router of a Megatron rank sees rows in this order (docs/architecture.md, "Core"):

* THD packing: sequence ``i`` is padded to ``padded_i`` (a multiple of ``tp*cp*2`` if cp > 1
  else ``tp``; FP8: ``lcm(16, .)`` and the total to ``align*128``, the extra going to the last
  sequence) and the padded sequences are concatenated;
* CP: each padded sequence is cut into ``2*cp`` CP slices, CP rank ``r`` keeps slices ``r`` and
  ``2cp-1-r`` *of every sequence*, concatenated sequence by sequence (never one zigzag over the
  whole packed tensor: miles #774);
* SP: TP rank ``t`` routes the contiguous slice ``t`` of ``tp`` of that concatenation (one slice
  may straddle sequences); SP off: every TP rank routes all rows;
* PP/VPP: every stage routes the same rows, each only for its own MoE layers.

BSHD (fixed-length ``[b, s]`` micro-batch, no packing): the zigzag runs over the whole sequence
dim, SP splits the sequence dim, and rows are s-major: ``row = s * b + b_idx``.

Everything here is vectorised: no Python loop over tokens, rows or sequences. Moving routes to
and from the ranks by this map: ``sharding.py`` (R3) and ``unsharding.py`` (R2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from r3bridge._validate import as_index, as_index_list, check_readable
from r3bridge.batch.schema import ragged_arange
from r3bridge.errors import CoverageError, LayoutError, ReplayStateError
from r3bridge.parallel.layout import ParallelLayout

__all__ = ["PackPlan", "rank_positions", "token_owners", "rank_rows", "sp_bounds", "checked_ranks", "int64_tensor"]


@dataclass(frozen=True)
class PackPlan:
    """How a micro-batch's sequences are laid out in the trainer's packed input."""

    seq_lens: torch.Tensor      # int64 [n]: tokens the trainer sees per sequence
    padded_lens: torch.Tensor   # int64 [n]: THD padded length (BSHD: the common seq length)
    format: str                 # "thd" | "bshd"

    @classmethod
    def build(cls, layout: ParallelLayout, seq_lens: Sequence[int], *, format: str = "thd",
              cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
              seq_length: int | None = None) -> "PackPlan":
        lens = int64_tensor(seq_lens, "seq_lens", CoverageError)
        if lens.dim() != 1:
            raise CoverageError(f"seq_lens must be a flat list, got shape {tuple(lens.shape)}")
        if lens.numel() and int(lens.min()) < 1:
            i = int((lens < 1).nonzero()[0])
            raise CoverageError(f"sequence {i}: seq_len {int(lens[i])} must be >= 1")
        if format == "bshd":
            common_len = (as_index(seq_length, what="seq_length", error=LayoutError) if seq_length is not None
                          else (int(lens.max()) if lens.numel() else 0))
            if lens.numel() and int(lens.max()) > common_len:
                i = int(lens.argmax())
                raise CoverageError(f"sequence {i}: seq_len {int(lens[i])} exceeds BSHD seq_length {common_len}")
            # Megatron needs s % (2*cp) == 0 for the zigzag and (s / cp) % tp == 0 for the SP
            # split of the CP-local sequence; 2*cp*tp was stricter than that (s=12, cp=2, tp=2
            # is a valid BSHD batch).
            zigzag_parts = 2 * layout.cp if layout.cp > 1 else 1
            if common_len % zigzag_parts or (common_len // layout.cp) % layout.sp_split:
                raise LayoutError(f"BSHD seq_length {common_len} must be divisible by 2*cp={zigzag_parts} and "
                                  f"seq_length/cp by tp={layout.sp_split} (SP split)")
            return cls(lens, torch.full_like(lens, common_len), "bshd")
        if format != "thd":
            raise LayoutError(f"unknown packing format {format!r} (use 'thd' or 'bshd')")
        if cu_seqlens_padded is not None:
            cu_padded = int64_tensor(cu_seqlens_padded, "cu_seqlens_padded", LayoutError)
            if cu_padded.shape != (lens.numel() + 1,) or int(cu_padded[0]) != 0:
                raise LayoutError(f"cu_seqlens_padded must be [0, ...] with {lens.numel() + 1} entries, "
                                  f"got {cu_padded.tolist()}")
            padded = cu_padded[1:] - cu_padded[:-1]
            short = (padded < lens).nonzero()
            if short.numel():
                i = int(short[0])
                raise LayoutError(f"sequence {i}: cu_seqlens_padded gives {int(padded[i])} tokens, "
                                  f"fewer than its seq_len {int(lens[i])}")
            need = 2 * layout.cp if layout.cp > 1 else 1
            bad = (padded % need != 0).nonzero()
            if bad.numel():
                i = int(bad[0])
                raise LayoutError(f"sequence {i}: padded length {int(padded[i])} from cu_seqlens_padded "
                                  f"is not divisible by 2*cp={need}: the trainer's packing disagrees "
                                  f"with the layout (cp={layout.cp})")
            if int(padded.sum()) // layout.cp % layout.sp_split:
                raise LayoutError(f"packed length {int(padded.sum())} / cp={layout.cp} is not divisible "
                                  f"by tp={layout.tp} for the SP split: packing disagrees with the layout")
            return cls(lens, padded, "thd")
        align = layout.align
        padded = (lens + align - 1) // align * align
        if layout.total_align > 1 and padded.numel():
            extra = (-int(padded.sum())) % layout.total_align
            padded = padded.clone()
            padded[-1] += extra
        return cls(lens, padded, "thd")

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.numel())


def int64_tensor(xs, what: str, error) -> torch.Tensor:
    """int64 CPU tensor of exactly integral values; an integer tensor is taken as it is."""
    if isinstance(xs, torch.Tensor) and not xs.is_floating_point() and xs.dtype != torch.bool:
        check_readable(xs, what=what, error=error)
        if xs.dim() != 1:
            raise error(f"{what} must be a flat list, got shape {tuple(xs.shape)}")
        return xs.to(torch.int64).cpu()
    return torch.tensor(as_index_list(xs, what=what, error=error), dtype=torch.int64)


def checked_ranks(layout: ParallelLayout, tp_rank: int, cp_rank: int) -> tuple[int, int]:
    """``(tp_rank, cp_rank)`` as ints; ``LayoutError`` unless both are ranks of ``layout``."""
    checked = []
    for dim, rank, size in (("tp", tp_rank, layout.tp), ("cp", cp_rank, layout.cp)):
        rank = as_index(rank, what=f"{dim}_rank", error=LayoutError)
        if not 0 <= rank < size:
            raise LayoutError(f"{dim}_rank {rank} out of range for {dim}={size}")
        checked.append(rank)
    return checked[0], checked[1]


def rank_positions(plan: PackPlan, layout: ParallelLayout, tp_rank: int, cp_rank: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, token position) of every router row of rank (tp_rank, cp_rank), in row order.

    Positions ``>= seq_len`` are padding.
    """
    tp_rank, cp_rank = checked_ranks(layout, tp_rank, cp_rank)
    cp, num_seqs = layout.cp, plan.num_seqs
    if num_seqs == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    if plan.format == "bshd":
        seq_length = int(plan.padded_lens[0])
        pos = _zigzag_positions(seq_length, cp, cp_rank)                # positions along s
        pos = _sp_slice(pos, layout, tp_rank)
        seq = torch.arange(num_seqs, dtype=torch.int64).repeat(pos.numel())    # s-major rows
        return seq, pos.repeat_interleave(num_seqs)
    padded = plan.padded_lens
    if cp > 1:
        slice_len = padded // (2 * cp)
        # per sequence two segments (CP slice r, CP slice 2cp-1-r), in sequence order
        seg_start = torch.stack([slice_len * cp_rank, slice_len * (2 * cp - 1 - cp_rank)], 1).reshape(-1)
        seg_len = slice_len.repeat_interleave(2, output_size=2 * num_seqs)
        pos = ragged_arange(seg_start, seg_len)
        seq = torch.arange(num_seqs, dtype=torch.int64).repeat_interleave(2 * slice_len, output_size=pos.numel())
    else:
        pos = ragged_arange(torch.zeros(num_seqs, dtype=torch.int64), padded)
        seq = torch.arange(num_seqs, dtype=torch.int64).repeat_interleave(padded, output_size=pos.numel())
    lo, hi = sp_bounds(pos.numel(), layout, tp_rank)
    return seq[lo:hi], pos[lo:hi]


def token_owners(plan: PackPlan, layout: ParallelLayout, tp_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`rank_positions` over all ranks at once: for every real token of the plan,
    in (sequence, position) order, the rank holding it (``cp_rank * tp_ranks + tp_rank``) and its
    row there. ``tp_ranks`` is 1 when SP is off (every TP rank holds every row: TP rank 0 is used).

    Raises unless every real token is held exactly once.
    """
    lens = plan.seq_lens
    offsets = torch.zeros(plan.num_seqs + 1, dtype=torch.int64)
    if plan.num_seqs:
        offsets[1:] = torch.cumsum(lens, 0)
    total = int(offsets[-1])
    rank = torch.full((total,), -1, dtype=torch.int64)
    row = torch.empty(total, dtype=torch.int64)
    for cp_rank in range(layout.cp):
        for tp_rank in range(tp_ranks):
            seq, pos = rank_positions(plan, layout, tp_rank, cp_rank)
            keep = (pos < lens[seq]).nonzero().squeeze(1)
            dst = offsets[seq.index_select(0, keep)] + pos.index_select(0, keep)
            if bool((rank.index_select(0, dst) >= 0).any()):
                raise ReplayStateError(f"token_owners: rank (tp={tp_rank}, cp={cp_rank}) holds tokens another "
                                       f"rank holds")
            rank[dst] = cp_rank * tp_ranks + tp_rank
            row[dst] = keep
    if bool((rank < 0).any()):
        raise CoverageError(f"token_owners: {int((rank < 0).sum())} of {total} tokens are on no rank")
    return rank, row


def rank_rows(plan: PackPlan, layout: ParallelLayout) -> int:
    """Router rows of every TP/CP rank for ``plan`` (the same on each)."""
    if plan.format == "bshd":
        seq_length = int(plan.padded_lens[0]) if plan.num_seqs else 0
        return seq_length // layout.cp // layout.sp_split * plan.num_seqs
    return int(plan.padded_lens.sum()) // layout.cp // layout.sp_split


def _zigzag_positions(seq_length: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Positions along a sequence of ``seq_length`` that CP rank ``cp_rank`` keeps: CP slices
    ``r`` and ``2cp-1-r`` of ``2cp``."""
    if cp == 1:
        return torch.arange(seq_length, dtype=torch.int64)
    slice_len = seq_length // (2 * cp)
    return torch.cat([torch.arange(cp_rank * slice_len, (cp_rank + 1) * slice_len),
                      torch.arange((2 * cp - 1 - cp_rank) * slice_len, (2 * cp - cp_rank) * slice_len)])


def sp_bounds(total: int, layout: ParallelLayout, tp_rank: int) -> tuple[int, int]:
    """``[lo, hi)``: the slice of ``total`` CP-local rows that TP rank ``tp_rank`` routes (SP off:
    all of them)."""
    split = layout.sp_split
    if total % split:
        raise LayoutError(f"{total} CP-local rows are not divisible by tp={split} for the SP split")
    if split == 1:
        return 0, total
    width = total // split
    return tp_rank * width, (tp_rank + 1) * width


def _sp_slice(pos: torch.Tensor, layout: ParallelLayout, tp_rank: int) -> torch.Tensor:
    lo, hi = sp_bounds(pos.numel(), layout, tp_rank)
    return pos[lo:hi]

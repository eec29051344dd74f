"""A micro-batch's pack plan and this rank's row map (router row order), built once per micro-batch:
the second step of the one reader (docs/architecture.md, "One reader"). The driver's counts,
every VPP chunk's read and a late recompute share one :class:`RankRows`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from r3bridge.batch.meta import check_coverage
from r3bridge.errors import CoverageError
from r3bridge.parallel.handed import HandedRoutes, naming_samples, shown_names
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.packing import PackPlan, checked_ranks, rank_positions, sp_bounds

__all__ = ["RankRows"]


@dataclass
class RankRows:
    """A micro-batch's pack plan and this rank's row map (router row order), built once.

    ``seq[t]`` / ``pos[t]``: sequence and token position of router row ``t`` (positions ``>=
    seq_len`` are packing padding); ``covered[t]``: the handed routes hold a route for it, at
    source row ``src[t]`` of its sequence (explicit masks and captured ranges applied).
    ``token_rows``: rows of real tokens (not packing padding); ``unrouted_token_rows``: those of
    sequences handed without any route (:meth:`HandedRoutes.without_routes`: aborted or
    interrupted samples), which coverage guards count apart."""

    plan: PackPlan
    seq: np.ndarray
    pos: np.ndarray
    src: np.ndarray
    covered: np.ndarray
    token_rows: int
    unrouted_token_rows: int = 0

    @classmethod
    def build(cls, layout: ParallelLayout, seq_lens: Any, *, tp_rank: int, cp_rank: int, format: str = "thd",
              cu_seqlens_padded: Any = None, seq_length: Optional[int] = None) -> "RankRows":
        """The plan and the positions; :meth:`cover` fills what the routes hold."""
        plan = PackPlan.build(layout, seq_lens, format=format, cu_seqlens_padded=cu_seqlens_padded,
                              seq_length=seq_length)
        seq, pos = _positions(plan, layout, tp_rank, cp_rank)
        lens = plan.seq_lens.numpy()
        real = pos < lens[seq] if seq.size else np.zeros(0, dtype=bool)
        return cls(plan, seq, pos, np.zeros(seq.size, dtype=np.int64), np.zeros(seq.size, dtype=bool),
                   int(real.sum()))

    @property
    def num_rows(self) -> int:
        return int(self.seq.size)

    def cover(self, routes: HandedRoutes) -> "RankRows":
        """The same plan with ``routes``' coverage: a row is covered where its token lies in
        ``[start, start + captured)`` of its sequence (and before ``seq_len``) and, with a mask,
        the mask says so. Checks the routes fit the trainer's token counts."""
        lens = self.plan.seq_lens.numpy()
        if routes.num_seqs != lens.size:
            raise CoverageError(f"batch has {routes.num_seqs} sequences but {lens.size} seq_lens were given")
        with naming_samples(shown_names(routes.names, routes.framework)):
            check_coverage(routes.starts, routes.rows, lens.tolist())
        if not self.seq.size:
            return self
        without = routes.without_routes()
        unrouted = int((without[self.seq] & (self.pos < lens[self.seq])).sum()) if without.any() else 0
        starts = np.asarray(routes.starts, dtype=np.int64)
        hi = np.minimum(starts + routes.captured_rows(), lens)
        seq, pos = self.seq, self.pos
        start = starts[seq]
        covered = (pos >= start) & (pos < hi[seq])
        src = np.where(covered, pos - start, 0)
        if routes.no_route == "mask" and covered.any():
            idx = np.flatnonzero(covered)
            b = torch.from_numpy(routes.seq_b[seq[idx]]).to(routes.mask.device)
            s = torch.from_numpy(routes.seq_s0[seq[idx]] + src[idx]).to(routes.mask.device)
            covered[idx] = routes.mask[b, s].cpu().numpy()
        return RankRows(self.plan, seq, pos, src, covered, self.token_rows, unrouted)


def _positions(plan: PackPlan, layout: ParallelLayout, tp_rank: int, cp_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, token position) of every router row of rank (tp_rank, cp_rank). THD per run in
    numpy (a rank's rows are, per sequence, its two CP slices clipped to its SP slice: one
    ragged arange); BSHD through :func:`r3bridge.parallel.packing.rank_positions`."""
    if plan.format != "thd":
        seq, pos = rank_positions(plan, layout, tp_rank, cp_rank)
        return seq.numpy(), pos.numpy()
    tp_rank, cp_rank = checked_ranks(layout, tp_rank, cp_rank)
    n, cp = plan.num_seqs, layout.cp
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    padded = plan.padded_lens.numpy().astype(np.int64)
    if cp > 1:
        slice_len = padded // (2 * cp)
        seg_seq = np.repeat(np.arange(n, dtype=np.int64), 2)
        seg_pos = np.stack([slice_len * cp_rank, slice_len * (2 * cp - 1 - cp_rank)], 1).reshape(-1)
        seg_len = np.repeat(slice_len, 2)
    else:
        seg_seq, seg_pos, seg_len = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), padded
    seg_end = np.cumsum(seg_len)
    lo, hi = sp_bounds(int(seg_end[-1]), layout, tp_rank)
    seg_begin = seg_end - seg_len
    cb, ce = np.clip(seg_begin, lo, hi), np.clip(seg_end, lo, hi)
    seg_pos, seg_len = seg_pos + (cb - seg_begin), ce - cb
    total = hi - lo
    seg_off = np.cumsum(seg_len) - seg_len
    seq = np.repeat(seg_seq, seg_len)
    pos = np.arange(total, dtype=np.int64) + np.repeat(seg_pos - seg_off, seg_len)
    return seq, pos

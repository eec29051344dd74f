"""Exact rank distribution of routes: ``shard`` (R3 targets) and its inverse ``unshard`` (R2).

The router of a Megatron rank sees rows in this order (docs/architecture.md, "Core"):

* THD packing: sequence ``i`` is padded to ``padded_i`` (a multiple of ``tp*cp*2`` if cp > 1
  else ``tp``; FP8: ``lcm(16, .)`` and the total to ``align*128``, the extra going to the last
  sequence) and the padded sequences are concatenated;
* CP: each padded sequence is cut into ``2*cp`` chunks, CP rank ``r`` keeps chunks ``r`` and
  ``2cp-1-r`` *of every sequence*, concatenated sequence by sequence (never one zigzag over the
  whole packed tensor: miles #774);
* SP: TP rank ``t`` routes the contiguous slice ``t`` of ``tp`` of that concatenation (one slice
  may straddle sequences); SP off: every TP rank routes all rows;
* PP/VPP: every stage routes the same rows, each only for its own MoE layers.

BSHD (fixed-length ``[b, s]`` micro-batch, no packing): the zigzag runs over the whole sequence
dim, SP splits the sequence dim, and rows are s-major: ``row = s * b + b_idx``.

Everything here is vectorised: no Python loop over tokens, rows or sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from r3bridge._validate import as_index, as_index_list, check_readable
from r3bridge.errors import CoverageError, LayerMappingError, LayoutError, ReplayStateError, RouteShapeError
from r3bridge.layout import ParallelLayout
from r3bridge.schema import ReplayBatch, ragged_arange, route_dtype

__all__ = ["PackPlan", "ShardedTargets", "shard", "unshard", "rank_positions", "token_owners", "assemble_gathered"]

RankKey = tuple[int, int, int, int]  # (tp_rank, cp_rank, pp_rank, vp_stage)


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
        lens = _int_tensor(seq_lens, "seq_lens", CoverageError)
        if lens.dim() != 1:
            raise CoverageError(f"seq_lens must be a flat list, got shape {tuple(lens.shape)}")
        if lens.numel() and int(lens.min()) < 1:
            i = int((lens < 1).nonzero()[0])
            raise CoverageError(f"sequence {i}: seq_len {int(lens[i])} must be >= 1")
        if format == "bshd":
            s = as_index(seq_length, what="seq_length", error=LayoutError) if seq_length is not None else (int(lens.max()) if lens.numel() else 0)
            if lens.numel() and int(lens.max()) > s:
                i = int(lens.argmax())
                raise CoverageError(f"sequence {i}: seq_len {int(lens[i])} exceeds BSHD seq_length {s}")
            # Megatron needs s % (2*cp) == 0 for the zigzag and (s / cp) % tp == 0 for the SP
            # split of the CP-local sequence; 2*cp*tp was stricter than that (s=12, cp=2, tp=2
            # is a valid BSHD batch).
            zig = 2 * layout.cp if layout.cp > 1 else 1
            if s % zig or (s // layout.cp) % layout.sp_split:
                raise LayoutError(f"BSHD seq_length {s} must be divisible by 2*cp={zig} and "
                                  f"seq_length/cp by tp={layout.sp_split} (SP split)")
            return cls(lens, torch.full_like(lens, s), "bshd")
        if format != "thd":
            raise LayoutError(f"unknown packing format {format!r} (use 'thd' or 'bshd')")
        if cu_seqlens_padded is not None:
            cu = _int_tensor(cu_seqlens_padded, "cu_seqlens_padded", LayoutError)
            if cu.shape != (lens.numel() + 1,) or int(cu[0]) != 0:
                raise LayoutError(f"cu_seqlens_padded must be [0, ...] with {lens.numel() + 1} entries, "
                                  f"got {cu.tolist()}")
            padded = cu[1:] - cu[:-1]
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
        a = layout.align
        padded = (lens + a - 1) // a * a
        if layout.total_align > 1 and padded.numel():
            t = layout.total_align
            extra = (-int(padded.sum())) % t
            padded = padded.clone()
            padded[-1] += extra
        return cls(lens, padded, "thd")

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.numel())


def _int_tensor(xs, what: str, error) -> torch.Tensor:
    """int64 CPU tensor of exactly integral values; an integer tensor is taken as it is."""
    if isinstance(xs, torch.Tensor) and not xs.is_floating_point() and xs.dtype != torch.bool:
        check_readable(xs, what=what, error=error)
        if xs.dim() != 1:
            raise error(f"{what} must be a flat list, got shape {tuple(xs.shape)}")
        return xs.to(torch.int64).cpu()
    return torch.tensor(as_index_list(xs, what=what, error=error), dtype=torch.int64)


def rank_positions(plan: PackPlan, layout: ParallelLayout, tp_rank: int, cp_rank: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, token position) of every router row of rank (tp_rank, cp_rank), in row order.

    Positions ``>= seq_len`` are padding.
    """
    tp_rank = as_index(tp_rank, what="tp_rank", error=LayoutError)
    cp_rank = as_index(cp_rank, what="cp_rank", error=LayoutError)
    if not 0 <= tp_rank < layout.tp:
        raise LayoutError(f"tp_rank {tp_rank} out of range for tp={layout.tp}")
    if not 0 <= cp_rank < layout.cp:
        raise LayoutError(f"cp_rank {cp_rank} out of range for cp={layout.cp}")
    cp, n = layout.cp, plan.num_seqs
    if n == 0:
        z = torch.zeros(0, dtype=torch.int64)
        return z, z
    if plan.format == "bshd":
        s = int(plan.padded_lens[0])
        pos = _zigzag_positions(torch.tensor([s]), cp, cp_rank)         # positions along s
        pos = _sp_slice(pos, layout, tp_rank)
        seq = torch.arange(n, dtype=torch.int64).repeat(pos.numel())    # s-major rows
        return seq, pos.repeat_interleave(n)
    padded = plan.padded_lens
    if cp > 1:
        chunk = padded // (2 * cp)
        # per sequence two segments (chunk r, chunk 2cp-1-r), in sequence order
        seg_start = torch.stack([chunk * cp_rank, chunk * (2 * cp - 1 - cp_rank)], 1).reshape(-1)
        seg_len = chunk.repeat_interleave(2, output_size=2 * n)
        pos = ragged_arange(seg_start, seg_len)
        seq = torch.arange(n, dtype=torch.int64).repeat_interleave(2 * chunk, output_size=pos.numel())
    else:
        pos = ragged_arange(torch.zeros(n, dtype=torch.int64), padded)
        seq = torch.arange(n, dtype=torch.int64).repeat_interleave(padded, output_size=pos.numel())
    lo, hi = _sp_bounds(pos.numel(), layout, tp_rank)
    return seq[lo:hi], pos[lo:hi]


def token_owners(plan: PackPlan, layout: ParallelLayout, tp_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`rank_positions` over all ranks at once: for every real token of the plan,
    in (sequence, position) order, the rank holding it (``cp_rank * tp_ranks + tp_rank``) and its
    row there. ``tp_ranks`` is 1 when SP is off (every TP rank holds every row: TP rank 0 is used).

    Raises unless every real token is held exactly once.
    """
    lens = plan.seq_lens
    offs = torch.zeros(plan.num_seqs + 1, dtype=torch.int64)
    if plan.num_seqs:
        offs[1:] = torch.cumsum(lens, 0)
    total = int(offs[-1])
    rank = torch.full((total,), -1, dtype=torch.int64)
    row = torch.empty(total, dtype=torch.int64)
    for cr in range(layout.cp):
        for tr in range(tp_ranks):
            seq, pos = rank_positions(plan, layout, tr, cr)
            keep = (pos < lens[seq]).nonzero().squeeze(1)
            dst = offs[seq.index_select(0, keep)] + pos.index_select(0, keep)
            if bool((rank.index_select(0, dst) >= 0).any()):
                raise ReplayStateError(f"token_owners: rank (tp={tr}, cp={cr}) holds tokens another rank holds")
            rank[dst] = cr * tp_ranks + tr
            row[dst] = keep
    if bool((rank < 0).any()):
        raise CoverageError(f"token_owners: {int((rank < 0).sum())} of {total} tokens are on no rank")
    return rank, row


def assemble_gathered(flat: torch.Tensor, layout: ParallelLayout, plans: Sequence[PackPlan], sample_ids: Sequence[int],
                      *, num_experts: int, topk: int, source: str = "recorded", method: str = "auto") -> ReplayBatch:
    """Per-sample routes out of the R2 gather buffer, in one pass over all micro-batches.

    ``flat`` holds every rank's recorded ids, ``[pp][cp][tp'][part]`` with tp' = tp under SP else
    1, each rank's part padded to the same length and laid out ``[micro-batch][its rows][its
    stage's MoE layers, chunk by chunk][K]`` (token-major: each rank transposes its own share
    before the gather, so reading the buffer needs no transpose of the whole batch). ``plans[m]`` is micro-batch m's packing plan and
    ``sample_ids`` numbers its sequences (all micro-batches in order); the result holds every
    token of every sequence, sorted by sample id, every MoE layer of the layout.

    One plan (:func:`token_owners` per micro-batch, never per stage) gives each output row its
    source row; then either one row-block copy per (run of consecutive source rows, model chunk)
    ("runs", what packed batches give: a handful of runs), or one gather through a
    ``[rows, layers]`` index ("index", for many short runs). ``method="auto"`` picks by the number
    of copies. Everything after the plan runs on ``flat``'s device.
    """
    k = int(topk)
    dtype = route_dtype(num_experts)
    tp_n = layout.tp if layout.sequence_parallel else 1
    ranks = layout.cp * tp_n
    chunks = [(p, v, layout.moe_layers(p, v)) for p in range(layout.pp) for v in range(layout.vp_size)]
    stage_n = [sum(len(l) for q, _, l in chunks if q == p) for p in range(layout.pp)]
    rows = [int(_rank_rows(pl, layout)) for pl in plans]
    if flat.numel() % (layout.pp * ranks * k):
        raise ReplayStateError(f"gathered buffer of {flat.numel()} ids does not split into {layout.pp} stages x "
                               f"{ranks} ranks x top-{k}")
    w = flat.numel() // (layout.pp * ranks * k)          # one rank's part, in rows of K ids
    need = max((sum(rows) * n for n in stage_n), default=0)
    if w < need:
        raise ReplayStateError(f"gathered rank parts hold {w} rows of ids, the micro-batches need {need}")
    if len(set(sample_ids)) != len(sample_ids):
        raise ReplayStateError(f"duplicate sample_ids across micro-batches: {list(sample_ids)}")
    owner, mb_of, lens = [], [], []
    for m, plan in enumerate(plans):
        rank, row = token_owners(plan, layout, tp_n)
        split = plan.seq_lens.tolist()
        owner += list((rank * w + row).split(split))
        mb_of += [m] * plan.num_seqs
        lens += split
    if len(sample_ids) != len(lens):
        raise CoverageError(f"{len(sample_ids)} sample_ids for {len(lens)} sequences")
    order = sorted(range(len(lens)), key=lambda i: sample_ids[i])
    lens_out = [lens[i] for i in order]
    n_out = sum(lens_out)
    lids = layout.moe_layer_ids
    col = {lid: j for j, lid in enumerate(lids)}
    ids = flat.view(-1, k)
    words = _as_words(ids) if ids.is_contiguous() else ids   # a (row, layer)'s K ids as one word
    out = torch.empty((n_out, len(lids), words.shape[1]), dtype=words.dtype, device=flat.device)
    src = torch.cat([owner[i] for i in order]) if order else torch.zeros(0, dtype=torch.int64)
    src_mb = torch.tensor([mb_of[i] for i in order], dtype=torch.int64).repeat_interleave(
        torch.tensor(lens_out, dtype=torch.int64), output_size=n_out)
    before = [[sum(rows[:m]) * stage_n[p] for m in range(len(plans))] for p in range(layout.pp)]
    # runs of output rows whose source rows are consecutive in one rank's part of one micro-batch
    brk = torch.ones(n_out, dtype=torch.bool)
    if n_out > 1:
        brk[1:] = (src[1:] != src[:-1] + 1) | (src_mb[1:] != src_mb[:-1]) | (src[1:] // w != src[:-1] // w)
    starts = brk.nonzero().squeeze(1)
    copies = starts.numel() * sum(1 for c in chunks if c[2])
    if method == "auto":
        method = "runs" if copies <= 64 else "index"
    if method == "runs":
        ends = torch.cat([starts[1:], torch.tensor([n_out])]).tolist()
        for o, e in zip(starts.tolist(), ends):
            s0, m = int(src[o]), int(src_mb[o])
            rank, j0 = divmod(s0, w)
            q = 0
            for p, v, cl in chunks:
                if v == 0:
                    q = 0
                if not cl:
                    continue
                sn = stage_n[p]
                base = (p * ranks + rank) * w + before[p][m]
                block = words[base + j0 * sn: base + (j0 + e - o) * sn].view(e - o, sn, -1)
                out[o:e, col[cl[0]]: col[cl[0]] + len(cl)].copy_(block[:, q: q + len(cl)])
                q += len(cl)
    elif method == "index":
        part = torch.empty((len(plans), len(lids)), dtype=torch.int64)
        stride = torch.empty(len(lids), dtype=torch.int64)      # words per source row of the layer's stage
        for p, v, cl in chunks:
            q0 = sum(len(c) for pp_, vv, c in chunks if pp_ == p and vv < v)
            for qi, lid in enumerate(cl):
                stride[col[lid]] = stage_n[p]
                for m in range(len(plans)):
                    part[m, col[lid]] = p * ranks * w + before[p][m] + q0 + qi
        dev = flat.device
        rank, row = (src // w).to(dev), (src % w).to(dev) if w else src.to(dev)
        index = part.to(dev).index_select(0, src_mb.to(dev)) + (rank * w)[:, None] + row[:, None] * stride.to(dev)
        torch.index_select(words, 0, index.view(-1), out=out.view(-1, words.shape[1]))
    else:
        raise LayoutError(f"assemble_gathered: unknown method {method!r} (use 'auto', 'runs' or 'index')")
    routes = out.view(torch.uint8).view(dtype).view(n_out, len(lids), k)
    # The ids are the routers' own top-k narrowed to a dtype that holds num_experts: distinct and
    # in range by construction, so only the schema is rebuilt (as in unshard).
    return ReplayBatch.from_trusted(routes, lens_out, [0] * len(lens_out), torch.ones(n_out, dtype=torch.bool),
                                tuple(lids), num_experts, source)


def _rank_rows(plan: PackPlan, layout: ParallelLayout) -> int:
    """Router rows of every TP/CP rank for ``plan`` (the same on each)."""
    if plan.format == "bshd":
        s = int(plan.padded_lens[0]) if plan.num_seqs else 0
        return s // layout.cp // layout.sp_split * plan.num_seqs
    return int(plan.padded_lens.sum()) // layout.cp // layout.sp_split


def _zigzag_positions(length: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    s = int(length[0])
    if cp == 1:
        return torch.arange(s, dtype=torch.int64)
    c = s // (2 * cp)
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c),
                      torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)])


def _sp_bounds(total: int, layout: ParallelLayout, tp_rank: int) -> tuple[int, int]:
    k = layout.sp_split
    if total % k:
        raise LayoutError(f"{total} CP-local rows are not divisible by tp={k} for the SP split")
    if k == 1:
        return 0, total
    step = total // k
    return tp_rank * step, (tp_rank + 1) * step


def _sp_slice(pos: torch.Tensor, layout: ParallelLayout, tp_rank: int) -> torch.Tensor:
    lo, hi = _sp_bounds(pos.numel(), layout, tp_rank)
    return pos[lo:hi]


@dataclass
class ShardedTargets:
    """One rank's replay targets for one micro-batch.

    ``indices[layer_id]`` is the int64 ``[T_local, K]`` target of that MoE layer's router, rows in
    router order; ``valid[r]`` is False where row ``r`` has no route (filler ids ``0..K-1``).
    """

    indices: dict[int, torch.Tensor]
    valid: torch.Tensor
    layer_ids: tuple[int, ...]
    topk: int
    num_valid: int | None = None    # valid.sum(), counted on the host by shard (no device sync)

    @property
    def num_rows(self) -> int:
        return int(self.valid.numel())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.indices.values()) + self.valid.numel()


def _lookup(rb: ReplayBatch, seq: torch.Tensor, pos: torch.Tensor, seq_lens: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index into ``rb.routes`` (0 where uncovered) and validity, for each (seq, pos)."""
    starts = torch.tensor(rb.start_rows, dtype=torch.int64)
    # per-sequence [lo, hi) of covered token positions, clipped to the real tokens; and the
    # packed row of position p is base + p. Three per-row gathers instead of five (P1).
    lo = starts
    hi = torch.minimum(starts + torch.tensor(rb.rows_per_seq, dtype=torch.int64), seq_lens)
    base = rb.offsets[:-1] - starts
    covered = (pos >= lo[seq]) & (pos < hi[seq])
    row = torch.where(covered, base[seq] + pos, 0)
    if rb.total_rows and not bool(rb.valid.all()):
        covered &= rb.valid.cpu()[row]
    return row, covered


def _thd_rows(rb: ReplayBatch, plan: PackPlan, layout: ParallelLayout, tp_rank: int, cp_rank: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """THD fast path of ``rank_positions`` + ``_lookup`` (same result), per run not per row.

    A rank's rows are a few contiguous runs of token positions (per sequence the CP chunks
    ``r`` and ``2cp-1-r``, clipped to the rank's SP slice). The packed row of position ``p`` of
    sequence ``i`` is ``offsets[i] - start[i] + p``, so the row indices are one ragged arange
    over the runs, and the covered part of each run is one sub-run, turned into a row mask by a
    cumulative sum of +1/-1 marks. Per-run arithmetic is done in numpy (tiny arrays, where a
    torch op's fixed cost dominates); the O(rows) part is three vectorised passes (P1).
    """
    if not 0 <= tp_rank < layout.tp:
        raise LayoutError(f"tp_rank {tp_rank} out of range for tp={layout.tp}")
    if not 0 <= cp_rank < layout.cp:
        raise LayoutError(f"cp_rank {cp_rank} out of range for cp={layout.cp}")
    n, cp = plan.num_seqs, layout.cp
    if n == 0:
        z = torch.zeros(0, dtype=torch.int64)
        return z, z.bool()
    padded = plan.padded_lens.cpu().numpy()
    if cp > 1:
        chunk = padded // (2 * cp)
        seg_seq = np.repeat(np.arange(n, dtype=np.int64), 2)
        seg_pos = np.stack([chunk * cp_rank, chunk * (2 * cp - 1 - cp_rank)], 1).reshape(-1)
        seg_len = np.repeat(chunk, 2)
    else:
        seg_seq, seg_pos, seg_len = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), padded
    # clip the runs to this rank's SP slice [lo, hi) of the CP-local concatenation
    seg_end = np.cumsum(seg_len)
    lo, hi = _sp_bounds(int(seg_end[-1]), layout, tp_rank)
    a = seg_end - seg_len
    ca, cb = np.clip(a, lo, hi), np.clip(seg_end, lo, hi)
    seg_pos, seg_len = seg_pos + (ca - a), cb - ca
    total = hi - lo
    # covered token range [c_lo, c_hi) of each sequence (real tokens only); row = base + pos
    starts = np.asarray(rb.start_rows, dtype=np.int64)
    c_hi = np.minimum(starts + np.asarray(rb.rows_per_seq, dtype=np.int64), plan.seq_lens.cpu().numpy())
    base = rb.offsets[:-1].numpy() - starts
    seg_first_row = base[seg_seq] + seg_pos
    seg_off = np.cumsum(seg_len) - seg_len
    run_a = np.minimum(np.maximum(starts[seg_seq] - seg_pos, 0), seg_len)
    run_b = np.maximum(np.minimum(np.maximum(c_hi[seg_seq] - seg_pos, 0), seg_len), run_a)
    # row[t] = t + (first row of t's run - offset of t's run)
    row = np.arange(total, dtype=np.int64) + np.repeat(seg_first_row - seg_off, seg_len)
    marks = np.zeros(total + 1, dtype=np.int32)
    np.add.at(marks, seg_off + run_a, 1)
    np.add.at(marks, seg_off + run_b, -1)
    covered = np.cumsum(marks[:-1], dtype=np.int32) > 0
    row = np.where(covered, row, 0)
    row_t, covered_t = torch.from_numpy(row), torch.from_numpy(covered)
    if rb.total_rows and not bool(rb.valid.all()):
        covered_t &= rb.valid.cpu()[row_t]
    return row_t, covered_t


def _gather_layer_major(src: torch.Tensor, row: torch.Tensor, cols: list[int]) -> torch.Tensor:
    """``src[row][:, cols].permute(1, 0, 2).contiguous()`` (``[nl, T, K]``, src's narrow dtype).

    Speed (P1 in docs/benchmarks.md), same result:

    * an element-wise gather of 1-byte ids is slow, so the ``K`` ids of one (row, layer) are
      moved as machine words: ``src`` is viewed as ``[rows, L, n_words]`` of the widest int type
      dividing ``K * itemsize`` bytes (one int64 per (row, layer) for top-8 uint8), gathered and
      transposed in that form, and viewed back (bytes are moved, never reinterpreted);
    * a stage's layers are usually consecutive columns: slice them first (a view) and gather
      only their bytes with ``index_select`` (advanced indexing with two index tensors is ~20x
      slower on CPU).

    Falls back to plain element gathers when ``src`` cannot be viewed as words (non-contiguous,
    misaligned storage offset).
    """
    rows, L, k = src.shape
    nbytes = k * src.element_size()
    word, word_dtype = next((w, dt) for w, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16),
                                                   (1, torch.uint8)) if nbytes % w == 0)
    words = src
    if word > src.element_size() and src.is_contiguous():
        try:
            words = src.view(rows, L * k).view(word_dtype).view(rows, L, nbytes // word)
        except RuntimeError:       # storage offset not aligned to the word size: keep elements
            words = src
    c0 = cols[0]
    if cols == list(range(c0, c0 + len(cols))):
        part = words[:, c0:c0 + len(cols)].index_select(0, row)          # [T, nl, n]
    else:
        part = words.index_select(0, row).index_select(1, torch.tensor(cols, device=src.device))
    g = part.permute(1, 0, 2).contiguous()                                # [nl, T, n]
    if words is not src:
        g = g.view(torch.uint8).view(src.dtype).view(len(cols), row.numel(), k)
    return g


def shard(rb: ReplayBatch, layout: ParallelLayout, seq_lens: Sequence[int], *, tp_rank: int = 0,
          cp_rank: int = 0, pp_rank: int = 0, vp_stage: int = 0, format: str = "thd",
          cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
          seq_length: int | None = None, device: torch.device | str | None = None,
          layer_ids: Sequence[int] | None = None) -> ShardedTargets:
    """Targets of rank (tp_rank, cp_rank, pp_rank, vp_stage) for the micro-batch ``rb``.

    Only this stage's layers are selected from the compact batch, then widened to int64 (on
    ``device``). ``layer_ids`` overrides the stage's MoE layers (the driver passes the layers of
    the routers it actually found).
    """
    check_readable(rb.routes, what="shard: batch routes", error=RouteShapeError)
    seq_lens = _int_tensor(seq_lens, "seq_lens", CoverageError)
    tp_rank, cp_rank, pp_rank, vp_stage = (as_index(v, what=name, error=LayoutError) for v, name in (
        (tp_rank, "tp_rank"), (cp_rank, "cp_rank"), (pp_rank, "pp_rank"), (vp_stage, "vp_stage")))
    if layer_ids is not None:
        layer_ids = as_index_list(layer_ids, what="layer_ids", error=LayerMappingError)
    if device is not None and torch.device(device).type == "meta":
        raise LayoutError("shard: device='meta' would hold no values (targets must be readable)")
    rb.check_seq_lens(seq_lens)
    plan = PackPlan.build(layout, seq_lens, format=format, cu_seqlens_padded=cu_seqlens_padded,
                          seq_length=seq_length)
    want = list(layout.moe_layers(pp_rank, vp_stage) if layer_ids is None else layer_ids)
    col_of = {lid: j for j, lid in enumerate(rb.layer_ids)}
    missing = [x for x in want if x not in col_of]
    if missing:
        raise LayerMappingError(
            f"rank (pp={pp_rank}, vp={vp_stage}) needs MoE layers {missing}, but the batch only has "
            f"layers {list(rb.layer_ids)}")
    if plan.format == "thd":
        row, valid = _thd_rows(rb, plan, layout, tp_rank, cp_rank)
    else:
        seq, pos = rank_positions(plan, layout, tp_rank, cp_rank)
        row, valid = _lookup(rb, seq, pos, plan.seq_lens)
    dev = torch.device(device) if device is not None else rb.routes.device
    k = rb.topk
    num_valid = int(valid.sum())        # valid is still on the host here
    if not want:
        return ShardedTargets({}, valid.to(dev), (), k, num_valid)
    src = rb.routes
    cols = [col_of[x] for x in want]
    # Gather the compact (uint8/int16) rows and layers first, transpose to [nl, T, K] while still
    # narrow, then widen to int64 in one contiguous pass (on ``dev``).
    if src.shape[0] == 0:
        # No row at all (e.g. only 1-token sequences): every row is a filler; index_select on an
        # empty source raised even though row==0 is only a placeholder for uncovered rows.
        compact = torch.zeros((len(want), row.numel(), k), dtype=src.dtype, device=src.device)
    else:
        compact = _gather_layer_major(src, row.to(src.device), cols)
    out = torch.empty((len(want), row.numel(), k), dtype=torch.int64, device=dev)
    out.copy_(compact.to(dev, non_blocking=True))
    invalid = (~valid).nonzero().squeeze(1)
    if invalid.numel():
        out[:, invalid.to(dev)] = torch.arange(k, dtype=torch.int64, device=dev)
    return ShardedTargets({lid: out[j] for j, lid in enumerate(want)}, valid.to(dev), tuple(want), k, num_valid)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """View a contiguous ``[..., K]`` id tensor as ``[..., w]`` machine words (same bytes): moving
    one int64 per (row, layer) instead of K single bytes makes gathers and scatters ~8x cheaper."""
    nbytes = t.shape[-1] * t.element_size()
    for size, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        # torch views a tensor as a wider dtype only where its first byte is aligned to it
        if (nbytes % size == 0 and size > t.element_size() and t.is_contiguous()
                and (t.storage_offset() * t.element_size()) % size == 0):
            return t.view(dt)
    return t


def _layer_major(t: ShardedTargets, lids: list[int], device: torch.device) -> torch.Tensor:
    """``[nl, rows, K]`` of a rank's layers on ``device``; a view, not a copy, when the per-layer
    tensors are consecutive slices of one buffer there (what ``shard`` and the R2 recorder
    produce)."""
    parts = [t.indices[lid] for lid in lids]
    first = parts[0]
    step = first.numel()
    if first.device == device and all(
            p.is_contiguous() and p.shape == first.shape and p.dtype == first.dtype
            and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and p.storage_offset() == first.storage_offset() + j * step for j, p in enumerate(parts)):
        return first.as_strided((len(parts), *first.shape), (step, first.shape[1], 1))
    return torch.stack([p.to(device) for p in parts], 0)


def _dedupe_sp_off(targets: Mapping[RankKey, ShardedTargets], layout: ParallelLayout
                   ) -> dict[RankKey, ShardedTargets]:
    """SP off: every TP rank routed the same rows. Check they agree, keep the lowest TP rank."""
    if layout.sp_split != 1 or layout.tp == 1:
        return dict(targets)
    keep: dict[tuple[int, int, int], tuple[RankKey, ShardedTargets]] = {}
    for key, t in sorted(targets.items()):
        other = keep.setdefault(key[1:], (key, t))
        if other[0] is key:
            continue
        ref = other[1]
        for lid, idx in t.indices.items():
            if lid not in ref.indices or not torch.equal(ref.indices[lid], idx.to(ref.indices[lid].device)):
                raise ReplayStateError(f"unshard: TP ranks {other[0][0]} and {key[0]} disagree on layer {lid} "
                                       f"(cp={key[1]}, pp={key[2]}, vp={key[3]}) although SP is off")
    return {key: t for key, t in keep.values()}


def unshard(targets: Mapping[RankKey, ShardedTargets], layout: ParallelLayout,
            seq_lens: Sequence[int], *, num_experts: int, format: str = "thd",
            cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
            seq_length: int | None = None, start_rows: Sequence[int] | None = None,
            rows_per_seq: Sequence[int] | None = None, source: str = "recorded") -> ReplayBatch:
    """Inverse of ``shard``: per-rank targets keyed by (tp_rank, cp_rank, pp_rank, vp_stage) ->
    one ReplayBatch covering ``[start, start + rows)`` of each sequence (default: all tokens).

    Every MoE layer of the layout and every covered token must come from some rank; rows seen by
    several ranks (SP off) must agree. Targets may be int64 (as ``shard`` makes them) or already
    compact (the R2 recorder keeps uint8 / int16 end to end). Work is one scatter per rank, on
    the device of the targets' ids (the R2 recorder gathers them on the GPU); the result stays
    there.
    """
    num_experts = as_index(num_experts, what="num_experts", error=RouteShapeError)
    plan = PackPlan.build(layout, seq_lens, format=format, cu_seqlens_padded=cu_seqlens_padded,
                          seq_length=seq_length)
    n = plan.num_seqs
    starts = torch.zeros(n, dtype=torch.int64) if start_rows is None else _int_tensor(start_rows, "start_rows", CoverageError)
    rows = plan.seq_lens - starts if rows_per_seq is None else _int_tensor(rows_per_seq, "rows_per_seq", CoverageError)
    if starts.shape != (n,) or rows.shape != (n,):
        raise CoverageError(f"unshard: start_rows / rows_per_seq need {n} entries (one per sequence), got "
                            f"{starts.numel()} / {rows.numel()}")
    for key, t in targets.items():
        if len(key) != 4:
            raise LayoutError(f"unshard: target key {key!r} must be (tp_rank, cp_rank, pp_rank, vp_stage)")
        for name, v in zip(("tp_rank", "cp_rank", "pp_rank", "vp_stage"), key):
            as_index(v, what=f"unshard: target key {key!r} {name}", error=LayoutError)
        for lid, ids in t.indices.items():
            check_readable(ids, what=f"unshard: rank {key} layer {lid} ids", error=ReplayStateError)
    if n and (bool((starts < 0).any()) or bool((starts + rows > plan.seq_lens).any()) or bool((rows < 0).any())):
        raise CoverageError("unshard: start_rows/rows_per_seq do not fit seq_lens")
    layer_ids = sorted({lid for t in targets.values() for lid in t.layer_ids})
    need = layout.moe_layer_ids
    if layer_ids != need:
        raise LayerMappingError(f"unshard: targets hold MoE layers {layer_ids}, the layout has {need} "
                                f"(a pipeline stage's targets are missing?)")
    k = next((t.topk for t in targets.values()), 1)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    if n:
        offsets[1:] = torch.cumsum(rows, 0)
    total = int(offsets[-1])
    col_of = {lid: j for j, lid in enumerate(layer_ids)}
    dtype = route_dtype(num_experts)
    dev = next((i.device for t in targets.values() for i in t.indices.values()), torch.device("cpu"))
    out = torch.zeros((total, len(layer_ids), k), dtype=dtype, device=dev)
    out_words = _as_words(out)                  # [total, L, w]: the K ids of a (row, layer) as words
    written = torch.zeros(len(layer_ids), dtype=torch.int64)
    valid = torch.zeros(total, dtype=torch.bool)
    for (tp_rank, cp_rank, pp_rank, vp_stage), t in sorted(_dedupe_sp_off(targets, layout).items()):
        seq, pos = rank_positions(plan, layout, tp_rank, cp_rank)
        if seq.numel() != t.num_rows:
            raise ReplayStateError(f"unshard: rank (tp={tp_rank}, cp={cp_rank}, pp={pp_rank}, vp={vp_stage}) "
                                   f"has {t.num_rows} rows, the plan gives it {seq.numel()}")
        rel = pos - starts[seq]
        keep = ((rel >= 0) & (rel < rows[seq])).nonzero().squeeze(1)
        dst = (offsets[seq] + rel).index_select(0, keep)
        valid[dst] |= t.valid.cpu().index_select(0, keep)
        if not t.indices:
            continue
        lids = list(t.indices)
        cols = [col_of[lid] for lid in lids]
        stacked = _layer_major(t, lids, dev)                                       # [nl, rows, K]
        if stacked.numel():
            lo, hi = torch.aminmax(stacked)
            if int(lo) < 0 or int(hi) >= num_experts:
                raise ReplayStateError(f"unshard: rank (tp={tp_rank}, cp={cp_rank}, pp={pp_rank}, vp={vp_stage}) "
                                       f"holds expert ids outside [0, {num_experts})")
        ids = stacked.to(dtype)
        src = _as_words(ids)
        if src.shape[-1] != out_words.shape[-1]:
            # a view into a gathered buffer that starts mid-word (R2: a later micro-batch or rank
            # of an int16/int32 payload): an aligned copy takes the same word view as ``out``
            src = _as_words(ids.clone())
        src = src.transpose(0, 1)                                                   # [rows, nl, w]
        everything = keep.numel() == t.num_rows and bool((dst == torch.arange(total)).all()) \
            if dst.numel() == total else False
        if cols == list(range(cols[0], cols[0] + len(cols))):
            target = out_words[:, cols[0]:cols[0] + len(cols)]
            if everything:          # tp = cp = 1, full coverage: a plain (transposing) copy
                target.copy_(src)
            else:
                target.index_copy_(0, dst.to(dev), src.index_select(0, keep.to(dev)))
        else:
            out_words[dst.to(dev)[:, None], torch.tensor(cols, device=dev)[None, :]] = src.index_select(0, keep.to(dev))
        written[cols] += dst.numel()
    short = (written != total).nonzero()
    if short.numel():
        j = int(short[0])
        raise CoverageError(f"unshard: layer {layer_ids[j]} has {int(written[j])} of {total} rows: a rank's "
                            f"targets are missing or overlap")
    # The ids come from shard() of a validated batch or from the router's own top-k: distinct by
    # construction, so only the schema is rebuilt (the O(rows*L*K log K) duplicate scan is skipped).
    return ReplayBatch.from_trusted(out, rows.tolist(), starts.tolist(), valid.to(dev), tuple(layer_ids), num_experts,
                                source)

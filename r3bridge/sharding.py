"""``shard``: one rank's R3 replay targets (:class:`ShardedTargets`) of a micro-batch's routes,
rows in the order that rank's routers see them (the row map: ``packing.py``).

Everything here is vectorised: no Python loop over tokens, rows or sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from r3bridge._validate import as_index, as_index_list, check_readable
from r3bridge.errors import CoverageError, LayerMappingError, LayoutError, RouteShapeError
from r3bridge.layer_ids import shifted_layer_ids_hint
from r3bridge.layout import ParallelLayout
from r3bridge.packing import PackPlan, checked_ranks, int64_tensor, rank_positions, sp_bounds
from r3bridge.schema import ReplayBatch

__all__ = ["ShardedTargets", "shard"]


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
    # the rollout's gate weight of each target id (float32 [T_local, K] per layer, 0 on rows
    # without a route); None when the batch carries no weights
    weights: dict[int, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.valid.numel())

    @property
    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self.indices.values()) + self.valid.numel()
                + sum(t.numel() * t.element_size() for t in (self.weights or {}).values()))


def _lookup(batch: ReplayBatch, seq: torch.Tensor, pos: torch.Tensor, seq_lens: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index into ``batch.routes`` (0 where uncovered) and validity, for each (seq, pos)."""
    starts = torch.tensor(batch.start_rows, dtype=torch.int64)
    # per-sequence [lo, hi) of covered token positions, clipped to the real tokens; and the
    # packed row of position p is base + p. Three per-row gathers instead of five (P1).
    lo = starts
    hi = torch.minimum(starts + torch.tensor(batch.rows_per_seq, dtype=torch.int64), seq_lens)
    base = batch.offsets[:-1] - starts
    covered = (pos >= lo[seq]) & (pos < hi[seq])
    row = torch.where(covered, base[seq] + pos, 0)
    if batch.total_rows and not bool(batch.valid.all()):
        covered &= batch.valid.cpu()[row]
    return row, covered


def _thd_rows(batch: ReplayBatch, plan: PackPlan, layout: ParallelLayout, tp_rank: int, cp_rank: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """THD fast path of ``rank_positions`` + ``_lookup`` (same result), per run not per row.

    A rank's rows are a few contiguous runs of token positions (per sequence the CP chunks
    ``r`` and ``2cp-1-r``, clipped to the rank's SP slice). The packed row of position ``p`` of
    sequence ``i`` is ``offsets[i] - start[i] + p``, so the row indices are one ragged arange
    over the runs, and the covered part of each run is one sub-run, turned into a row mask by a
    cumulative sum of +1/-1 marks. Per-run arithmetic is done in numpy (tiny arrays, where a
    torch op's fixed cost dominates); the O(rows) part is three vectorised passes (P1).
    """
    tp_rank, cp_rank = checked_ranks(layout, tp_rank, cp_rank)
    num_seqs, cp = plan.num_seqs, layout.cp
    if num_seqs == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool)
    padded = plan.padded_lens.cpu().numpy()
    if cp > 1:
        chunk = padded // (2 * cp)
        seg_seq = np.repeat(np.arange(num_seqs, dtype=np.int64), 2)
        seg_pos = np.stack([chunk * cp_rank, chunk * (2 * cp - 1 - cp_rank)], 1).reshape(-1)
        seg_len = np.repeat(chunk, 2)
    else:
        seg_seq, seg_pos, seg_len = (np.arange(num_seqs, dtype=np.int64), np.zeros(num_seqs, dtype=np.int64),
                                     padded)
    # clip the runs to this rank's SP slice [lo, hi) of the CP-local concatenation
    seg_end = np.cumsum(seg_len)
    lo, hi = sp_bounds(int(seg_end[-1]), layout, tp_rank)
    seg_begin = seg_end - seg_len
    clipped_begin, clipped_end = np.clip(seg_begin, lo, hi), np.clip(seg_end, lo, hi)
    seg_pos, seg_len = seg_pos + (clipped_begin - seg_begin), clipped_end - clipped_begin
    total = hi - lo
    # covered token range [c_lo, c_hi) of each sequence (real tokens only); row = base + pos
    starts = np.asarray(batch.start_rows, dtype=np.int64)
    c_hi = np.minimum(starts + np.asarray(batch.rows_per_seq, dtype=np.int64), plan.seq_lens.cpu().numpy())
    base = batch.offsets[:-1].numpy() - starts
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
    if batch.total_rows and not bool(batch.valid.all()):
        covered_t &= batch.valid.cpu()[row_t]
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
    rows, num_layers, topk = src.shape
    nbytes = topk * src.element_size()
    word, word_dtype = next((w, dt) for w, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16),
                                                   (1, torch.uint8)) if nbytes % w == 0)
    words = src
    if word > src.element_size() and src.is_contiguous():
        try:
            words = src.view(rows, num_layers * topk).view(word_dtype).view(rows, num_layers, nbytes // word)
        except RuntimeError:       # storage offset not aligned to the word size: keep elements
            words = src
    first_col = cols[0]
    if cols == list(range(first_col, first_col + len(cols))):
        part = words[:, first_col:first_col + len(cols)].index_select(0, row)    # [T, nl, n]
    else:
        part = words.index_select(0, row).index_select(1, torch.tensor(cols, device=src.device))
    gathered = part.permute(1, 0, 2).contiguous()                         # [nl, T, n]
    if words is not src:
        gathered = gathered.view(torch.uint8).view(src.dtype).view(len(cols), row.numel(), topk)
    return gathered


def shard(batch: ReplayBatch, layout: ParallelLayout, seq_lens: Sequence[int], *, tp_rank: int = 0,
          cp_rank: int = 0, pp_rank: int = 0, vp_stage: int = 0, format: str = "thd",
          cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
          seq_length: int | None = None, device: torch.device | str | None = None,
          layer_ids: Sequence[int] | None = None) -> ShardedTargets:
    """Targets of rank (tp_rank, cp_rank, pp_rank, vp_stage) for the micro-batch ``batch``.

    Only this stage's layers are selected from the compact batch, then widened to int64 (on
    ``device``). ``layer_ids`` overrides the stage's MoE layers (the driver passes the layers of
    the routers it actually found).
    """
    check_readable(batch.routes, what="shard: batch routes", error=RouteShapeError)
    seq_lens = int64_tensor(seq_lens, "seq_lens", CoverageError)
    tp_rank, cp_rank, pp_rank, vp_stage = (as_index(v, what=name, error=LayoutError) for v, name in (
        (tp_rank, "tp_rank"), (cp_rank, "cp_rank"), (pp_rank, "pp_rank"), (vp_stage, "vp_stage")))
    if layer_ids is not None:
        layer_ids = as_index_list(layer_ids, what="layer_ids", error=LayerMappingError)
    if device is not None and torch.device(device).type == "meta":
        raise LayoutError("shard: device='meta' would hold no values (targets must be readable)")
    batch.check_seq_lens(seq_lens)
    plan = PackPlan.build(layout, seq_lens, format=format, cu_seqlens_padded=cu_seqlens_padded,
                          seq_length=seq_length)
    want = list(layout.moe_layers(pp_rank, vp_stage) if layer_ids is None else layer_ids)
    col_of = {lid: j for j, lid in enumerate(batch.layer_ids)}
    missing = [x for x in want if x not in col_of]
    if missing:
        raise LayerMappingError(
            f"rank (pp={pp_rank}, vp={vp_stage}) needs MoE layers {missing}, but the batch only has "
            f"layers {list(batch.layer_ids)}{shifted_layer_ids_hint(batch.layer_ids, layout.moe_layer_ids)}")
    if plan.format == "thd":
        row, valid = _thd_rows(batch, plan, layout, tp_rank, cp_rank)
    else:
        seq, pos = rank_positions(plan, layout, tp_rank, cp_rank)
        row, valid = _lookup(batch, seq, pos, plan.seq_lens)
    out_device = torch.device(device) if device is not None else batch.routes.device
    topk = batch.topk
    num_valid = int(valid.sum())        # valid is still on the host here
    if not want:
        return ShardedTargets({}, valid.to(out_device), (), topk, num_valid, None if batch.weights is None else {})
    src = batch.routes
    cols = [col_of[x] for x in want]
    # Gather the compact (uint8/int16) rows and layers first, transpose to [nl, T, K] while still
    # narrow, then widen to int64 in one contiguous pass (on ``out_device``).
    compact = _picked_rows(src, row, cols)
    out = torch.empty((len(want), row.numel(), topk), dtype=torch.int64, device=out_device)
    out.copy_(compact.to(out_device, non_blocking=True))
    invalid = (~valid).nonzero().squeeze(1)
    if invalid.numel():
        out[:, invalid.to(out_device)] = torch.arange(topk, dtype=torch.int64, device=out_device)
    weights = None if batch.weights is None else _shard_weights(batch.weights, row, invalid, cols, want, out_device)
    return ShardedTargets({lid: out[j] for j, lid in enumerate(want)}, valid.to(out_device), tuple(want), topk,
                          num_valid, weights)


def _picked_rows(src: torch.Tensor, row: torch.Tensor, cols: list[int]) -> torch.Tensor:
    """``src [rows, L, K]``'s rows ``row`` and layer columns ``cols``, layer-major ``[nl, T, K]``
    in ``src``'s dtype and device."""
    if src.shape[0] == 0:
        # No row at all (e.g. only 1-token sequences): every row is a filler; index_select on an
        # empty source raised even though row==0 is only a placeholder for uncovered rows.
        return torch.zeros((len(cols), row.numel(), src.shape[2]), dtype=src.dtype, device=src.device)
    return _gather_layer_major(src, row.to(src.device), cols)


def _shard_weights(weights: torch.Tensor, row: torch.Tensor, invalid: torch.Tensor, cols: list[int], want: list[int],
                   device: torch.device) -> dict[int, torch.Tensor]:
    """The weights of the rows and layers ``shard`` picked, by the same row map (so they follow
    their ids through packing, CP zigzag and the SP split): float32 ``[T_local, K]`` per layer,
    0 on the rows without a route (``invalid``, host indices)."""
    out = _picked_rows(weights, row, cols).to(device=device, dtype=torch.float32)
    if invalid.numel():
        out[:, invalid.to(device)] = 0
    return {lid: out[j] for j, lid in enumerate(want)}

"""One rank's router targets straight from the engine's per-sequence route arrays.

``rank_targets(items, layout, seq_lens, ...)`` equals
``shard(ReplayBatch.from_vllm(items, ...), layout, seq_lens, ...)`` (same :class:`ShardedTargets`,
same errors for what this rank reads) without the whole-batch ``ReplayBatch``: a rank reads only its
pipeline stage's MoE layers and its CP / SP share of the tokens, so at a production shape (TP4 x
CP2 x PP4) it touches about 1/30 of the batch's ids. The rank's rows are a few contiguous runs per
sequence (:func:`r3bridge.sharding.rank_positions`); each run is copied from the engine's own array
(a view) into a compact layer-major buffer in the schema dtype, range- and duplicate-checked block by block
while in cache (:mod:`r3bridge.route_scan`), then widened to int64 layer-major in one pass.

What is validated is what this rank reads: an id that is wrong in a row or layer this rank does
not use raises on the rank(s) that read it, with the same message (sequence, row, token, layer)
``ReplayBatch.from_vllm`` gives. Call it per micro-batch (the items of that micro-batch), as
``shard`` is called.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from r3bridge._validate import as_index, as_index_list, raise_findings
from r3bridge.batch_meta import check_coverage, checked_meta
from r3bridge.decoders import decode_vllm_routes, decode_vllm_weights, select_layers
from r3bridge.engine_pack import allocate, check_shapes, host_array, layer_columns
from r3bridge.errors import CoverageError, LayerMappingError, LayoutError, RouteShapeError, RouteWeightsError
from r3bridge.layer_ids import shifted_layer_ids_hint
from r3bridge.layout import ParallelLayout
from r3bridge.packing import PackPlan, rank_positions
from r3bridge.route_scan import block_rows, run_blocks, scan_block
from r3bridge.schema import route_dtype
from r3bridge.sharding import ShardedTargets

__all__ = ["rank_targets"]


def _host(a: Any) -> np.ndarray:
    h = host_array(a)
    if h is None:       # a device / odd tensor: one sequence to the host (never the batch)
        h = a.detach().cpu().numpy()
    return h


def rank_targets(items: Sequence[Any], layout: ParallelLayout, seq_lens: Sequence[int], *, num_experts: int,
                 moe_layer_ids: Sequence[int] | None = None, start_rows: Sequence[int] | None = None,
                 tp_rank: int = 0, cp_rank: int = 0, pp_rank: int = 0, vp_stage: int = 0, format: str = "thd",
                 cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None, seq_length: int | None = None,
                 device: torch.device | str | None = None,
                 layer_ids: Sequence[int] | None = None, weights: Sequence[Any] | None = None) -> ShardedTargets:
    """Targets of rank (tp_rank, cp_rank, pp_rank, vp_stage) for the micro-batch whose vLLM routes
    are ``items`` (any transport :func:`r3bridge.decoders.decode_vllm_routes` reads: arrays of
    ``[rows, num_hidden_layers, K]``); the arguments are those of ``ReplayBatch.from_vllm`` and
    :func:`r3bridge.shard`. ``weights``: optional routing weights, one array per item in its
    routes' shape (``ReplayBatch.from_vllm``'s ``weights``); the rank reads its rows of them too."""
    num_experts = as_index(num_experts, what="num_experts", error=RouteShapeError)
    moe = None if moe_layer_ids is None else as_index_list(moe_layer_ids, what="moe_layer_ids", error=LayerMappingError)
    starts_in = None if start_rows is None else as_index_list(start_rows, what="start_rows", error=CoverageError)
    tp_rank, cp_rank, pp_rank, vp_stage = (as_index(v, what=name, error=LayoutError) for v, name in (
        (tp_rank, "tp_rank"), (cp_rank, "cp_rank"), (pp_rank, "pp_rank"), (vp_stage, "vp_stage")))
    if layer_ids is not None:
        layer_ids = as_index_list(layer_ids, what="layer_ids", error=LayerMappingError)
    if device is not None and torch.device(device).type == "meta":
        raise LayoutError("rank_targets: device='meta' would hold no values (targets must be readable)")
    arrays = [_host(decode_vllm_routes(it, seq=i)) for i, it in enumerate(items)]
    for i, a in enumerate(arrays):          # shape and layer-range checks on empty views
        select_layers(a[:0], moe, i, "vLLM")
    if arrays:
        check_shapes([a[:0] if moe is None else a[:0][:, moe] for a in arrays])
    k = int(arrays[0].shape[2]) if arrays else 1
    batch_layers = moe if moe is not None else list(range(arrays[0].shape[1] if arrays else 0))
    rows = [int(a.shape[0]) for a in arrays]
    rows, batch_layers, k, num_experts, starts, _ = checked_meta(
        (sum(rows), len(batch_layers), k), rows, num_experts, batch_layers, starts_in, None)
    lens = as_index_list(seq_lens, what="seq_lens", error=CoverageError)
    check_coverage(starts, rows, lens)
    plan = PackPlan.build(layout, lens, format=format, cu_seqlens_padded=cu_seqlens_padded, seq_length=seq_length)
    want = list(layout.moe_layers(pp_rank, vp_stage) if layer_ids is None else layer_ids)
    present = set(batch_layers)
    missing = [x for x in want if x not in present]
    if missing:
        raise LayerMappingError(
            f"rank (pp={pp_rank}, vp={vp_stage}) needs MoE layers {missing}, but the batch only has "
            f"layers {list(batch_layers)}{shifted_layer_ids_hint(batch_layers, layout.moe_layer_ids)}")
    seq_t, pos_t = rank_positions(plan, layout, tp_rank, cp_rank)
    seq, pos = seq_t.numpy(), pos_t.numpy()
    t_rows = int(seq.shape[0])
    # engine column of layer ``lid``: ``lid`` itself when the engine reports every decoder layer
    # (moe_layer_ids given), else its position in the batch's layers (= lid as well: range(L))
    cols = [batch_layers.index(x) if moe is None else x for x in want]
    src_row, valid = _covered_rows(seq, pos, np.asarray(starts, dtype=np.int64),
                                   np.asarray(rows, dtype=np.int64), plan.seq_lens.numpy())
    dev = torch.device(device) if device is not None else torch.device("cpu")
    num_valid = int(valid.sum())
    valid_t = torch.from_numpy(valid)
    if weights is not None and len(weights) != len(arrays):
        raise RouteWeightsError(f"rank_targets: {len(weights)} weight arrays for {len(arrays)} sequences")
    if not want:
        return ShardedTargets({}, valid_t.to(dev), (), k, num_valid, None if weights is None else {})
    # layer-major from the start ([nl, T, K]: each run lands in its place with one strided copy), so
    # the widening to int64 is one contiguous pass (a permuting widen ran at ~1 GB/s)
    compact_t = allocate((len(want), t_rows, k), route_dtype(num_experts), what="rank_targets")
    _fill(compact_t.numpy().transpose(1, 0, 2), arrays, layer_columns(cols), seq, src_row, valid, starts, want,
          num_experts)
    out = allocate((len(want), t_rows, k), torch.int64, what="rank_targets int64 targets") if dev.type == "cpu" \
        else torch.empty((len(want), t_rows, k), dtype=torch.int64, device=dev)
    out.copy_(compact_t.to(dev, non_blocking=True))
    rank_weights = None if weights is None else _rank_weights(weights, arrays, cols, seq, src_row, valid, starts, want,
                                                              k, dev)
    return ShardedTargets({lid: out[j] for j, lid in enumerate(want)}, valid_t.to(dev), tuple(want), k, num_valid,
                          rank_weights)


def _rank_weights(weights: Sequence[Any], arrays: list[np.ndarray], cols: list[int], seq: np.ndarray,
                  src_row: np.ndarray, valid: np.ndarray, starts: Sequence[int], want: list[int], k: int,
                  dev: torch.device) -> dict[int, torch.Tensor]:
    """This rank's rows and layers of the per-sequence weights (float32 ``[T, K]`` per layer,
    rounded through the schema's float16 as ``shard`` of a batch gives them; 0 on rows without a
    route). Checked as the schema checks weights, on what this rank reads."""
    out = np.zeros((int(seq.shape[0]), len(want), k), dtype=np.float32)
    # this rank's routed rows grouped by sequence in one pass (not one scan of every row per sequence)
    routed = np.flatnonzero(valid)
    routed = routed[np.argsort(seq[routed], kind="stable")]
    bounds = np.searchsorted(seq[routed], np.arange(len(weights) + 1))
    for i, payload in enumerate(weights):
        w = decode_vllm_weights(payload, seq=i)
        if tuple(w.shape) != tuple(arrays[i].shape):
            raise RouteWeightsError(f"sequence {i}: weights have shape {tuple(w.shape)}, its routes "
                                    f"{tuple(arrays[i].shape)}")
        mine = routed[bounds[i]:bounds[i + 1]]
        if mine.size:
            out[mine] = w[src_row[mine]][:, cols]
    narrow = out.astype(np.float16)
    bad = (~np.isfinite(out) | (out < 0) | ~np.isfinite(narrow)).any(-1)
    if bad.any():
        r, col = (int(x) for x in np.argwhere(bad)[0])
        i, row = int(seq[r]), int(src_row[r])
        raise RouteWeightsError(f"sequence {i}, row {row} (token {starts[i] + row}), layer {want[col]}: weights "
                                f"{out[r, col].tolist()} must be finite, non-negative and within float16 range")
    layer_major = torch.from_numpy(narrow.transpose(1, 0, 2).copy()).to(dev, torch.float32)
    return {lid: layer_major[j] for j, lid in enumerate(want)}


def _covered_rows(seq: np.ndarray, pos: np.ndarray, starts: np.ndarray, rows: np.ndarray, seq_lens: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Row of each rank row in its sequence's engine array, and whether it has one (position in
    ``[start, min(start + rows, seq_len))``, as ``shard`` reads a batch)."""
    if seq.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    lo = starts[seq]
    hi = np.minimum(starts + rows, seq_lens)[seq]
    covered = (pos >= lo) & (pos < hi)
    return np.where(covered, pos - lo, 0), covered


def _fill(compact: np.ndarray, arrays: list[np.ndarray], cols, seq: np.ndarray, src_row: np.ndarray,
          valid: np.ndarray, starts: Sequence[int], want: list[int], num_experts: int) -> None:
    """Copy each run of consecutive source rows into ``compact`` ``[T, nl, K]`` (a transposed view
    of the layer-major buffer; checked block by block), fillers ``0..K-1`` into rows without a
    route."""
    t_rows, _, k = compact.shape
    if t_rows == 0:
        return
    brk = np.ones(t_rows, dtype=bool)
    brk[1:] = (seq[1:] != seq[:-1]) | (src_row[1:] != src_row[:-1] + 1) | (valid[1:] != valid[:-1])
    run_start = np.flatnonzero(brk)
    run_end = np.append(run_start[1:], t_rows)
    step = block_rows(compact.shape[1] * k)
    filler = np.arange(k, dtype=compact.dtype)
    # Engine arrays already in the schema dtype (vLLM's uint8): copy every run (one strided copy
    # each), then check the compact buffer in large blocks (few, long vectors: the sorting network
    # runs with little Python between its numpy calls, so the thread pool scales). Other dtypes:
    # check each run on its source before the narrowing copy (a wrap would hide a bad id).
    narrowing = any(a.dtype != compact.dtype for a in arrays)
    tasks, block_row0 = [], []
    for r0, r1 in zip(run_start.tolist(), run_end.tolist()):
        if not valid[r0]:
            compact[r0:r1] = filler
            continue
        i, s0 = int(seq[r0]), int(src_row[r0])
        view = arrays[i] if cols is None or not isinstance(cols, slice) else arrays[i][:, cols]
        if not narrowing:
            src = view[s0:s0 + r1 - r0]
            np.copyto(compact[r0:r1], src if isinstance(cols, slice) else src[:, cols])
            continue
        for b0 in range(r0, r1, step):
            b1 = min(r1, b0 + step)
            a0, a1 = s0 + b0 - r0, s0 + b1 - r0

            def task(view=view, a0=a0, a1=a1, b0=b0, b1=b1):
                src = view[a0:a1] if isinstance(cols, slice) else view[a0:a1][:, cols]
                return scan_block(src, num_experts, dst=compact[b0:b1])
            tasks.append(task)
            block_row0.append(b0)
    if not narrowing:       # fillers are distinct and in range: every row can be checked
        block_row0 = list(range(0, t_rows, step))
        tasks = [(lambda b0=b0: scan_block(compact[b0:b0 + step], num_experts)) for b0 in block_row0]
    findings = run_blocks(tasks)

    def where(r: int) -> tuple[int, int, int]:
        i, row = int(seq[r]), int(src_row[r])
        return i, row, starts[i] + row

    def values(r: int, col: int) -> list:
        return arrays[int(seq[r])][int(src_row[r])][cols][col].tolist()

    raise_findings(findings, block_row0, values, num_experts, want, where)

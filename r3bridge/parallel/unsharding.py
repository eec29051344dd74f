"""R2, the inverse of ``shard``: every rank's routes back into one per-sample
:class:`r3bridge.ReplayBatch`, either from per-rank :class:`r3bridge.parallel.targets.ShardedTargets`
(:func:`unshard`) or in one sweep out of the recorder's all-gather buffer
(:func:`assemble_gathered`, what the driver's R2 recorder uses). The row map: ``packing.py``.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from r3bridge._validate import as_index, check_readable
from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.errors import CoverageError, LayerMappingError, LayoutError, ReplayStateError, RouteShapeError
from r3bridge.parallel.id_words import as_words
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.packing import PackPlan, int64_tensor, rank_positions, rank_rows, token_owners
from r3bridge.parallel.targets import ShardedTargets

__all__ = ["RankKey", "unshard", "assemble_gathered"]

RankKey = tuple[int, int, int, int]  # (tp_rank, cp_rank, pp_rank, vp_stage)


def _layer_major(rank_targets: ShardedTargets, lids: list[int], device: torch.device) -> torch.Tensor:
    """``[nl, rows, K]`` of a rank's layers on ``device``; a view, not a copy, when the per-layer
    tensors are consecutive slices of one buffer there (what ``shard`` and the R2 recorder
    produce)."""
    parts = [rank_targets.indices[lid] for lid in lids]
    first = parts[0]
    stride = first.numel()
    if first.device == device and all(
            p.is_contiguous() and p.shape == first.shape and p.dtype == first.dtype
            and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and p.storage_offset() == first.storage_offset() + j * stride for j, p in enumerate(parts)):
        return first.as_strided((len(parts), *first.shape), (stride, first.shape[1], 1))
    return torch.stack([p.to(device) for p in parts], 0)


def _dedupe_sp_off(targets: Mapping[RankKey, ShardedTargets], layout: ParallelLayout
                   ) -> dict[RankKey, ShardedTargets]:
    """SP off: every TP rank routed the same rows. Check they agree, keep the lowest TP rank."""
    if layout.sp_split != 1 or layout.tp == 1:
        return dict(targets)
    keep: dict[tuple[int, int, int], tuple[RankKey, ShardedTargets]] = {}
    for key, rank_targets in sorted(targets.items()):
        other = keep.setdefault(key[1:], (key, rank_targets))
        if other[0] is key:
            continue
        ref = other[1]
        for lid, idx in rank_targets.indices.items():
            if lid not in ref.indices or not torch.equal(ref.indices[lid], idx.to(ref.indices[lid].device)):
                raise ReplayStateError(f"unshard: TP ranks {other[0][0]} and {key[0]} disagree on layer {lid} "
                                       f"(cp={key[1]}, pp={key[2]}, vp={key[3]}) although SP is off")
    return {key: rank_targets for key, rank_targets in keep.values()}


def unshard(targets: Mapping[RankKey, ShardedTargets], layout: ParallelLayout,
            seq_lens: Sequence[int], *, num_experts: int, format: str = "thd",
            cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
            seq_length: int | None = None, start_rows: Sequence[int] | None = None,
            rows_per_seq: Sequence[int] | None = None, route_kind: str = "recorded") -> ReplayBatch:
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
    num_seqs = plan.num_seqs
    starts = torch.zeros(num_seqs, dtype=torch.int64) if start_rows is None else int64_tensor(start_rows, "start_rows", CoverageError)
    rows = plan.seq_lens - starts if rows_per_seq is None else int64_tensor(rows_per_seq, "rows_per_seq", CoverageError)
    if starts.shape != (num_seqs,) or rows.shape != (num_seqs,):
        raise CoverageError(f"unshard: start_rows / rows_per_seq need {num_seqs} entries (one per sequence), got "
                            f"{starts.numel()} / {rows.numel()}")
    for key, rank_targets in targets.items():
        if len(key) != 4:
            raise LayoutError(f"unshard: target key {key!r} must be (tp_rank, cp_rank, pp_rank, vp_stage)")
        for name, v in zip(("tp_rank", "cp_rank", "pp_rank", "vp_stage"), key):
            as_index(v, what=f"unshard: target key {key!r} {name}", error=LayoutError)
        for lid, ids in rank_targets.indices.items():
            check_readable(ids, what=f"unshard: rank {key} layer {lid} ids", error=ReplayStateError)
    if num_seqs and (bool((starts < 0).any()) or bool((starts + rows > plan.seq_lens).any()) or bool((rows < 0).any())):
        raise CoverageError("unshard: start_rows/rows_per_seq do not fit seq_lens")
    layer_ids = sorted({lid for rank_targets in targets.values() for lid in rank_targets.layer_ids})
    need = layout.moe_layer_ids
    if layer_ids != need:
        raise LayerMappingError(f"unshard: targets hold MoE layers {layer_ids}, the layout has {need} "
                                f"(a pipeline stage's targets are missing?)")
    topk = next((rank_targets.topk for rank_targets in targets.values()), 1)
    offsets = torch.zeros(num_seqs + 1, dtype=torch.int64)
    if num_seqs:
        offsets[1:] = torch.cumsum(rows, 0)
    total = int(offsets[-1])
    col_of = {lid: j for j, lid in enumerate(layer_ids)}
    dtype = route_dtype(num_experts)
    device = next((ids.device for rank_targets in targets.values() for ids in rank_targets.indices.values()),
                  torch.device("cpu"))
    out = torch.zeros((total, len(layer_ids), topk), dtype=dtype, device=device)
    out_words = as_words(out)                  # [total, L, w]: the K ids of a (row, layer) as words
    written = torch.zeros(len(layer_ids), dtype=torch.int64)
    valid = torch.zeros(total, dtype=torch.bool)
    for (tp_rank, cp_rank, pp_rank, vp_stage), rank_targets in sorted(_dedupe_sp_off(targets, layout).items()):
        seq, pos = rank_positions(plan, layout, tp_rank, cp_rank)
        if seq.numel() != rank_targets.num_rows:
            raise ReplayStateError(f"unshard: rank (tp={tp_rank}, cp={cp_rank}, pp={pp_rank}, vp={vp_stage}) "
                                   f"has {rank_targets.num_rows} rows, the plan gives it {seq.numel()}")
        rel = pos - starts[seq]
        keep = ((rel >= 0) & (rel < rows[seq])).nonzero().squeeze(1)
        dst = (offsets[seq] + rel).index_select(0, keep)
        valid[dst] |= rank_targets.valid.cpu().index_select(0, keep)
        if not rank_targets.indices:
            continue
        lids = list(rank_targets.indices)
        cols = [col_of[lid] for lid in lids]
        stacked = _layer_major(rank_targets, lids, device)                         # [nl, rows, K]
        if stacked.numel():
            lo, hi = torch.aminmax(stacked)
            if int(lo) < 0 or int(hi) >= num_experts:
                raise ReplayStateError(f"unshard: rank (tp={tp_rank}, cp={cp_rank}, pp={pp_rank}, vp={vp_stage}) "
                                       f"holds expert ids outside [0, {num_experts})")
        ids = stacked.to(dtype)
        src = as_words(ids)
        if src.shape[-1] != out_words.shape[-1]:
            # a view into a gathered buffer that starts mid-word (R2: a later micro-batch or rank
            # of an int16/int32 payload): an aligned copy takes the same word view as ``out``
            src = as_words(ids.clone())
        src = src.transpose(0, 1)                                                   # [rows, nl, w]
        everything = keep.numel() == rank_targets.num_rows and bool((dst == torch.arange(total)).all()) \
            if dst.numel() == total else False
        if cols == list(range(cols[0], cols[0] + len(cols))):
            target = out_words[:, cols[0]:cols[0] + len(cols)]
            if everything:          # tp = cp = 1, full coverage: a plain (transposing) copy
                target.copy_(src)
            else:
                target.index_copy_(0, dst.to(device), src.index_select(0, keep.to(device)))
        else:
            out_words[dst.to(device)[:, None], torch.tensor(cols, device=device)[None, :]] = src.index_select(0, keep.to(device))
        written[cols] += dst.numel()
    short = (written != total).nonzero()
    if short.numel():
        j = int(short[0])
        raise CoverageError(f"unshard: layer {layer_ids[j]} has {int(written[j])} of {total} rows: a rank's "
                            f"targets are missing or overlap")
    # The ids come from shard() of a validated batch or from the router's own top-k: distinct by
    # construction, so only the schema is rebuilt (the O(rows*L*K log K) duplicate scan is skipped).
    batch = ReplayBatch.from_trusted(out, rows.tolist(), starts.tolist(), valid.to(device), tuple(layer_ids),
                                     num_experts, route_kind)
    weights = _unshard_weights(_dedupe_sp_off(targets, layout), plan, layout, starts, rows, offsets, col_of, device)
    return batch if weights is None else batch.with_weights(weights)


def _unshard_weights(targets: Mapping[RankKey, ShardedTargets], plan: PackPlan, layout: ParallelLayout,
                     starts: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, col_of: dict[int, int],
                     device: torch.device) -> torch.Tensor | None:
    """The ranks' routing weights scattered back by the same row map as their ids (None when no
    rank has weights; some ranks with and some without raise)."""
    have = {key: t.weights is not None for key, t in targets.items()}
    if not any(have.values()):
        return None
    if not all(have.values()):
        missing = sorted(key for key, h in have.items() if not h)
        raise ReplayStateError(f"unshard: ranks {missing} carry no routing weights, other ranks do")
    topk = next(t.topk for t in targets.values())
    out = torch.zeros((int(offsets[-1]), len(col_of), topk), dtype=torch.float32, device=device)
    for (tp_rank, cp_rank, _, _), rank_targets in targets.items():
        seq, pos = rank_positions(plan, layout, tp_rank, cp_rank)
        rel = pos - starts[seq]
        keep = ((rel >= 0) & (rel < rows[seq])).nonzero().squeeze(1)
        dst = (offsets[seq] + rel).index_select(0, keep).to(device)
        for lid, w in rank_targets.weights.items():  # type: ignore[union-attr]
            out[dst, col_of[lid]] = w.to(device=device, dtype=torch.float32).index_select(0, keep.to(w.device))
    return out


def assemble_gathered(flat: torch.Tensor, layout: ParallelLayout, plans: Sequence[PackPlan], sample_ids: Sequence[int],
                      *, num_experts: int, topk: int, route_kind: str = "recorded", method: str = "auto") -> ReplayBatch:
    """Per-sample routes out of the R2 gather buffer, in one sweep over all micro-batches.

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
    topk = int(topk)
    dtype = route_dtype(num_experts)
    tp_parts = layout.tp if layout.sequence_parallel else 1
    ranks = layout.cp * tp_parts
    chunks = [(p, v, layout.moe_layers(p, v)) for p in range(layout.pp) for v in range(layout.vp_size)]
    # MoE layers per pipeline stage: the width of a source row of that stage, in rows of K ids
    stage_width = [sum(len(layers) for stage, _, layers in chunks if stage == p) for p in range(layout.pp)]
    rows = [int(rank_rows(plan, layout)) for plan in plans]
    if flat.numel() % (layout.pp * ranks * topk):
        raise ReplayStateError(f"gathered buffer of {flat.numel()} ids does not split into {layout.pp} stages x "
                               f"{ranks} ranks x top-{topk}")
    part_rows = flat.numel() // (layout.pp * ranks * topk)          # one rank's part, in rows of K ids
    need = max((sum(rows) * layer_count for layer_count in stage_width), default=0)
    if part_rows < need:
        raise ReplayStateError(f"gathered rank parts hold {part_rows} rows of ids, the micro-batches need {need}")
    if len(set(sample_ids)) != len(sample_ids):
        raise ReplayStateError(f"duplicate sample_ids across micro-batches: {list(sample_ids)}")
    owner, mb_of, lens = [], [], []
    for m, plan in enumerate(plans):
        rank, row = token_owners(plan, layout, tp_parts)
        split = plan.seq_lens.tolist()
        owner += list((rank * part_rows + row).split(split))
        mb_of += [m] * plan.num_seqs
        lens += split
    if len(sample_ids) != len(lens):
        raise CoverageError(f"{len(sample_ids)} sample_ids for {len(lens)} sequences")
    order = sorted(range(len(lens)), key=lambda i: sample_ids[i])
    lens_out = [lens[i] for i in order]
    n_out = sum(lens_out)
    lids = layout.moe_layer_ids
    col = {lid: j for j, lid in enumerate(lids)}
    ids = flat.view(-1, topk)
    words = as_words(ids) if ids.is_contiguous() else ids   # a (row, layer)'s K ids as one word
    out = torch.empty((n_out, len(lids), words.shape[1]), dtype=words.dtype, device=flat.device)
    src = torch.cat([owner[i] for i in order]) if order else torch.zeros(0, dtype=torch.int64)
    src_mb = torch.tensor([mb_of[i] for i in order], dtype=torch.int64).repeat_interleave(
        torch.tensor(lens_out, dtype=torch.int64), output_size=n_out)
    before = [[sum(rows[:m]) * stage_width[p] for m in range(len(plans))] for p in range(layout.pp)]
    # runs of output rows whose source rows are consecutive in one rank's part of one micro-batch
    brk = torch.ones(n_out, dtype=torch.bool)
    if n_out > 1:
        brk[1:] = ((src[1:] != src[:-1] + 1) | (src_mb[1:] != src_mb[:-1])
                   | (src[1:] // part_rows != src[:-1] // part_rows))
    starts = brk.nonzero().squeeze(1)
    copies = starts.numel() * sum(1 for c in chunks if c[2])
    if method == "auto":
        method = "runs" if copies <= 64 else "index"
    if method == "runs":
        ends = torch.cat([starts[1:], torch.tensor([n_out])]).tolist()
        for run_start, run_end in zip(starts.tolist(), ends):
            first_src, m = int(src[run_start]), int(src_mb[run_start])
            rank, first_row = divmod(first_src, part_rows)
            layer_in_stage = 0
            for p, v, chunk_layers in chunks:
                if v == 0:
                    layer_in_stage = 0
                if not chunk_layers:
                    continue
                width = stage_width[p]
                base = (p * ranks + rank) * part_rows + before[p][m]
                run_len = run_end - run_start
                block = words[base + first_row * width: base + (first_row + run_len) * width].view(run_len, width, -1)
                first_col = col[chunk_layers[0]]
                out[run_start:run_end, first_col: first_col + len(chunk_layers)].copy_(
                    block[:, layer_in_stage: layer_in_stage + len(chunk_layers)])
                layer_in_stage += len(chunk_layers)
    elif method == "index":
        part = torch.empty((len(plans), len(lids)), dtype=torch.int64)
        stride = torch.empty(len(lids), dtype=torch.int64)      # words per source row of the layer's stage
        for p, v, chunk_layers in chunks:
            q0 = sum(len(c) for pp_, vv, c in chunks if pp_ == p and vv < v)
            for qi, lid in enumerate(chunk_layers):
                stride[col[lid]] = stage_width[p]
                for m in range(len(plans)):
                    part[m, col[lid]] = p * ranks * part_rows + before[p][m] + q0 + qi
        device = flat.device
        rank, row = (src // part_rows).to(device), (src % part_rows).to(device) if part_rows else src.to(device)
        index = (part.to(device).index_select(0, src_mb.to(device)) + (rank * part_rows)[:, None]
                 + row[:, None] * stride.to(device))
        torch.index_select(words, 0, index.view(-1), out=out.view(-1, words.shape[1]))
    else:
        raise LayoutError(f"assemble_gathered: unknown method {method!r} (use 'auto', 'runs' or 'index')")
    routes = out.view(torch.uint8).view(dtype).view(n_out, len(lids), topk)
    # The ids are the routers' own top-k narrowed to a dtype that holds num_experts: distinct and
    # in range by construction, so only the schema is rebuilt (as in unshard).
    return ReplayBatch.from_trusted(routes, lens_out, [0] * len(lens_out), torch.ones(n_out, dtype=torch.bool),
                                tuple(lids), num_experts, route_kind)

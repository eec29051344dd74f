"""R2: gather the routes recorded in a forward-only pass into per-sample routes.

Tensor collectives only (a peer's R2 gather pickles CPU tensors through ``all_gather_object``,
docs/benchmarks.md P4). Every rank can compute every peer's payload size from the layout and the
micro-batches' ``seq_lens``, so no size exchange is needed:

1. TP all-gather (only with sequence parallel: otherwise every TP rank routed every row),
2. CP all-gather,
3. PP all-gather, each stage's payload padded to the largest (stages hold different numbers of
   MoE layers; a stage with none sends only padding).

Each rank then reads the whole batch out of the gathered buffer in one pass
(:func:`r3bridge.parallel.unsharding.assemble_gathered`): one plan over all micro-batches (which rank and row
holds each token, once per micro-batch, never per stage), then a few transposing copies or one
gather on the device the ids were gathered on, straight into per-sample order. The result is a host ReplayBatch of route kind
"recorded", one row per token, sequences sorted by ``sample_ids`` so the update micro-batches can
be re-partitioned freely.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.errors import ReplayStateError
from r3bridge.megatron.installed import InstalledMicroBatch
from r3bridge.parallel.id_words import as_words
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.packing import PackPlan, token_owners
from r3bridge.parallel.unsharding import assemble_gathered


def _all_gather(buf: torch.Tensor, group, size: int) -> torch.Tensor:
    """``size`` copies of ``buf`` (one per rank), concatenated in rank order, in one tensor."""
    import torch.distributed as dist

    if size == 1:
        return buf
    # Neither NCCL nor gloo all-gathers int16 ("Short" is refused): the ids travel as their bytes
    raw = buf.view(torch.uint8)
    out = torch.empty(size * raw.numel(), dtype=torch.uint8, device=raw.device)
    dist.all_gather(list(out.chunk(size)), raw, group=group)     # written in place: no concat
    return out.view(buf.dtype)


def gather_recorded(records: Sequence[InstalledMicroBatch], *, layout: ParallelLayout,
                    chunk_layer_ids: Sequence[Sequence[int]], pp_rank: int, groups: Mapping[str, Any],
                    num_experts: int, topk: int, device: torch.device) -> ReplayBatch:
    """The per-sample routes that every rank recorded in ``records`` (this rank's finished
    (chunk, micro-batch) records of one RECORD pass).

    ``chunk_layer_ids[c]``: the MoE layers whose routers chunk ``c`` of this rank holds;
    ``groups``: the ``"tp"`` / ``"cp"`` / ``"pp"`` process groups (absent: a size-1 dimension);
    ``device``: where the ids are gathered (NCCL refuses CPU tensors)."""
    dtype = route_dtype(num_experts)
    by_index: dict[int, list[InstalledMicroBatch]] = {}
    for mb in records:
        by_index.setdefault(mb.index, []).append(mb)
    indices = sorted(by_index)
    if indices != list(range(len(indices))):
        raise ReplayStateError(f"recorded micro-batches {indices} are not contiguous")
    # All chunks of a rank see the same micro-batches with the same metadata.
    metas = []
    for m in indices:
        mbs = sorted(by_index[m], key=lambda x: x.chunk)
        if len(mbs) != len(chunk_layer_ids):
            raise ReplayStateError(f"micro-batch {m} was recorded by {len(mbs)} of {len(chunk_layer_ids)} chunks")
        metas.append(mbs)
    if not metas:
        raise ReplayStateError("R2 record pass recorded no micro-batch")
    rows = [mbs[0].rows for mbs in metas]            # every TP/CP rank routes as many rows
    stage = [[lid for v in range(layout.vp_size) for lid in layout.moe_layers(p, v)] for p in range(layout.pp)]
    payload_len = [sum(rows) * len(lids) * topk for lids in stage]

    # local payload, token-major: for each micro-batch [rows, this stage's layers (chunk by chunk), K],
    # stacked straight into the send buffer (each rank transposes only its own share)
    n_local = payload_len[pp_rank]
    max_len = max(payload_len)
    padded = torch.empty(max_len, dtype=dtype, device=device)
    padded[n_local:].zero_()                         # a stage with fewer layers pads its part
    off = 0
    for m, mbs in enumerate(metas):
        layers = [mb.recorded.get(lid) for mb in mbs for lid in chunk_layer_ids[mb.chunk]]
        if any(x is None or x.shape != (rows[m], topk) for x in layers):
            raise ReplayStateError(f"micro-batch {m}: a router's recorded ids are missing or not [{rows[m]}, {topk}]")
        n = rows[m] * len(layers) * topk
        if off + n > n_local:
            raise ReplayStateError(f"recorded payload exceeds the {n_local} ids the layout gives this stage")
        if layers:
            dst = padded[off:off + n].view(rows[m], len(layers), topk)
            # as machine words (a row's K ids in one int64 for top-8 uint8): 8x fewer elements
            src_w, dst_w = [as_words(x.contiguous()) for x in layers], as_words(dst)
            if all(x.shape[-1] == dst_w.shape[-1] for x in src_w):
                torch.stack(src_w, 1, out=dst_w)
            else:
                torch.stack(layers, 1, out=dst)
        off += n
    if off != n_local:
        raise ReplayStateError(f"recorded payload has {off} ids, expected {n_local}")
    tp_n = layout.tp if layout.sequence_parallel else 1
    flat = _all_gather(padded, groups.get("tp"), tp_n)
    flat = _all_gather(flat, groups.get("cp"), layout.cp)
    flat = _all_gather(flat, groups.get("pp"), layout.pp)
    # flat = [pp][cp][tp][max_len ids]; a rank's part = [micro-batch][rows][its stage's layers][K]

    plans = [PackPlan.build(layout, mbs[0].seq_lens, **mbs[0].pack) for mbs in metas]
    batch = assemble_gathered(flat, layout, plans, [s for mbs in metas for s in mbs[0].sample_ids],
                              num_experts=num_experts, topk=topk)
    # the per-sample batch goes back to the trainer's samples on the host, in one copy of the
    # compact routes
    return ReplayBatch(_to_host(batch.routes), batch.valid, batch.rows_per_seq, batch.start_rows, batch.layer_ids,
                       batch.num_experts, batch.topk, "recorded", None)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Device -> page-locked host memory: about twice as fast as a pageable copy, and torch's
    caching host allocator reuses the buffer from one R2 record pass to the next."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


def gather_recorded_weights(records: Sequence[InstalledMicroBatch], *, layout: ParallelLayout,
                            chunk_layer_ids: Sequence[Sequence[int]], pp_rank: int, groups: Mapping[str, Any],
                            topk: int, device: torch.device) -> torch.Tensor:
    """The combine weights recorded next to the ids of ``records`` (``record_weights``): float32
    ``[rows, L, K]`` aligned row for row with :func:`gather_recorded`'s batch (every token of every
    sequence, sequences sorted by sample id, every MoE layer of the layout).

    The same three all-gathers as the ids (TP under SP, CP, PP with each stage's part padded to the
    largest), as float32 on every rank (a stage without MoE layers recorded nothing to read a dtype
    from, and the ranks' byte counts must agree); each token's row is then read where
    :func:`token_owners` says its rank holds it (the inverse of the rank split, as the ids'
    assembly reads it)."""
    by_index: dict[int, list[InstalledMicroBatch]] = {}
    for mb in records:
        by_index.setdefault(mb.index, []).append(mb)
    metas = [sorted(by_index[m], key=lambda x: x.chunk) for m in sorted(by_index)]
    rows = [mbs[0].rows for mbs in metas]
    stage = [[lid for v in range(layout.vp_size) for lid in layout.moe_layers(p, v)] for p in range(layout.pp)]
    width = [len(lids) for lids in stage]
    part_len = max(sum(rows) * w * topk for w in width)
    local = torch.zeros(part_len, dtype=torch.float32, device=device)
    off = 0
    for m, mbs in enumerate(metas):
        layers = [mb.recorded_weights.get(lid) for mb in mbs for lid in chunk_layer_ids[mb.chunk]]
        missing = [lid for mb in mbs for lid in chunk_layer_ids[mb.chunk] if mb.recorded_weights.get(lid) is None]
        if missing or any(x.shape != (rows[m], topk) for x in layers):
            raise ReplayStateError(f"micro-batch {m}: the combine weights of layers {missing or 'all'} were not "
                                   f"recorded as [{rows[m]}, {topk}] (the router's forward hook did not run?)")
        if layers:
            n = rows[m] * len(layers) * topk
            local[off:off + n].view(rows[m], len(layers), topk).copy_(torch.stack(layers, 1))
            off += n
    tp_n = layout.tp if layout.sequence_parallel else 1
    flat = _all_gather(local, groups.get("tp"), tp_n)
    flat = _all_gather(flat, groups.get("cp"), layout.cp)
    flat = _all_gather(flat, groups.get("pp"), layout.pp)
    # flat = [pp][cp][tp'][part_len]; a rank's part = [micro-batch][rows][its stage's layers][K]
    ranks = layout.cp * tp_n
    parts = flat.view(layout.pp, ranks, part_len)
    col = {lid: j for j, lid in enumerate(layout.moe_layer_ids)}
    per_seq: list[tuple[int, torch.Tensor]] = []
    before = 0
    for m, mbs in enumerate(metas):
        plan = PackPlan.build(layout, mbs[0].seq_lens, **mbs[0].pack)
        rank, row = (t.to(device) for t in token_owners(plan, layout, tp_n))
        out = torch.zeros((int(rank.numel()), len(col), topk), dtype=torch.float32, device=device)
        for p in range(layout.pp):
            if not width[p]:
                continue
            n = sum(rows) * width[p] * topk
            block = parts[p, :, :n].view(ranks, sum(rows), width[p], topk)
            out[:, [col[lid] for lid in stage[p]]] = block[rank, before + row]
        before += rows[m]
        for sid, piece in zip(mbs[0].sample_ids, out.split(plan.seq_lens.tolist())):
            per_seq.append((int(sid), piece))
    per_seq.sort(key=lambda x: x[0])
    if not per_seq:
        return torch.zeros((0, len(col), topk), dtype=torch.float32)
    return _to_host(torch.cat([w for _, w in per_seq]))


def with_recorded_weights(batch: ReplayBatch, weights: torch.Tensor) -> ReplayBatch:
    """``batch`` (:func:`gather_recorded`'s) with the combine weights recorded next to its ids,
    kept float32: they are the router's own final weights (finite, non-negative by construction,
    so not validated again), and the update that replays them in this process gives its tokens
    exactly the weights compute_log_prob gave them (the schema's float16, what ``to_bytes`` and
    engines' weights carry, would move an fp32 router's by up to 2**-11)."""
    if tuple(weights.shape) != tuple(batch.routes.shape):
        raise ReplayStateError(f"recorded weights {tuple(weights.shape)} do not fit the recorded routes "
                               f"{tuple(batch.routes.shape)}")
    return dataclasses.replace(batch, weights=weights.to(device=batch.routes.device, dtype=torch.float32))

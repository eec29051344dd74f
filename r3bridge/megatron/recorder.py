"""R2: gather the routes recorded in a forward-only pass into per-sample routes.

Tensor collectives only (verl's ``pp_gather`` pickles CPU tensors through ``all_gather_object``,
docs/benchmarks.md P4). Every rank can compute every peer's payload size from the layout and the
micro-batches' ``seq_lens``, so no size exchange is needed:

1. TP all-gather (only with sequence parallel: otherwise every TP rank routed every row),
2. CP all-gather,
3. PP all-gather, each stage's payload padded to the largest (stages hold different numbers of
   MoE layers; a stage with none sends only padding).

Each rank then rebuilds per-rank targets and calls :func:`r3bridge.unshard`, the exact inverse of
the rank distribution, on the device the ids were gathered on. The result is a host ReplayBatch
with source "recorded", one row per token, sequences sorted by ``sample_ids`` so the update
micro-batches can be re-partitioned freely.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from r3bridge.errors import ReplayStateError
from r3bridge.schema import ReplayBatch, route_dtype
from r3bridge.sharding import PackPlan, ShardedTargets, rank_positions, unshard

if TYPE_CHECKING:  # pragma: no cover
    from r3bridge.megatron.replayer import Replayer
    from r3bridge.megatron.step import MicroBatch


def _all_gather(buf: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    if size == 1:
        return [buf]
    # Neither NCCL nor gloo all-gathers int16 ("Short" is refused): the ids travel as their bytes
    raw = buf.view(torch.uint8)
    out = [torch.empty_like(raw) for _ in range(size)]
    dist.all_gather(out, raw, group=group)
    return [o.view(buf.dtype) for o in out]


def gather_recorded(rep: "Replayer", records: list["MicroBatch"]) -> ReplayBatch:
    layout, k = rep.layout, rep.topk
    dtype = route_dtype(rep.num_experts)
    by_index: dict[int, list[MicroBatch]] = {}
    for mb in records:
        by_index.setdefault(mb.index, []).append(mb)
    indices = sorted(by_index)
    if indices != list(range(len(indices))):
        raise ReplayStateError(f"recorded micro-batches {indices} are not contiguous")
    # All chunks of a rank see the same micro-batches with the same metadata.
    metas = []
    for m in indices:
        mbs = sorted(by_index[m], key=lambda x: x.chunk)
        if len(mbs) != len(rep.chunks):
            raise ReplayStateError(f"micro-batch {m} was recorded by {len(mbs)} of {len(rep.chunks)} chunks")
        metas.append(mbs)
    rows = [mbs[0].rows for mbs in metas]

    def stage_layers(pp_rank: int) -> list[list[int]]:
        return [layout.moe_layers(pp_rank, v) for v in range(layout.vp_size)]

    def payload_len(pp_rank: int) -> int:
        nl = sum(len(x) for x in stage_layers(pp_rank))
        return sum(rows) * nl * k

    # local payload: for each micro-batch, each chunk, each layer: [rows, K]
    parts = [mb.recorded[lid].reshape(-1) for mbs in metas for mb in mbs for lid in rep.chunks[mb.chunk].layer_ids]
    local = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=rep.device)
    if local.numel() != payload_len(rep.pp_rank):
        raise ReplayStateError(f"recorded payload has {local.numel()} ids, expected {payload_len(rep.pp_rank)}")
    max_len = max(payload_len(p) for p in range(layout.pp))
    padded = torch.zeros(max_len, dtype=dtype, device=rep.device)
    padded[: local.numel()] = local
    tp_n = layout.tp if layout.sequence_parallel else 1
    tp_parts = _all_gather(padded, rep.groups.get("tp"), tp_n)
    cp_parts = _all_gather(torch.cat(tp_parts), rep.groups.get("cp"), layout.cp)
    pp_parts = _all_gather(torch.cat(cp_parts), rep.groups.get("pp"), layout.pp)

    batches = []
    sample_ids: list[int] = []
    for mi, mbs in enumerate(metas):
        meta = mbs[0]
        targets: dict[tuple[int, int, int, int], ShardedTargets] = {}
        plan = PackPlan.build(layout, meta.seq_lens, **meta.pack)
        for p in range(layout.pp):
            cp_chunks = pp_parts[p].split(max_len * tp_n)
            for cr in range(layout.cp):
                tp_chunks = cp_chunks[cr].split(max_len)
                for tr in range(tp_n):
                    n_rows = int(rank_positions(plan, layout, tr, cr)[0].numel())
                    buf = tp_chunks[tr]
                    off = 0
                    for mj in range(mi):      # skip earlier micro-batches of this rank's payload
                        off += rows[mj] * sum(len(x) for x in stage_layers(p)) * k
                    for v, lids in enumerate(stage_layers(p)):
                        ind = {}
                        for lid in lids:
                            ind[lid] = buf[off: off + n_rows * k].view(n_rows, k)   # stays compact
                            off += n_rows * k
                        targets[(tr, cr, p, v)] = ShardedTargets(ind, torch.ones(n_rows, dtype=torch.bool), tuple(lids), k)
        batches.append(unshard(targets, layout, meta.seq_lens, num_experts=rep.num_experts, **meta.pack))
        sample_ids.extend(meta.sample_ids)
    if not batches:
        raise ReplayStateError("R2 record step recorded no micro-batch")
    if len(set(sample_ids)) != len(sample_ids):
        raise ReplayStateError(f"duplicate sample_ids across micro-batches: {sample_ids}")
    out = batches[0] if len(batches) == 1 else ReplayBatch.concat(batches)
    order = sorted(range(len(sample_ids)), key=lambda i: sample_ids[i])
    if order != list(range(len(order))):
        out = out.select(order)
    # unshard ran where the ids were gathered (the GPU under NCCL); the per-sample batch goes
    # back to the trainer's samples on the host, in one copy of the compact routes
    return ReplayBatch(_to_host(out.routes), out.valid.cpu(), out.rows_per_seq, out.start_rows, out.layer_ids,
                       out.num_experts, out.topk, "recorded", out.policy_versions)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Device -> page-locked host memory: about twice as fast as a pageable copy, and torch's
    caching host allocator reuses the buffer from one R2 step to the next."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host

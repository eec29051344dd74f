"""Read at the rank: one micro-batch's route handles -> this rank's targets, reading only this
rank's token rows of its stage's layers, every byte read checked against its digest.

The rows come from the rank's row map (:class:`r3bridge.parallel.rank_rows.RankRows`, the one
reader's plan: THD / BSHD packing, CP zigzag, SP split); the layers are the stage's. Each handle is
opened once (its digest table checked against the handle's digest), the digest blocks holding the
rank's rows of the stage's layers are read (layer-major: one contiguous run per layer and row run)
and checked, and :func:`r3bridge.parallel.read.read_targets` makes the targets, the same function
that reads every other route: ids checked where they go, fillers where there is no route, int64.
Rows past a handle's stored rows (an untracked tail, an aborted sample) have no route.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from r3bridge import HandedRoutes, ParallelLayout, ShardedTargets
from r3bridge.errors import CoverageError, LayerMappingError, RouteShapeError
from r3bridge.handles.backends import RouteResolver
from r3bridge.handles.handle import RouteHandle, RouteHandleError, block_crc, table_digest
from r3bridge.parallel.rank_rows import RankRows
from r3bridge.parallel.read import read_targets

__all__ = ["HandleReads", "resolve", "read_rank_targets"]


@dataclass
class HandleReads:
    """What reads through handles moved: ``bytes_read`` (route bytes read from stores: whole
    digest blocks of the rows and layers asked for), ``table_bytes`` (digest tables),
    ``bytes_whole`` (the same handles' whole routes: what moving the whole field would move)."""

    handles: int = 0
    bytes_read: int = 0
    table_bytes: int = 0
    bytes_whole: int = 0

    def as_dict(self) -> dict:
        return {"handles": self.handles, "bytes_read": self.bytes_read, "table_bytes": self.table_bytes,
                "bytes_whole": self.bytes_whole}


class _Opened:
    """One handle, opened through its store's resolver, its digest table checked."""

    def __init__(self, handle: RouteHandle, resolvers: Mapping[str, RouteResolver], stats: Optional[HandleReads]):
        resolver = resolvers.get(handle.store)
        if resolver is None:
            raise RouteHandleError(f"{handle.where()}: no resolver for store {handle.store!r} (this reader has "
                                   f"{sorted(resolvers)})")
        self.handle, self.stats = handle, stats
        try:
            self.opened = resolver.open(handle)
        except OSError as e:
            raise RouteHandleError(f"{handle.where()}: cannot open its routes ({e})") from e
        table = np.asarray(self.opened.table)
        if table.shape != (handle.num_layers, handle.num_blocks) or table_digest(table) != handle.digest:
            raise RouteHandleError(f"{handle.where()}: its digest table does not match the handle's digest (the "
                                   f"stored routes were changed or replaced)")
        self.table = table
        if stats is not None:
            stats.handles += 1
            stats.table_bytes += table.nbytes
            stats.bytes_whole += handle.nbytes

    def read(self, positions: Sequence[int], lo: int, hi: int) -> tuple[np.ndarray, int]:
        """Rows of the digest blocks covering ``[lo, hi)`` of layer positions ``positions``, every
        block checked: (``[nl, rows, K]``, the first row read)."""
        h, br = self.handle, self.handle.block_rows
        b0, b1 = lo // br, -(-hi // br)
        blo, bhi = b0 * br, min(b1 * br, h.rows)
        try:
            data = np.asarray(self.opened.read(positions, blo, bhi))
        except OSError as e:
            raise RouteHandleError(f"{h.where()}: reading rows {blo}-{bhi} failed ({e})") from e
        if data.shape != (len(positions), bhi - blo, h.topk) or data.dtype != np.dtype(h.dtype):
            raise RouteHandleError(f"{h.where()}: rows {blo}-{bhi} of {len(positions)} layers read as "
                                   f"{tuple(data.shape)} {data.dtype}, expected "
                                   f"{(len(positions), bhi - blo, h.topk)} {h.dtype} (truncated)")
        for j, p in enumerate(positions):
            for b in range(b0, b1):
                block = data[j, (b - b0) * br:(b + 1 - b0) * br]
                if block_crc(block) != int(self.table[p, b]):
                    raise RouteHandleError(f"{h.where()}: layer {h.layer_ids[p]} rows {b * br}-"
                                           f"{min((b + 1) * br, h.rows)} do not match their digest (the stored "
                                           f"routes were changed)")
        if self.stats is not None:
            self.stats.bytes_read += data.nbytes
        return data, blo


def _positions(handle: RouteHandle, layer_ids: Sequence[int]) -> list[int]:
    pos_of = {lid: j for j, lid in enumerate(handle.layer_ids)}
    missing = [int(x) for x in layer_ids if int(x) not in pos_of]
    if missing:
        raise LayerMappingError(f"{handle.where()}: needs MoE layers {missing}, the handle holds "
                                f"{list(handle.layer_ids)}")
    return [pos_of[int(x)] for x in layer_ids]


def resolve(handle: RouteHandle, resolvers: Mapping[str, RouteResolver], rows: Optional[slice] = None,
            layer_ids: Optional[Sequence[int]] = None) -> np.ndarray:
    """Rows ``rows`` (a slice of the stored rows; all by default) of layers ``layer_ids`` (all by
    default) of one handle, ``[rows, layers, K]`` in the stored dtype, checked against the digests."""
    ids = list(handle.layer_ids) if layer_ids is None else [int(x) for x in layer_ids]
    lo, hi, step = (rows or slice(None)).indices(handle.rows)
    if step != 1:
        raise RouteShapeError(f"{handle.where()}: rows must be a contiguous slice, got step {step}")
    if hi <= lo:
        return np.zeros((0, len(ids), handle.topk), dtype=handle.dtype)
    data, first = _Opened(handle, resolvers, None).read(_positions(handle, ids), lo, hi)
    return np.ascontiguousarray(data[:, lo - first:hi - first].transpose(1, 0, 2))


def _check_handles(handles: Sequence[RouteHandle], run_id: str, step: int) -> None:
    for h in handles:
        if not isinstance(h, RouteHandle):
            raise RouteHandleError(f"expected route handles, got {type(h).__name__}")
        if h.run_id != run_id or h.step != int(step):
            raise RouteHandleError(f"{h.where()}: this read is for run {run_id} step {step}; a handle of another run "
                                   f"or step is never read (a crashed or earlier step's routes)")
    for attr in ("topk", "num_experts", "route_kind"):
        seen = {getattr(h, attr) for h in handles}
        if len(seen) > 1:
            first = handles[0]
            other = next(h for h in handles if getattr(h, attr) != getattr(first, attr))
            raise RouteShapeError(f"{other.where()}: {attr} {getattr(other, attr)!r} differs from "
                                  f"{first.where()}'s {getattr(first, attr)!r} in one micro-batch")


def read_rank_targets(handles: Sequence[RouteHandle], resolvers: Mapping[str, RouteResolver],
                      layout: ParallelLayout, seq_lens: Sequence[int], *, run_id: str, step: int,
                      tp_rank: int = 0, cp_rank: int = 0, pp_rank: int = 0, vp_stage: int = 0,
                      layer_ids: Optional[Sequence[int]] = None, format: str = "thd",
                      cu_seqlens_padded: Any = None, seq_length: Optional[int] = None,
                      device: Optional[torch.device] = None, degenerate: str = "refuse",
                      counts: Optional[list] = None, stats: Optional[HandleReads] = None,
                      framework: Optional[str] = None) -> ShardedTargets:
    """This rank's targets of one micro-batch whose samples' routes are ``handles`` (batch order;
    ``seq_lens`` the trainer's token counts). Layers: ``layer_ids``, else the MoE layers of stage
    (``pp_rank``, ``vp_stage``). Equal to :func:`r3bridge.shard` of the same routes. ``run_id`` /
    ``step``: the run and RL step this read belongs to (a handle of another is refused)."""
    handles, lens = list(handles), [int(n) for n in seq_lens]
    if len(handles) != len(lens):
        raise CoverageError(f"{len(handles)} route handles for {len(lens)} seq_lens")
    _check_handles(handles, run_id, step)
    want = [int(x) for x in (layout.moe_layers(pp_rank, vp_stage) if layer_ids is None else layer_ids)]
    positions = [_positions(h, want) for h in handles]
    k = handles[0].topk if handles else 1
    num_experts = handles[0].num_experts if handles else max(k, 1)
    rows, starts = [], []
    for h, n in zip(handles, lens):
        if h.start_row + h.rows > n:
            raise CoverageError(f"{h.where()}: start row {h.start_row} + {h.rows} rows ends past the {n} tokens the "
                                f"trainer sees")
        start = min(h.start_row, n)
        starts.append(start)
        rows.append(n - start)          # the span the handle may cover; its stored rows are what it covers
    # one buffer per sample, layer-major, of which only this rank's rows are written: pages never
    # written are never committed, so a rank holds about its share of the routes
    buffers = [np.empty((len(want), r, k), dtype=h.dtype) for h, r in zip(handles, rows)]
    # every row of the span is a route up to the handle's stored rows (the captured range, given:
    # nothing is read to find it); the rows are checked where they go, as any engine's are
    routes = HandedRoutes(rows=rows, starts=starts, layer_ids=tuple(want), columns=None, num_experts=num_experts,
                          topk=k, no_route="none", route_kind=handles[0].route_kind if handles else "rollout",
                          trusted=False, form="handles", arrays=[b.transpose(1, 0, 2) for b in buffers],
                          names=[h.sample for h in handles], framework=framework,
                          _captured=np.array([h.rows for h in handles], dtype=np.int64))
    rank_rows = RankRows.build(layout, lens, tp_rank=tp_rank, cp_rank=cp_rank, format=format,
                               cu_seqlens_padded=cu_seqlens_padded, seq_length=seq_length).cover(routes)
    if want:
        seq, src = rank_rows.seq[rank_rows.covered], rank_rows.src[rank_rows.covered]
        for i in np.unique(seq).tolist():
            h = handles[i]
            blocks = np.unique(src[seq == i] // h.block_rows)
            cut = np.flatnonzero(np.diff(blocks) != 1) + 1          # runs of consecutive blocks
            opened = _Opened(h, resolvers, stats)
            for run in np.split(blocks, cut):
                lo, hi = int(run[0]) * h.block_rows, min((int(run[-1]) + 1) * h.block_rows, h.rows)
                data, first = opened.read(positions[i], lo, hi)
                buffers[i][:, first:first + data.shape[1]] = data
    return read_targets(routes, rank_rows, want, device=device, degenerate=degenerate, counts=counts,
                        where=f"rank (tp {tp_rank}, cp {cp_rank}, pp {pp_rank}, vp {vp_stage})")

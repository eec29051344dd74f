"""Read at the rank: one micro-batch's route handles -> this rank's targets, reading only this
rank's token rows of its stage's layers, every byte read checked against its digest.

:func:`handed_routes` makes the one reader's :class:`r3bridge.HandedRoutes` of a micro-batch's
handles, reading nothing: each sample's "engine array" is the handle itself, read when the reader
slices it. The reader then runs as for any route (docs/architecture.md, "One reader"): the rank's
row map (:class:`r3bridge.parallel.rank_rows.RankRows`: THD / BSHD packing, CP zigzag, SP split),
and :func:`r3bridge.parallel.read.read_targets` of a chunk's layers, which asks each sample for its
runs of this rank's rows of those layers only: the digest blocks holding them are read and checked
(the handle's digest table checked once, when it is first read), then the ids are checked where
they go, fillers written, int64. The same :class:`HandedRoutes` is what an adapter hands the driver
(``MicroBatch.routes``). :func:`read_rank_targets` runs the three steps for one rank. Rows past a
handle's stored rows (an untracked tail, an aborted sample) have no route.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from r3bridge.errors import CoverageError, LayerMappingError, RouteShapeError
from r3bridge.handles.backends import RouteResolver
from r3bridge.handles.handle import DIGEST_KIND, RouteHandle, RouteHandleError, layer_digests, table_digest
from r3bridge.parallel.handed import HandedRoutes
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.rank_rows import RankRows
from r3bridge.parallel.read import read_targets
from r3bridge.parallel.targets import ShardedTargets

__all__ = ["HandleReads", "resolve", "handed_routes", "read_rank_targets"]


@dataclass
class HandleReads:
    """What reads through handles moved: ``bytes_read`` (route bytes read from stores: whole
    digest blocks of the rows and layers asked for), ``table_bytes`` (digest tables),
    ``bytes_whole`` (the same handles' whole routes: what moving the whole field would move);
    seconds spent opening handles (``open_s``: the store's open and the digest table's check),
    reading route bytes (``read_s``) and checking their digests (``check_s``)."""

    handles: int = 0
    bytes_read: int = 0
    table_bytes: int = 0
    bytes_whole: int = 0
    open_s: float = 0.0
    read_s: float = 0.0
    check_s: float = 0.0

    def as_dict(self) -> dict:
        return {"handles": self.handles, "bytes_read": self.bytes_read, "table_bytes": self.table_bytes,
                "bytes_whole": self.bytes_whole, "open_s": self.open_s, "read_s": self.read_s,
                "check_s": self.check_s}


class _Opened:
    """One handle, opened through its store's resolver, its digest table checked."""

    def __init__(self, handle: RouteHandle, resolvers: Mapping[str, RouteResolver], stats: Optional[HandleReads]):
        resolver = resolvers.get(handle.store)
        if resolver is None:
            raise RouteHandleError(f"{handle.where()}: no resolver for store {handle.store!r} (this reader has "
                                   f"{sorted(resolvers)})")
        if handle.digest_kind != DIGEST_KIND:
            raise RouteHandleError(f"{handle.where()}: its digests are {handle.digest_kind!r} (a handle written by "
                                   f"another r3bridge version), this reader checks {DIGEST_KIND!r}: write the "
                                   f"step's routes again with this version")
        self.handle, self.stats = handle, stats
        t0 = time.perf_counter()
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
            stats.open_s += time.perf_counter() - t0
            stats.handles += 1
            stats.table_bytes += table.nbytes
            stats.bytes_whole += handle.nbytes

    def read(self, positions: Sequence[int], lo: int, hi: int) -> tuple[np.ndarray, int]:
        """Rows of the digest blocks covering ``[lo, hi)`` of layer positions ``positions``, every
        block checked: (``[nl, rows, K]``, the first row read)."""
        h, br = self.handle, self.handle.block_rows
        b0, b1 = lo // br, -(-hi // br)
        blo, bhi = b0 * br, min(b1 * br, h.rows)
        t0 = time.perf_counter()
        try:
            data = np.asarray(self.opened.read(positions, blo, bhi))
        except OSError as e:
            raise RouteHandleError(f"{h.where()}: reading rows {blo}-{bhi} failed ({e})") from e
        if data.shape != (len(positions), bhi - blo, h.topk) or data.dtype != np.dtype(h.dtype):
            raise RouteHandleError(f"{h.where()}: rows {blo}-{bhi} of {len(positions)} layers read as "
                                   f"{tuple(data.shape)} {data.dtype}, expected "
                                   f"{(len(positions), bhi - blo, h.topk)} {h.dtype} (truncated)")
        t1 = time.perf_counter()
        for j, p in enumerate(positions):
            # every block of the layer's run in one pass (a contiguous view: no copy)
            bad = np.flatnonzero(layer_digests(np.ascontiguousarray(data[j]), br) != self.table[p, b0:b1])
            if bad.size:
                b = b0 + int(bad[0])
                raise RouteHandleError(f"{h.where()}: layer {h.layer_ids[p]} rows {b * br}-"
                                       f"{min((b + 1) * br, h.rows)} do not match their digest (the stored "
                                       f"routes were changed)")
        if self.stats is not None:
            self.stats.read_s += t1 - t0
            self.stats.check_s += time.perf_counter() - t1
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


def _check_handles(handles: Sequence[RouteHandle], run_id: str, step: int | Sequence[int]) -> None:
    steps = [int(s) for s in step] if isinstance(step, (list, tuple)) else [int(step)] * len(handles)
    if len(steps) != len(handles):
        raise CoverageError(f"{len(steps)} RL steps for {len(handles)} route handles")
    for h, s in zip(handles, steps):
        if not isinstance(h, RouteHandle):
            raise RouteHandleError(f"expected route handles, got {type(h).__name__}")
        if h.run_id != run_id or h.step != s:
            raise RouteHandleError(f"{h.where()}: this read is for run {run_id} step {s}; a handle of another run "
                                   f"or step is never read (a crashed or earlier step's routes)")
    for attr in ("topk", "num_experts", "route_kind"):
        seen = {getattr(h, attr) for h in handles}
        if len(seen) > 1:
            first = handles[0]
            other = next(h for h in handles if getattr(h, attr) != getattr(first, attr))
            raise RouteShapeError(f"{other.where()}: {attr} {getattr(other, attr)!r} differs from "
                                  f"{first.where()}'s {getattr(first, attr)!r} in one micro-batch")


class _HandleArray:
    """One handle's routes as the reader's gathers see a sample's engine array ``[span rows, L, K]``
    (rows from the sample's start row): nothing is read until a row slice's layers are asked for
    (``a[lo:hi][:, cols]`` or ``a[lo:hi, cols]``); then only the digest blocks holding those rows of
    those layers, checked. The handle is opened (its digest table read and checked) once."""

    ndim = 3

    def __init__(self, handle: RouteHandle, span_rows: int, resolvers: Mapping[str, RouteResolver],
                 stats: Optional[HandleReads]) -> None:
        self.handle, self.shape, self.dtype = handle, (span_rows, handle.num_layers, handle.topk), np.dtype(handle.dtype)
        self._resolvers, self._stats, self._opened = resolvers, stats, None

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> Any:
        rows, cols = index if isinstance(index, tuple) else (index, None)
        if not isinstance(rows, slice):
            raise RouteShapeError(f"{self.handle.where()}: routes by reference are read by row slices, got {rows!r}")
        lo, hi, step = rows.indices(self.shape[0])
        if step != 1:
            raise RouteShapeError(f"{self.handle.where()}: row slices must be contiguous, got step {step}")
        part = _HandleRows(self, lo, max(lo, hi))
        return part if cols is None else part[:, cols]

    def read(self, positions: list[int], lo: int, hi: int) -> np.ndarray:
        """``[hi - lo, len(positions), K]``, checked."""
        h = self.handle
        if hi <= lo or not positions:
            return np.zeros((max(hi - lo, 0), len(positions), h.topk), dtype=self.dtype)
        if hi > h.rows:
            raise CoverageError(f"{h.where()}: rows {lo}-{hi} asked for, the handle stores {h.rows} (rows past them "
                                f"have no route)")
        if self._opened is None:
            self._opened = _Opened(h, self._resolvers, self._stats)
        data, first = self._opened.read(positions, lo, hi)
        return data[:, lo - first:hi - first].transpose(1, 0, 2)


class _HandleRows:
    """Rows ``[lo, hi)`` of a :class:`_HandleArray`, still unread: ``[:, cols]`` reads those
    layers, ``np.asarray`` every layer."""

    ndim = 3

    def __init__(self, whole: _HandleArray, lo: int, hi: int) -> None:
        self._whole, self._lo, self._hi = whole, lo, hi
        self.shape, self.dtype = (hi - lo,) + whole.shape[1:], whole.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        if not (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None)):
            raise RouteShapeError(f"{self._whole.handle.where()}: a row slice of routes by reference takes [:, "
                                  f"layer columns], got {index!r}")
        cols = index[1]
        positions = list(range(self.shape[1]))[cols] if isinstance(cols, slice) else [int(c) for c in cols]
        return self._whole.read(positions, self._lo, self._hi)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self._whole.read(list(range(self.shape[1])), self._lo, self._hi)
        return out if dtype is None else out.astype(dtype)


def handed_routes(handles: Sequence[RouteHandle], resolvers: Mapping[str, RouteResolver], seq_lens: Sequence[int],
                  *, run_id: str, step: int | Sequence[int], stats: Optional[HandleReads] = None,
                  framework: Optional[str] = None) -> HandedRoutes:
    """One micro-batch's routes by reference as the one reader's :class:`r3bridge.HandedRoutes`:
    what an adapter hands the driver (``MicroBatch.routes``) instead of the framework's route
    buffer. Nothing is read here; the driver's read of each chunk reads this rank's rows of that
    chunk's layers from the store. ``seq_lens``: the trainer's token counts (rows past a handle's
    stored rows have no route). A handle of another run or step is refused (``step``: one RL step, or
    each handle's own, e.g. each sample's where a micro-batch mixes steps)."""
    handles, lens = list(handles), [int(n) for n in seq_lens]
    if len(handles) != len(lens):
        raise CoverageError(f"{len(handles)} route handles for {len(lens)} seq_lens")
    _check_handles(handles, run_id, step)
    layer_ids = handles[0].layer_ids if handles else ()
    for h in handles:
        if h.layer_ids != layer_ids:
            raise LayerMappingError(f"{h.where()}: layers {list(h.layer_ids)} differ from {handles[0].where()}'s "
                                    f"{list(layer_ids)} in one micro-batch")
    k = handles[0].topk if handles else 1
    rows, starts = [], []
    for h, n in zip(handles, lens):
        if h.start_row + h.rows > n:
            raise CoverageError(f"{h.where()}: start row {h.start_row} + {h.rows} rows ends past the {n} tokens the "
                                f"trainer sees")
        starts.append(min(h.start_row, n))
        rows.append(n - starts[-1])         # the span the handle may cover; its stored rows are what it covers
    # every row of the span is a route up to the handle's stored rows (the captured range, given:
    # nothing is read to find it); the rows are checked where they go, as any engine's are
    return HandedRoutes(rows=rows, starts=starts, layer_ids=tuple(layer_ids), columns=None,
                        num_experts=handles[0].num_experts if handles else max(k, 1), topk=k, no_route="none",
                        route_kind=handles[0].route_kind if handles else "rollout", trusted=False, form="handles",
                        arrays=[_HandleArray(h, r, resolvers, stats) for h, r in zip(handles, rows)],
                        names=[h.sample for h in handles], framework=framework,
                        _captured=np.array([h.rows for h in handles], dtype=np.int64))


def read_rank_targets(handles: Sequence[RouteHandle], resolvers: Mapping[str, RouteResolver],
                      layout: ParallelLayout, seq_lens: Sequence[int], *, run_id: str, step: int,
                      tp_rank: int = 0, cp_rank: int = 0, pp_rank: int = 0, vp_stage: int = 0,
                      layer_ids: Optional[Sequence[int]] = None, format: str = "thd",
                      cu_seqlens_padded: Any = None, seq_length: Optional[int] = None,
                      device: Optional[torch.device] = None, degenerate: str = "refuse",
                      counts: Optional[list] = None, stats: Optional[HandleReads] = None,
                      framework: Optional[str] = None) -> ShardedTargets:
    """This rank's targets of one micro-batch whose samples' routes are ``handles`` (batch order;
    ``seq_lens`` the trainer's token counts): :func:`handed_routes`, the rank's row map and the one
    reader's :func:`r3bridge.parallel.read.read_targets`, as the driver runs them. Layers:
    ``layer_ids``, else the MoE layers of stage (``pp_rank``, ``vp_stage``). Equal to
    :func:`r3bridge.shard` of the same routes."""
    routes = handed_routes(handles, resolvers, seq_lens, run_id=run_id, step=step, stats=stats, framework=framework)
    want = [int(x) for x in (layout.moe_layers(pp_rank, vp_stage) if layer_ids is None else layer_ids)]
    for h in handles:
        _positions(h, want)                 # a missing layer named with its sample
    rank_rows = RankRows.build(layout, [int(n) for n in seq_lens], tp_rank=tp_rank, cp_rank=cp_rank, format=format,
                               cu_seqlens_padded=cu_seqlens_padded, seq_length=seq_length).cover(routes)
    return read_targets(routes, rank_rows, want, device=device, degenerate=degenerate, counts=counts,
                        where=f"rank (tp {tp_rank}, cp {cp_rank}, pp {pp_rank}, vp {vp_stage})")

"""The writer and the lifetime of stored routes: :class:`RouteStore`.

The rollout side calls :meth:`RouteStore.put` once per sample, with the sample's routes as the
trainer will replay them (multi-turn and resubmitted calls already stitched first-seen), and puts
the returned :class:`~r3bridge.handles.RouteHandle` in the framework's field instead of the bytes.
Every key carries the run's id and the RL step (``<run_id>/<step>/<sample>``); the reader refuses a
handle of another run or step, so routes a crashed or preempted step left behind are never read by
a later one. :meth:`RouteStore.release` (or leaving :meth:`RouteStore.step`'s block, an exception
included) deletes a step's routes, unless the store keeps them for traces (``keep=True``: set it
when ``r3bridge.trace_dir`` is set).
"""
from __future__ import annotations

import contextlib
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch

from r3bridge.errors import CoverageError, LayerMappingError, RouteShapeError
from r3bridge.handles.backends import RouteBackend
from r3bridge.handles.handle import (
    DEFAULT_BLOCK_ROWS,
    DIGEST_KIND,
    RouteHandle,
    RouteHandleError,
    WriteTimes,
    table_digest,
)

__all__ = ["RouteStore", "SampleRoutes"]


class SampleRoutes(NamedTuple):
    """One sample's routes for :meth:`RouteStore.put_many` (the arguments of :meth:`RouteStore.put`)."""

    sample: str
    routes: Any
    layer_ids: Sequence[int]
    start_row: int
    num_experts: int
    route_kind: str = "rollout"


class RouteStore:
    """Writes samples' routes through ``backend`` (a :class:`~r3bridge.handles.RouteBackend`) and
    releases them per RL step. One per process that writes routes; ``run_id`` defaults to a fresh
    random id (the trainer reads with the same ``run_id``: pass it along with the handles).
    ``workers``: threads :meth:`put_many` writes samples on (the layer-major copy, the block digests and a
    file write release the GIL); more than 1 only for a backend whose ``write`` may run
    concurrently (``FileRoutes``, ``RayRoutes``; an external ``kv`` client may not)."""

    def __init__(self, backend: RouteBackend, *, run_id: Optional[str] = None,
                 block_rows: int = DEFAULT_BLOCK_ROWS, keep: bool = False, workers: int = 1) -> None:
        if not isinstance(backend, RouteBackend):
            raise RouteHandleError(f"{backend!r} is not a route backend (name, open, write, delete)")
        if int(block_rows) < 1:
            raise RouteHandleError(f"block_rows must be >= 1, got {block_rows}")
        self.backend = backend
        self.run_id = run_id if run_id is not None else uuid.uuid4().hex[:16]
        if not self.run_id or "/" in self.run_id:
            raise RouteHandleError(f"run_id must be a non-empty word without '/', got {self.run_id!r}")
        self.block_rows = int(block_rows)
        self.keep = bool(keep)
        if int(workers) < 1:
            raise RouteHandleError(f"workers must be >= 1, got {workers}")
        self.workers = int(workers)
        self._live: dict[int, dict[str, RouteHandle]] = {}
        self.times = WriteTimes()      # where the writes' time went (summed over samples and threads)

    @property
    def name(self) -> str:
        return self.backend.name

    def live_steps(self) -> list[int]:
        return sorted(self._live)

    def live_bytes(self) -> int:
        """Route bytes this store holds now (every live step)."""
        return sum(h.nbytes for per in self._live.values() for h in per.values())

    def put(self, sample: str, routes: Any, layer_ids: Sequence[int], start_row: int = 0, *, step: int,
            num_experts: int, route_kind: str = "rollout") -> RouteHandle:
        """Store one sample's routes ``[rows, L, K]`` (any integer dtype: kept as given) for layers
        ``layer_ids`` from token ``start_row``, for RL step ``step``; the handle. A sample is
        written once per step (a retry is another attempt: give it its own name)."""
        return self.put_many([SampleRoutes(sample, routes, layer_ids, start_row, num_experts, route_kind)], step=step)[0]

    def put_many(self, entries: Sequence[SampleRoutes], *, step: int) -> list[RouteHandle]:
        """:meth:`put` of several samples, their writes on up to ``workers`` threads; the handles in
        entry order. Every entry is checked before anything is written, and a write that fails
        deletes this call's other writes: all of them are stored, or none."""
        per_step = self._live.get(int(step), {})
        checked, names = [], set()
        for e in entries:
            sample, a, ids = self._checked(e)
            if sample in per_step or sample in names:
                raise RouteHandleError(f"sample {sample!r}: already stored for step {step} (run {self.run_id}); a retry "
                                       f"never overwrites an attempt: store it under its own name")
            names.add(sample)
            checked.append((e, sample, a, ids, f"{self.run_id}/{int(step)}/{sample}"))

        def write(item: tuple) -> tuple[np.ndarray, Any, WriteTimes]:
            times = WriteTimes()
            table, ref = self.backend.write(item[4], item[2], self.block_rows, times)
            return table, ref, times

        if self.workers > 1 and len(checked) > 1:
            with ThreadPoolExecutor(min(self.workers, len(checked))) as pool:
                futures = [pool.submit(write, item) for item in checked]
            results = [f.exception() or f.result() for f in futures]
        else:
            results = []
            for item in checked:
                try:
                    results.append(write(item))
                except Exception as err:    # the ones after it are not written: nothing more to undo
                    results.append(err)
                    break
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            for item, r in zip(checked, results):
                if not isinstance(r, BaseException):
                    self.backend.delete(self._handle(item, r[0], r[1], step))
            raise failed
        per_step = self._live.setdefault(int(step), {})
        out = []
        for item, (table, ref, times) in zip(checked, results):
            self.times.add(times)
            handle = self._handle(item, table, ref, step)
            per_step[item[1]] = handle
            out.append(handle)
        return out

    @staticmethod
    def _checked(e: SampleRoutes) -> tuple[str, np.ndarray, list[int]]:
        sample, routes = str(e.sample), e.routes
        a = routes.detach().cpu().numpy() if isinstance(routes, torch.Tensor) else np.asarray(routes)
        ids = [int(x) for x in e.layer_ids]
        if a.ndim != 3 or a.dtype.kind not in "iu":
            raise RouteShapeError(f"sample {sample!r}: routes must be an integer [rows, layers, topk] array, got "
                                  f"shape {tuple(a.shape)} of {a.dtype}")
        if a.shape[1] != len(ids):
            raise LayerMappingError(f"sample {sample!r}: routes have {a.shape[1]} layers, layer_ids {ids} "
                                    f"{len(ids)}")
        if int(e.start_row) < 0:
            raise CoverageError(f"sample {sample!r}: start_row {e.start_row} < 0")
        return sample, a, ids

    def _handle(self, item: tuple, table: np.ndarray, ref: Any, step: int) -> RouteHandle:
        e, sample, a, ids, key = item
        return RouteHandle(self.name, key, self.run_id, int(step), sample, int(a.shape[0]), int(e.start_row),
                           tuple(ids), int(a.shape[2]), int(e.num_experts), a.dtype.name, self.block_rows,
                           table_digest(table), e.route_kind, ref, DIGEST_KIND)

    def put_batch(self, batch: Any, samples: Sequence[str], *, step: int) -> list[RouteHandle]:
        """Every sequence of a :class:`r3bridge.ReplayBatch` (e.g. the rollout's stitched routes), one
        handle each, in batch order. Its rows must all hold a route (a stitched rollout's do; rows
        past them are "no route" for the reader)."""
        if len(samples) != batch.num_seqs:
            raise CoverageError(f"{len(samples)} sample names for {batch.num_seqs} sequences")
        offs = batch.offsets.tolist()
        valid = batch.valid.cpu().numpy()
        routes = batch.routes.cpu().numpy()
        entries = []
        for i, sample in enumerate(samples):
            lo, hi = offs[i], offs[i + 1]
            bad = np.flatnonzero(~valid[lo:hi])
            if bad.size:
                raise CoverageError(f"sample {sample!r}: row {int(bad[0])} (token {batch.start_rows[i] + int(bad[0])}) "
                                    f"has no route; a handle stores captured rows only")
            entries.append(SampleRoutes(sample, routes[lo:hi], batch.layer_ids, batch.start_rows[i], batch.num_experts,
                                        batch.route_kind))
        return self.put_many(entries, step=step)

    def release(self, step: int) -> int:
        """Delete the routes of RL step ``step`` (kept when the store keeps them for traces);
        how many handles were released."""
        per_step = self._live.pop(int(step), {})
        if self.keep:
            return 0
        for handle in per_step.values():
            self.backend.delete(handle)
        return len(per_step)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator["RouteStore"]:
        """``with store.step(n): ...``: step ``n``'s routes are released when the block ends, an
        exception included."""
        try:
            yield self
        finally:
            self.release(step)

    def close(self) -> None:
        for step in list(self._live):
            self.release(step)

"""Where route bytes live: the resolver protocol (the reader's side) and the stores that implement it.

A **resolver** opens a handle (:meth:`RouteResolver.open`: its digest table, checked by the reader
against the handle's digest) and reads rows ``[lo, hi)`` of some of its layers, layer-major
``[nl, hi - lo, K]`` in the handle's dtype. A **backend** is a resolver that can also write and
delete (:class:`r3bridge.handles.RouteStore` writes through one). Resolvers are held by whoever
reads (the session passes a mapping store name -> resolver to the reader): nothing is registered
on a class.

* :class:`FileRoutes` - one file per sample under a directory, read with one ``pread`` per layer
  of the rows asked for: a rank's rows of a stage's layers are the only bytes it reads. Node-local disk, a shared file system, or
  shared memory (``/dev/shm/...``).
* :class:`RayRoutes` - Ray's object store: one object per layer plus a small index object (Ray
  cannot read a slice of a remote object, so a stage on another node fetches its layers only), or
  (``per_layer=False``, single-node jobs) one object per sample, mapped zero-copy on its node; the
  handle holds the (index) object's reference.
* :class:`KeyValueRoutes` - the plug point for an external store (vLLM's Mooncake keys, a Redis, a
  framework's own store): any object with ``put(key, bytes)``, ``get(key) -> bytes | None`` and
  ``remove(key)``; one value per layer and one for the digest table. :class:`LocalKeyValue` is a
  process-local one (single-process jobs, tests).
"""
from __future__ import annotations

import os
import tempfile
import time
import urllib.parse
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from r3bridge.handles.handle import (
    DIGEST_DTYPE,
    DIGEST_KIND,
    RouteHandle,
    RouteHandleError,
    WriteTimes,
    digest_table,
    layer_major,
)

__all__ = ["RouteResolver", "RouteBackend", "OpenRoutes", "FileRoutes", "RayRoutes", "KeyValueRoutes",
           "KeyValueStore", "LocalKeyValue"]


class OpenRoutes(Protocol):
    """One handle's routes, opened: ``table`` (``DIGEST_DTYPE`` ``[L, blocks]``, as stored) and ``read``."""

    table: np.ndarray

    def read(self, layer_positions: Sequence[int], lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of the layers at ``layer_positions`` (of ``handle.layer_ids``),
        ``[nl, hi - lo, K]`` in the handle's dtype (a view of the store where it can be)."""
        ...


@runtime_checkable
class RouteResolver(Protocol):
    """The reader's side of a store: ``name`` (what handles' ``store`` says) and ``open``."""

    name: str

    def open(self, handle: RouteHandle) -> OpenRoutes: ...


@runtime_checkable
class RouteBackend(RouteResolver, Protocol):
    """A resolver that also stores and deletes. ``write`` stores one sample's ``[rows, L, K]``
    routes (the engine's array, any strides) layer-major under ``key``, digesting each block of
    ``block_rows`` rows as it goes (:func:`~r3bridge.handles.handle.layer_major`); it returns the
    digest table (``DIGEST_DTYPE`` ``[L, blocks]``) and the reference the handle keeps (or None)."""

    def write(self, key: str, routes: np.ndarray, block_rows: int,
              times: Optional[WriteTimes] = None) -> tuple[np.ndarray, Optional[Any]]: ...

    def delete(self, handle: RouteHandle) -> None: ...


def _missing(handle: RouteHandle, what: str) -> RouteHandleError:
    return RouteHandleError(f"{handle.where()}: {what} (missing objects fail closed: the routes were released, "
                            f"never written, or written by another run)")


# ---------------------------------------------------------------------- files (read by pread)
# the format: "R3RH0002" (64-bit block digests, DIGEST_KIND); "R3RH0001" files hold crc32s
_MAGIC = b"R3RH0002"
_ALIGN = 64


def _layout(handle: RouteHandle) -> tuple[int, int, int]:
    """(table offset, data offset, file size) of a handle's file."""
    table_bytes = handle.num_layers * handle.num_blocks * DIGEST_DTYPE.itemsize
    data = -(-(len(_MAGIC) + table_bytes) // _ALIGN) * _ALIGN
    return len(_MAGIC), data, data + handle.nbytes


def _write_all(fd: int, data: Any, offset: int) -> int:
    """``os.pwrite`` until every byte of ``data`` is written at ``offset``; how many."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


class _OpenFile:
    def __init__(self, handle: RouteHandle, path: str) -> None:
        t0, d0, size = _layout(handle)
        try:
            actual = os.path.getsize(path)
        except OSError as e:
            raise _missing(handle, f"no route file {path}") from e
        if actual != size:
            raise RouteHandleError(f"{handle.where()}: route file {path} has {actual} bytes, the handle's shape "
                                   f"needs {size} (truncated or written for another shape)")
        shape = (handle.num_layers, handle.rows, handle.topk)
        with open(path, "rb") as f:
            head = f.read(d0)
        if head[:t0] != _MAGIC:
            found = head[:t0].decode("ascii", "replace")
            raise RouteHandleError(f"{handle.where()}: {path} is not an r3bridge route file of format "
                                   f"{_MAGIC.decode()} ({DIGEST_KIND} digests): it starts {found!r} (an older "
                                   f"r3bridge's file, or not a route file)")
        self.table = np.frombuffer(head[t0:t0 + handle.num_layers * handle.num_blocks * DIGEST_DTYPE.itemsize],
                                   dtype=DIGEST_DTYPE).reshape(handle.num_layers, handle.num_blocks)
        self._path, self._offset, self._shape, self._dtype = path, d0, shape, np.dtype(handle.dtype)
        self._where = handle.where()

    def read(self, layer_positions: Sequence[int], lo: int, hi: int) -> np.ndarray:
        # one pread per layer of just these rows, into the array returned (a file's pages are read
        # by the kernel's copy: no mapping to fault in); the file is opened per read, so an opened
        # handle holds no file descriptor (a pass keeps every micro-batch's handles)
        pos = [int(p) for p in layer_positions]
        out = np.empty((len(pos), max(hi - lo, 0), self._shape[2]), dtype=self._dtype)
        if not out.size:
            return out
        row_bytes = self._shape[2] * self._dtype.itemsize
        fd = os.open(self._path, os.O_RDONLY)
        try:
            for j, p in enumerate(pos):
                at = self._offset + (p * self._shape[1] + lo) * row_bytes
                if os.preadv(fd, [memoryview(out[j]).cast("B")], at) != out[j].nbytes:
                    raise RouteHandleError(f"{self._where}: {self._path} ended before rows {lo}-{hi} of layer "
                                           f"position {p} (truncated after it was opened)")
        finally:
            os.close(fd)
        return out


class FileRoutes:
    """Route files under ``directory`` (``<run>/<step>/<sample>.routes``), each read of only the
    rows and layers asked for. Written to a temporary name and renamed: a crash mid-write leaves no file a reader could take.
    Shared memory: ``FileRoutes("/dev/shm/r3bridge-routes")``."""

    def __init__(self, directory: str, *, name: str = "files") -> None:
        self.directory = os.path.abspath(directory)
        self.name = name

    def path(self, key: str) -> str:
        parts = [urllib.parse.quote(p, safe="") for p in key.split("/")]
        return os.path.join(self.directory, *parts) + ".routes"

    def open(self, handle: RouteHandle) -> _OpenFile:
        return _OpenFile(handle, self.path(handle.key))

    def write(self, key: str, routes: np.ndarray, block_rows: int,
              times: Optional[WriteTimes] = None) -> tuple[np.ndarray, None]:
        """Each layer copied once from ``routes`` into a small buffer, digested while it is in cache
        and written at its place in the file; the header (magic, digest table) last."""
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        table = digest_table(routes, block_rows)
        head_bytes = len(_MAGIC) + table.nbytes
        data_at = -(-head_bytes // _ALIGN) * _ALIGN
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".part")
        clock = time.perf_counter
        try:
            try:
                offset = data_at
                for j, layer, digests in layer_major(routes, block_rows, times):
                    t0 = clock()
                    table[j] = digests
                    offset += _write_all(fd, memoryview(layer).cast("B") if layer.size else b"", offset)
                    if times is not None:
                        times.store_s += clock() - t0
                head = _MAGIC + table.tobytes()
                _write_all(fd, head + b"\0" * (data_at - len(head)), 0)
                if offset == data_at:                  # no route bytes: the file still has its full size
                    os.ftruncate(fd, data_at)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return table, None

    def remove_stale_runs(self, max_age_s: float, *, keep: Sequence[str] = ()) -> list[str]:
        """Delete the folders of runs (other than ``keep``) that wrote nothing for ``max_age_s``
        seconds: what a killed or preempted run left (in ``/dev/shm`` it holds memory until
        removed; no later run reads it either way). Returns the run ids removed."""
        import shutil
        import time

        removed = []
        if not os.path.isdir(self.directory):
            return removed
        now = time.time()
        for run in sorted(os.listdir(self.directory)):
            folder = os.path.join(self.directory, run)
            if run in keep or not os.path.isdir(folder):
                continue
            newest = max((os.path.getmtime(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files),
                         default=os.path.getmtime(folder))
            if now - newest >= max_age_s:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(urllib.parse.unquote(run))
        return removed

    def remove_steps_before(self, run_id: str, step: int) -> int:
        """Delete what run ``run_id`` stored for RL steps before ``step`` and still holds: routes no
        update pass consumed (validation rollouts', samples a trainer dropped), once the trainer
        consumes only later steps. How many route files were removed (other removers may race)."""
        import shutil

        folder = os.path.dirname(self.path(f"{run_id}/0/x"))
        run_dir = os.path.dirname(folder)
        removed = 0
        try:
            names = os.listdir(run_dir)
        except FileNotFoundError:
            return 0
        for name in names:
            if not (name.lstrip("-").isdigit() and int(name) < int(step)):
                continue
            step_dir = os.path.join(run_dir, name)
            removed += sum(f.endswith(".routes") for _, _, files in os.walk(step_dir) for f in files)
            shutil.rmtree(step_dir, ignore_errors=True)
        try:
            os.rmdir(run_dir)                   # the run's folder, once empty (as delete leaves it)
        except OSError:
            pass
        return removed

    def delete(self, handle: RouteHandle) -> None:
        path = self.path(handle.key)
        try:
            os.unlink(path)
        except FileNotFoundError:           # released already (another replica's sweep of old steps)
            pass
        folder = os.path.dirname(path)            # the step's folder, once empty
        while folder.startswith(self.directory + os.sep):
            try:
                os.rmdir(folder)
            except OSError:
                break
            folder = os.path.dirname(folder)


# ---------------------------------------------------------------------- objects (Ray, key-value stores)
class _OpenObjects:
    """Per-layer objects: ``fetch(positions)`` returns each layer's ``[rows, K]`` array."""

    def __init__(self, table: np.ndarray, fetch: Any) -> None:
        self.table = table
        self._fetch = fetch

    def read(self, layer_positions: Sequence[int], lo: int, hi: int) -> np.ndarray:
        layers = self._fetch([int(p) for p in layer_positions])
        return np.stack([a[lo:hi] for a in layers]) if layers else np.zeros((0, hi - lo, 0))


def _table(handle: RouteHandle, raw: Any) -> np.ndarray:
    table = np.asarray(raw)
    if table.dtype != DIGEST_DTYPE:         # never cast: another dtype is another digest kind
        raise RouteHandleError(f"{handle.where()}: digest table of {table.dtype}, this reader checks "
                               f"{DIGEST_DTYPE} ({DIGEST_KIND} digests)")
    if table.size != handle.num_layers * handle.num_blocks:
        raise RouteHandleError(f"{handle.where()}: digest table of {table.size} entries, the handle's shape needs "
                               f"{handle.num_layers * handle.num_blocks}")
    return table.reshape(handle.num_layers, handle.num_blocks)


def _layer(handle: RouteHandle, position: int, raw: Any) -> np.ndarray:
    a = np.frombuffer(raw, dtype=np.dtype(handle.dtype)) if isinstance(raw, (bytes, bytearray, memoryview)) \
        else np.asarray(raw)
    if a.size != handle.rows * handle.topk or a.dtype != np.dtype(handle.dtype):
        raise RouteHandleError(f"{handle.where()}: layer {handle.layer_ids[position]} holds {a.size} ids of "
                               f"{a.dtype}, the handle says {handle.rows} x {handle.topk} of {handle.dtype} "
                               f"(truncated or replaced)")
    return a.reshape(handle.rows, handle.topk)


class RayRoutes:
    """Ray's object store. ``per_layer=True`` (the default): one object per layer and a small index
    object (the table and the layers' references), so that a stage on any node pulls its layers
    only (issue 47's bound: a rank receives about its share of the ids), at L + 1 puts per sample.
    ``per_layer=False``: one object per sample, the digest table and the layer-major ``[L, rows, K]``
    array in one ``ray.put``; a rank on the node that holds it maps it zero-copy and touches only its
    rows of its layers, but a rank on another node pulls the whole sample (Ray cannot read a slice
    of a remote object): for single-node jobs, where it saves the per-layer puts.
    The handle holds the (index) object's reference. Ray counts references: :meth:`delete` (the
    step's release) drops the writer's, and Ray frees the objects once the last handle (the step's
    batch) is dropped too; a later step never reads them (the reader refuses a handle of another
    step)."""

    def __init__(self, *, name: str = "ray", per_layer: bool = True) -> None:
        import ray  # lazily: only jobs that store routes in Ray need it

        self._ray = ray
        self.name = name
        self.per_layer = bool(per_layer)
        self._held: dict[str, Any] = {}

    def write(self, key: str, routes: np.ndarray, block_rows: int,
              times: Optional[WriteTimes] = None) -> tuple[np.ndarray, Any]:
        rows, num_layers, k = routes.shape
        table = digest_table(routes, block_rows)
        clock, put_s = time.perf_counter, 0.0
        if self.per_layer:
            refs = []
            for j, layer, digests in layer_major(routes, block_rows, times):
                t0 = clock()
                table[j] = digests
                refs.append(self._ray.put(layer))        # copied into the store: the buffer is reused
                put_s += clock() - t0
            t0 = clock()
            ref = self._ray.put((table, refs))
            held: Any = (ref, refs)
        else:
            stored = np.empty((num_layers, rows, k), dtype=routes.dtype)
            for j, layer, digests in layer_major(routes, block_rows, times):
                stored[j], table[j] = layer, digests
            t0 = clock()
            ref = held = self._ray.put((table, stored))
        if times is not None:
            times.store_s += put_s + clock() - t0
        self._held[key] = held
        return table, ref

    def open(self, handle: RouteHandle) -> _OpenObjects:
        if handle.ref is None:
            raise _missing(handle, "the handle holds no Ray object reference")
        try:
            table, stored = self._ray.get(handle.ref, timeout=60)    # zero-copy on the node that holds it
        except Exception as e:      # ObjectLostError, OwnerDiedError, GetTimeoutError: all mean "gone"
            raise _missing(handle, f"Ray could not get its object ({type(e).__name__}: {e})") from e
        count = len(stored) if isinstance(stored, list) else np.asarray(stored).shape[0]
        if count != handle.num_layers:
            raise RouteHandleError(f"{handle.where()}: its object holds {count} layers, the handle {handle.num_layers}")
        if not isinstance(stored, list):
            return _OpenObjects(_table(handle, table), lambda positions: [_layer(handle, p, stored[p]) for p in positions])

        def fetch(positions: list[int]) -> list[np.ndarray]:
            try:
                got = self._ray.get([stored[p] for p in positions], timeout=60)
            except Exception as e:
                raise _missing(handle, f"Ray could not get its layer objects ({type(e).__name__}: {e})") from e
            return [_layer(handle, p, a) for p, a in zip(positions, got)]

        return _OpenObjects(_table(handle, table), fetch)

    def delete(self, handle: RouteHandle) -> None:
        self._held.pop(handle.key, None)      # the last reference gone: Ray frees the objects


class KeyValueStore(Protocol):
    """What :class:`KeyValueRoutes` needs of an external store."""

    def put(self, key: str, value: bytes) -> Any: ...

    def get(self, key: str) -> Optional[bytes]: ...

    def remove(self, key: str) -> Any: ...


class LocalKeyValue:
    """A process-local :class:`KeyValueStore` (a dict of bytes)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def put(self, key: str, value: bytes) -> None:
        self.values[key] = bytes(value)

    def get(self, key: str) -> Optional[bytes]:
        return self.values.get(key)

    def remove(self, key: str) -> None:
        self.values.pop(key, None)


class KeyValueRoutes:
    """Routes in an external key-value store ``kv``: ``<key>/table`` (the digest table) and
    ``<key>/layer/<j>`` (layer ``j``'s ``[rows, K]`` bytes). The plug point for stores such as
    vLLM's Mooncake backend: wrap the store's client in an object with ``put`` / ``get`` / ``remove``
    and hand this resolver, under the store's ``name``, to the reader."""

    def __init__(self, kv: KeyValueStore, *, name: str = "kv") -> None:
        self.kv = kv
        self.name = name

    def write(self, key: str, routes: np.ndarray, block_rows: int,
              times: Optional[WriteTimes] = None) -> tuple[np.ndarray, None]:
        table = digest_table(routes, block_rows)
        for j, layer, digests in layer_major(routes, block_rows, times):
            table[j] = digests
            self.kv.put(f"{key}/layer/{j}", layer.tobytes())
        self.kv.put(f"{key}/table", table.tobytes())
        return table, None

    def open(self, handle: RouteHandle) -> _OpenObjects:
        raw = self.kv.get(f"{handle.key}/table")
        if raw is None:
            raise _missing(handle, f"no value under {handle.key}/table in store {self.name!r}")

        def fetch(positions: list[int]) -> list[np.ndarray]:
            out = []
            for p in positions:
                value = self.kv.get(f"{handle.key}/layer/{p}")
                if value is None:
                    raise _missing(handle, f"no value under {handle.key}/layer/{p} (layer {handle.layer_ids[p]})")
                out.append(_layer(handle, p, value))
            return out

        return _OpenObjects(_table(handle, np.frombuffer(raw, dtype=DIGEST_DTYPE)), fetch)

    def delete(self, handle: RouteHandle) -> None:
        for j in range(handle.num_layers):
            self.kv.remove(f"{handle.key}/layer/{j}")
        self.kv.remove(f"{handle.key}/table")

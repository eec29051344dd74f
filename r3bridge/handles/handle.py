"""A route handle: what a sample's batch field carries instead of its route bytes.

The routes of one sample live once in a store, **layer-major** (``[L][rows][K]``: a pipeline stage
reads its layers, a CP / SP rank its rows, without reading the rest). The handle says where they
are (the store's name and a key, or an object reference), their shape, dtype, layer axis and start
row, which run and RL step wrote them, and the digest of a small *digest table* the store keeps
next to the bytes: one 64-bit digest per (layer, block of ``block_rows`` rows; :func:`layer_digests`),
so that a reader that reads only some rows of some layers can still check every byte it read. The
handle itself stays a few hundred bytes, JSON- and pickle-able; it names its digest kind, so that a
handle written with another kind is refused, never misread.
"""
from __future__ import annotations

import functools
import json
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional

import numpy as np

from r3bridge.errors import PayloadError

__all__ = ["RouteHandle", "RouteHandleError", "DEFAULT_BLOCK_ROWS", "DIGEST_KIND", "DIGEST_DTYPE", "digest_table", "WriteTimes",
           "layer_digests", "layer_major", "table_digest"]

# Rows per digest block. A rank reads whole blocks (to check them), so a block's edges cost at most
# 2 x block_rows extra rows per contiguous run a rank reads; the table is L x ceil(rows / block_rows)
# digests (40 layers x 32k rows: 40 KB, read once per handle per micro-batch).
DEFAULT_BLOCK_ROWS = 256

# The block digest this version writes and checks (:func:`layer_digests`), and its table's dtype.
# Handles that name no kind were written with one crc32 per block (``LEGACY_DIGEST_KIND``): a
# reader refuses them (and any other kind) by name instead of comparing unlike digests.
DIGEST_KIND = "wsum64"
DIGEST_DTYPE = np.dtype(np.uint64)
LEGACY_DIGEST_KIND = "crc32"


class RouteHandleError(PayloadError):
    """A route handle cannot be resolved exactly: its object is missing, truncated or changed (its
    digest differs), it belongs to another run or RL step, or no resolver serves its store."""


@dataclass(frozen=True)
class RouteHandle:
    """Where one sample's routes are and what they are (``rows`` rows from token ``start_row``, the
    layers ``layer_ids`` in the store's layer order, top-``topk`` ids of ``num_experts`` experts in
    ``dtype``). ``key``: the store's name for them (it carries ``run_id`` and ``step``); ``ref``: an
    object reference for stores that hand one out (Ray), else None. ``digest``: crc32 of the
    digest table (per (layer, row block) digests of the stored bytes, of kind ``digest_kind``;
    a handle that names none, as older versions wrote them, has crc32 block digests)."""

    store: str
    key: str
    run_id: str
    step: int
    sample: str
    rows: int
    start_row: int
    layer_ids: tuple[int, ...]
    topk: int
    num_experts: int
    dtype: str
    block_rows: int
    digest: int
    route_kind: str = "rollout"
    ref: Any = None
    digest_kind: str = LEGACY_DIGEST_KIND

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(x) for x in self.layer_ids))
        bad = []
        if self.rows < 0 or self.start_row < 0:
            bad.append(f"rows {self.rows} / start_row {self.start_row} must be >= 0")
        if self.topk < 1 or self.num_experts < self.topk:
            bad.append(f"topk {self.topk} must be in 1..num_experts ({self.num_experts})")
        if self.block_rows < 1:
            bad.append(f"block_rows {self.block_rows} must be >= 1")
        if np.dtype(self.dtype).kind not in "iu":
            bad.append(f"dtype {self.dtype} is not an integer dtype")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            bad.append(f"layer_ids {list(self.layer_ids)} repeat")
        if self.route_kind not in ("rollout", "recorded"):
            bad.append(f"route_kind {self.route_kind!r} must be 'rollout' or 'recorded'")
        if bad:
            raise RouteHandleError(f"route handle of sample {self.sample!r} ({self.store}:{self.key}): "
                                   + "; ".join(bad))

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_blocks(self) -> int:
        return -(-self.rows // self.block_rows)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """The stored route bytes (every row of every layer)."""
        return self.rows * self.num_layers * self.topk * self.itemsize

    def where(self) -> str:
        """How errors name it: the sample and the handle."""
        return f"sample {self.sample!r} (route handle {self.store}:{self.key}, run {self.run_id} step {self.step})"

    def to_json(self) -> str:
        """The handle as JSON (keyed stores only: an object reference does not travel as JSON)."""
        if self.ref is not None:
            raise RouteHandleError(f"{self.where()}: a handle holding an object reference travels pickled, not as JSON")
        d = asdict(self)
        d.pop("ref")
        d["layer_ids"] = list(self.layer_ids)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "RouteHandle":
        try:
            d = json.loads(text)
            return cls(**d)
        except (ValueError, TypeError) as e:
            raise RouteHandleError(f"not a route handle: {e}") from e


class WriteTimes:
    """Seconds a store's writes spent per phase, summed over samples (and over writer threads:
    more than the wall time when they overlap): ``copy_s`` (the layer-major copies), ``digest_s``
    (the block digests), ``store_s`` (handing the bytes to the store: file writes, ``ray.put``)."""

    def __init__(self) -> None:
        self.copy_s = self.digest_s = self.store_s = 0.0

    def add(self, other: "WriteTimes") -> None:
        self.copy_s += other.copy_s
        self.digest_s += other.digest_s
        self.store_s += other.store_s

    def as_dict(self) -> dict:
        return {"copy_s": self.copy_s, "digest_s": self.digest_s, "store_s": self.store_s}


@functools.lru_cache(maxsize=16)
def _weights(words: int) -> np.ndarray:
    """``words`` distinct odd weights below 2**32 (``2 * (i * g mod 2**31) + 1``, ``g`` odd: a
    bijection of ``i`` mod 2**31), fixed by ``words`` alone: the writer's and every reader's."""
    i = np.arange(words, dtype=np.uint64)
    w = (i * np.uint64(0x9E3779B1) & np.uint64(0x7FFFFFFF)) * np.uint64(2) + np.uint64(1)
    w.flags.writeable = False
    return w


def layer_digests(layer: np.ndarray, block_rows: int) -> np.ndarray:
    """``DIGEST_DTYPE`` ``[ceil(rows / block_rows)]``: the digest of each block of ``block_rows``
    rows of one layer's C-contiguous ``[rows, K]`` array (kind ``DIGEST_KIND``).

    A block's bytes, zero-padded to 32-bit words ``u_i``, digest to ``sum_i u_i * w_i mod 2**64``
    with distinct odd weights ``w_i < 2**32``. Each product is exact (< 2**64), so a change of one
    word (one id, one bit) always changes the digest, as do two changed bits or two swapped words
    anywhere in the block; a foreign block matches with odds about 2**-64. Why not crc32 per block:
    zlib takes one Python call per block, holding the GIL between blocks, and writer threads
    serialized on it (issue 47: 22 s of digests summed over 16 threads for a 1.7 s write); numpy's
    one ``einsum`` per layer runs without the GIL at memory speed on every thread."""
    rows = layer.shape[0]
    nblocks = -(-rows // block_rows)
    out = np.zeros(nblocks, dtype=DIGEST_DTYPE)
    if not layer.size:
        return out
    raw = layer.reshape(-1).view(np.uint8)
    block_bytes = block_rows * (layer.nbytes // rows)
    words = -(-block_bytes // 4)
    weights = _weights(words)
    full = rows // block_rows
    if full:
        head = raw[:full * block_bytes]
        if block_bytes % 4:                     # a block not of whole words: each one padded (a copy)
            padded = np.zeros((full, words * 4), dtype=np.uint8)
            padded[:, :block_bytes] = head.reshape(full, block_bytes)
            head = padded
        np.einsum("ij,j->i", head.view(np.uint32).reshape(full, words), weights, out=out[:full])
    if full < nblocks:                          # the last, short block, padded with zeros
        tail = np.zeros(words * 4, dtype=np.uint8)
        rest = raw[full * block_bytes:]
        tail[:rest.size] = rest
        out[full] = np.einsum("j,j->", tail.view(np.uint32), weights)
    return out


def digest_table(routes: np.ndarray, block_rows: int) -> np.ndarray:
    """The zeroed ``DIGEST_DTYPE`` ``[L, blocks]`` table a store fills from :func:`layer_major`'s
    digests for a sample's ``[rows, L, K]`` routes."""
    rows, num_layers, _ = routes.shape
    return np.zeros((num_layers, -(-rows // block_rows)), dtype=DIGEST_DTYPE)


def layer_major(routes: np.ndarray, block_rows: int, times: Optional[WriteTimes] = None
                ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Each layer of a sample's ``[rows, L, K]`` routes (any strides: the engine's array as it
    is) as ``(position, [rows, K] C-contiguous, its block digests)``: one strided copy per layer into
    one reused buffer (consume it before the next layer), never the whole sample's layer-major copy."""
    rows, num_layers, k = routes.shape
    buf = np.empty((rows, k), dtype=routes.dtype)
    clock = time.perf_counter
    for j in range(num_layers):
        t0 = clock()
        np.copyto(buf, routes[:, j])
        t1 = clock()
        digests = layer_digests(buf, block_rows)
        if times is not None:
            times.copy_s += t1 - t0
            times.digest_s += clock() - t1
        yield j, buf, digests


def table_digest(table: np.ndarray) -> int:
    """crc32 of a digest table's bytes (one zlib call over the whole table: the GIL released once)."""
    return zlib.crc32(np.ascontiguousarray(table, dtype=DIGEST_DTYPE))



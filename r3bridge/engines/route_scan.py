"""Value checks of route buffers without a sort: every id in ``[0, num_experts)`` and the ``K`` ids
of each (row, layer) distinct, fused with the copy that narrows them to the schema dtype.

Why not ``routes.sort(dim=-1)``: on a production batch (18 M rows x 40 layers x top-22) the sort
of the whole packed tensor allocated its values and int64 indices (~6x the input) and took ~20x the
copy time (field notes, 13). Here the work is cut into blocks of rows, each scanned while it is in
cache, with no allocation that grows with the batch:

* a sorting network over the K columns of a transposed tile (:func:`row_faults`): adjacent
  sorted columns equal = a repeated id; first / last column = each row's min / max, so the range
  check is free. It runs on the source in its own dtype, before the narrowing copy, so an int16
  300 is never wrapped into a valid uint8 44.

A block never raises from a worker: it reports counts and its first bad (row, layer); the caller
raises the first one in row order with the batch's total, so the error does not depend on thread
timing and nothing is half-applied.

Cost (P5 in docs/benchmarks.md, 16-core H100 host): about 50 ns per (row, layer) of top-22 on
one core. The blocks run on a thread pool of torch's thread count, but numpy holds the GIL
between its short calls, so 16 threads measured no faster than one (5.7 s vs 4.7 s for the same
2.3 M tokens x 40 layers): this scan is what keeps the whole-batch ingest slower than a bare copy.
A compiled kernel (or the check on the GPU) is what would close that gap.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = ["BlockFinding", "scan_block", "duplicate_rows", "sorting_network", "run_blocks", "block_rows"]

_TILE_ROWS = 1 << 16          # (row, layer)s per sorting-network sweep: [K, 64 Ki] ids stay in L2
_BLOCK_IDS = 1 << 22           # ids per thread-pool task: amortises Python per-task overhead


def block_rows(row_ids: int) -> int:
    """Rows per thread-pool task for rows of ``row_ids`` ids each."""
    return max(1, _BLOCK_IDS // max(1, row_ids))


@dataclass
class BlockFinding:
    """What one block's scan found; rows are the block's own (0-based)."""

    range_bad: int = 0
    range_first: tuple[int, int] | None = None      # (row, layer column)
    lowest: int | None = None                       # the block's smallest id, all rows valid (1-based hint)
    ids: int = 0                                    # ids the block holds
    dup_bad: int = 0
    dup_first: tuple[int, int] | None = None


def sorting_network(k: int) -> list[tuple[int, int]]:
    """Comparators of Batcher's merge-exchange sorting network for ``k`` inputs (Knuth, TAOCP
    5.2.2, Algorithm M; any ``k``): 114 compare-exchanges for top-22."""
    out: list[tuple[int, int]] = []
    if k < 2:
        return out
    t = (k - 1).bit_length()
    p = 1 << (t - 1)
    while p > 0:
        q, r, d = 1 << (t - 1), 0, p
        while True:
            out += [(i, i + d) for i in range(k - d) if i & p == r]
            if q == p:
                break
            d, q, r = q - p, q >> 1, p
        p >>= 1
    return out


def row_faults(ids: np.ndarray, num_experts: int, lowest: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` ``[..., K]`` (any integer dtype, any strides) -> (out of range ``[...]``, repeats
    an id ``[...]``).

    The rows are sorted by a sorting network run column-wise on a ``[K, tile]`` transpose (one
    gathering copy from whatever layout ``ids`` has; each compare-exchange is then one
    ``minimum`` and one ``maximum`` over a contiguous vector of the ids' own dtype: SIMD, in
    cache); adjacent sorted columns are compared, and the first and last columns are each row's
    minimum and maximum, so the range check costs no sweep of its own. On the 2-core CPU box it
    was ~7x faster than a numpy row sort and ~2x faster than 64-bit bitmasks per row for top-22
    uint8; exact for any dtype and expert count. ``lowest``: a list that gets each tile's smallest
    id (the sorted first column's minimum: one reduction per tile, no extra sweep)."""
    lead, k = ids.shape[:-1], ids.shape[-1]
    rows3 = ids[:, None, :] if ids.ndim == 2 else ids          # [rows, L, K]
    n, inner = rows3.shape[0], rows3.shape[1]
    rng, dup = np.zeros((n, inner), dtype=bool), np.zeros((n, inner), dtype=bool)
    net = sorting_network(k)
    tile = max(1, _TILE_ROWS // max(1, inner))
    for a in range(0, n, tile):
        part = rows3[a:a + tile]
        cols = list(np.ascontiguousarray(part.transpose(2, 0, 1)).reshape(k, -1))
        for i, j in net:
            x, y = cols[i], cols[j]
            cols[i], cols[j] = np.minimum(x, y), np.maximum(x, y)
        shape = part.shape[:2]
        rng[a:a + tile] = ((cols[-1] >= num_experts) | (cols[0] < 0)).reshape(shape)
        if lowest is not None and cols[0].size:
            lowest.append(int(cols[0].min()))
        if k > 1:
            bad = cols[0] == cols[1]
            for j in range(1, k - 1):
                bad |= cols[j] == cols[j + 1]
            dup[a:a + tile] = bad.reshape(shape)
    return rng.reshape(lead), dup.reshape(lead)


def duplicate_rows(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """bool ``[M]``: True where a row of ``ids`` ``[M, K]`` repeats an id."""
    return row_faults(ids, num_experts)[1]


def _first(mask2d: np.ndarray) -> tuple[int, int]:
    r, col = np.unravel_index(int(np.argmax(mask2d)), mask2d.shape)
    return int(r), int(col)


def scan_block(src: np.ndarray, num_experts: int, *, dst: np.ndarray | None = None,
               valid: np.ndarray | None = None) -> BlockFinding:
    """Check ``src`` ``[rows, L, K]`` and, when its ids are in range, copy it into ``dst`` (same
    shape, the schema dtype; ``None``: check in place). ``valid`` ``[rows]``: only those rows are
    checked (the others are copied as they are; the caller overwrites them with fillers).
    Out-of-range ids are reported before duplicates."""
    found = BlockFinding()
    rows, layers, k = src.shape
    if src.size == 0:
        return found
    # checked on the source, in its own dtype (exact: an int16 300 is seen before a narrowing
    # copy could wrap it to a valid uint8 44), any strides (the network's transpose gathers it);
    # then copied once into ``dst`` (which may be strided too: a layer-major target)
    low: list[int] = []
    rng, dup = row_faults(src, num_experts, lowest=low if valid is None else None)
    found.lowest = min(low) if low else None
    found.ids = int(src.size)
    if dst is not None:
        np.copyto(dst, src, casting="unsafe")       # in range (or an invalid row): exact or overwritten
    if valid is not None:
        rng &= valid[:, None]
        dup &= valid[:, None]
    if rng.any():
        found.range_bad, found.range_first = int(rng.sum()), _first(rng)
    elif dup.any():
        found.dup_bad, found.dup_first = int(dup.sum()), _first(dup)
    return found


def _workers() -> int:
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def run_blocks(tasks: Sequence[Callable[[], BlockFinding]]) -> list[BlockFinding]:
    """Run the block tasks (on a thread pool when torch may use several threads), in order."""
    workers = _workers()
    if workers == 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda t: t(), tasks))

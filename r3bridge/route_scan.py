"""Value checks of route buffers without a sort: every id in ``[0, num_experts)`` and the ``K`` ids
of each (row, layer) distinct, fused with the copy that narrows them to the schema dtype.

Why not ``routes.sort(dim=-1)``: on a production batch (18 M rows x 40 layers x top-22) the sort
of the whole packed tensor allocated its values and int64 indices (~6x the input) and took ~20x the
copy time (field notes, 13). Here the work is cut into blocks of rows, each scanned while it is in
cache, on a thread pool (numpy releases the GIL in these loops):

* range: ``min`` / ``max`` of the block in the source dtype (exact for any integer dtype, before
  any narrowing, so an int16 300 is never wrapped into a valid uint8 44);
* distinctness: the ids of a (row, layer) as bits of ``ceil(E / 64)`` 64-bit words (up to 256
  experts): the K ids are distinct iff the popcount of the OR of their bits is K. Above 256
  experts, a sort of the block's rows (small, in cache).

A block never raises from a worker: it reports counts and its first bad (row, layer); the caller
raises the first one in row order with the batch's total, so the error does not depend on thread
timing and nothing is half-applied.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = ["BlockFinding", "scan_block", "duplicate_rows", "run_blocks", "block_rows"]

_CACHE_IDS = 1 << 16           # ids per inner chunk: 64 KiB of uint8 plus 8x that as words (L2)
_BLOCK_IDS = 1 << 22           # ids per thread-pool task: amortises Python per-task overhead
_HAS_POPCOUNT = hasattr(np, "bitwise_count")     # numpy >= 2.0


def block_rows(row_ids: int) -> int:
    """Rows per thread-pool task for rows of ``row_ids`` ids each."""
    return max(1, _BLOCK_IDS // max(1, row_ids))


@dataclass
class BlockFinding:
    """What one block's scan found; rows are the block's own (0-based)."""

    range_bad: int = 0
    range_first: tuple[int, int] | None = None      # (row, layer column)
    dup_bad: int = 0
    dup_first: tuple[int, int] | None = None


def duplicate_rows(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """``ids`` ``[M, K]`` (any integer dtype, values in ``[0, num_experts)`` where it matters) ->
    bool ``[M]``: True where a row repeats an id. Values outside the range give True or False
    without error (callers mask such rows)."""
    m, k = ids.shape
    out = np.zeros(m, dtype=bool)
    if k <= 1 or m == 0:
        return out
    words = (num_experts + 63) // 64
    for a in range(0, m, max(1, _CACHE_IDS // k)):
        chunk = ids[a:a + _CACHE_IDS // k]
        if words <= 4 and _HAS_POPCOUNT:
            t = np.ascontiguousarray(chunk.T)                         # [K, m]: each op is one vector
            bit = np.left_shift(np.uint64(1), (t & 63).astype(np.uint64))
            if words == 1:
                count = np.bitwise_count(np.bitwise_or.reduce(bit, axis=0))
            else:
                word = t >> 6
                count = np.zeros(t.shape[1], dtype=np.uint8)
                for w in range(words):
                    count += np.bitwise_count(np.bitwise_or.reduce(np.where(word == w, bit, np.uint64(0)), axis=0))
            out[a:a + chunk.shape[0]] = count != k
        else:
            s = np.sort(chunk, axis=1)
            out[a:a + chunk.shape[0]] = (s[:, 1:] == s[:, :-1]).any(1)
    return out


def _first(mask2d: np.ndarray) -> tuple[int, int]:
    r, col = np.unravel_index(int(np.argmax(mask2d)), mask2d.shape)
    return int(r), int(col)


def scan_block(src: np.ndarray, num_experts: int, *, dst: np.ndarray | None = None,
               valid: np.ndarray | None = None) -> BlockFinding:
    """Check ``src`` ``[rows, L, K]`` and, when its ids are in range, copy it into ``dst`` (same
    shape, the schema dtype; ``None``: check in place). ``valid`` ``[rows]``: only those rows are
    checked (the others are copied as they are; the caller overwrites them with fillers)."""
    found = BlockFinding()
    rows, layers, k = src.shape
    if src.size == 0:
        return found
    lo, hi = src.min(), src.max()
    if lo < 0 or hi >= num_experts:
        bad = ((src < 0) | (src >= num_experts)).any(-1)
        if valid is not None:
            bad &= valid[:, None]
        n = int(bad.sum())
        if n:
            found.range_bad, found.range_first = n, _first(bad)
            return found
    ids = src
    if dst is not None:
        np.copyto(dst, src, casting="unsafe")       # in range (or an invalid row): exact or overwritten
        ids = dst
    dup = duplicate_rows(ids.reshape(rows * layers, k), num_experts).reshape(rows, layers)
    if valid is not None:
        dup &= valid[:, None]
    n = int(dup.sum())
    if n:
        found.dup_bad, found.dup_first = n, _first(dup)
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

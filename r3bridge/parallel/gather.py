"""Reading rows out of what a framework handed over: the gathers of the one reader.

Given which source rows to read (read row ``t`` is row ``src[t]`` of sequence ``seq[t]``) and which
layer columns, :func:`gather_rows` returns them layer-major ``[nl, T, K]`` in a dtype that holds
the source ids exactly: one index gather on a tensor grid (the ``K`` ids of a (row, layer) moved
as one machine word where they can be), or one strided copy per run of consecutive rows (engine
arrays; a host grid whose read rows come in long runs). :func:`read_weights` reads the routing weights of the same rows; :func:`unrouted_rows`
finds rows whose transport writes "no route" in-band. Nothing here checks an id
(:func:`r3bridge.engines.route_checks.check_read` does, where the ids go).

The handed routes are seen through :class:`HandedBuffers` (what a gather reads of
:class:`r3bridge.parallel.handed.HandedRoutes`), so this module imports nothing of ``handed``.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import numpy as np
import torch

from r3bridge.engines.engine_pack import allocate, layer_columns
from r3bridge.errors import RouteShapeError, RouteWeightsError

__all__ = ["HandedBuffers", "gather_rows", "read_weights", "unrouted_rows", "pick", "exact_dtype", "TORCH_INT"]

# exact torch dtype for a source dtype (uint16 / uint32 have no complete torch support: widened
# on the copy, never wrapped)
_HOLDS = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int8): torch.int8, np.dtype(np.int16): torch.int16,
          np.dtype(np.uint16): torch.int32, np.dtype(np.int32): torch.int32, np.dtype(np.uint32): torch.int64,
          np.dtype(np.int64): torch.int64, np.dtype(np.uint64): torch.int64}
TORCH_INT = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

# A rank's rows come in runs of consecutive source rows (THD packing: each sequence's one or two
# CP slices, clipped to the SP slice). On the host, from this many read rows per run on average,
# one strided copy per run beats building a row index and gathering by it (P1); short runs (BSHD's
# s-major rows: every row its own run) take the index gather.
RUN_COPY_MIN_ROWS = 256


class HandedBuffers(Protocol):
    """What a gather reads of :class:`r3bridge.parallel.handed.HandedRoutes`: its storage (a tensor
    ``grid`` with each sequence's batch row and first column, or per-sequence host ``arrays``),
    the routing weights in the same storage, and how the transport writes "no route"."""

    grid: Optional[torch.Tensor]
    seq_b: Optional[np.ndarray]
    seq_s0: Optional[np.ndarray]
    arrays: Optional[list[np.ndarray]]
    weights_grid: Optional[torch.Tensor]
    weights_arrays: Optional[list[np.ndarray]]
    starts: list[int]
    topk: int
    no_route: str
    sentinel: Optional[int]
    trusted: bool

    def source_columns(self, cols: Optional[list[int]]) -> Optional[list[int]]: ...


def exact_dtype(dtype: Any) -> torch.dtype:
    """The torch integer dtype that holds a source dtype's ids exactly (uint16 / uint32 widened)."""
    if isinstance(dtype, torch.dtype):
        if dtype in TORCH_INT:
            return dtype
        if dtype in (torch.uint16, torch.uint32, torch.uint64):
            return torch.int32 if dtype == torch.uint16 else torch.int64
        raise RouteShapeError(f"routes must have an integer dtype, got {dtype}")
    dt = np.dtype(dtype)
    if dt.kind not in "iu":
        raise RouteShapeError(f"routes must have an integer dtype, got {dt}")
    return _HOLDS[dt.newbyteorder("=")]


def gather_rows(routes: HandedBuffers, seq: np.ndarray, src: np.ndarray, covered: np.ndarray,
                cols: list[int]) -> torch.Tensor:
    """Rows ``src[t]`` of sequences ``seq[t]`` of the layer positions ``cols``, layer-major ``[nl,
    T, K]``, in a dtype that holds the source ids exactly (rows not covered: whatever the source
    holds there; never read)."""
    t = int(seq.size)
    if routes.arrays is not None:
        return _fill_from_arrays(routes, seq, src, covered, cols)
    grid = routes.grid
    src_cols = routes.source_columns(cols)
    if grid.shape[0] * grid.shape[1] == 0 or t == 0:
        return torch.zeros((len(cols), t, routes.topk), dtype=exact_dtype(grid.dtype), device=grid.device)
    flat = _flat_rows(grid)
    if flat is not None and grid.device.type == "cpu":
        cols_read = src_cols if src_cols is not None else list(range(grid.shape[2]))
        run_start, run_end = _runs(seq, src, covered)
        if _consecutive(cols_read) and run_start.size * RUN_COPY_MIN_ROWS <= t:
            first = routes.seq_b[seq[run_start]] * grid.shape[1] + routes.seq_s0[seq[run_start]] + src[run_start]
            return _copy_runs_layer_major(flat, first, run_start, run_end, covered, cols_read)
    b = routes.seq_b[seq]
    s = np.where(covered, routes.seq_s0[seq] + src, 0)
    b = np.where(covered, b, 0)
    if flat is not None:
        row = torch.from_numpy(b * grid.shape[1] + s).to(grid.device)
        return _gather_layer_major(flat, row, src_cols if src_cols is not None else list(range(grid.shape[2])))
    return pick(grid, b, s, src_cols).permute(1, 0, 2).contiguous()       # [T, nl, K] -> [nl, T, K]


def unrouted_rows(compact: torch.Tensor, routes: HandedBuffers, covered: np.ndarray) -> np.ndarray:
    """Rows the transport writes as "no route" in-band, read from the ids gathered: a sentinel
    in every id, or (a zero-row transport at top-1, where expert 0 and "no route" look alike) a
    zero in every layer read."""
    if not covered.any():
        return np.zeros_like(covered)
    if routes.no_route == "sentinel":
        return (compact == routes.sentinel).all(-1).all(0).cpu().numpy()
    if routes.no_route == "zero" and routes.topk == 1:
        return (compact == 0).all(-1).all(0).cpu().numpy()
    return np.zeros_like(covered)


def pick(grid: torch.Tensor, b: np.ndarray, s: np.ndarray, cols: Optional[list[int]]) -> torch.Tensor:
    """``grid[b, s]`` of the source columns ``cols`` (``[T, nl, K]``), without copying the grid:
    consecutive columns are sliced (a view), others indexed together with the rows (indexing a
    list of columns first would copy every row of the grid)."""
    b_t = torch.from_numpy(np.ascontiguousarray(b)).to(grid.device)
    s_t = torch.from_numpy(np.ascontiguousarray(s)).to(grid.device)
    sel = layer_columns(cols)
    if isinstance(sel, list):
        c = torch.tensor(sel, dtype=torch.int64, device=grid.device)
        return grid[b_t[:, None], s_t[:, None], c[None, :]]
    return (grid if sel is None else grid[:, :, sel])[b_t, s_t]


def _flat_rows(grid: torch.Tensor) -> Optional[torch.Tensor]:
    """``grid [B, S, L, K]`` as ``[B*S, L, K]`` without a copy, where its strides allow."""
    b, s = grid.shape[:2]
    if b == 1:
        return grid[0]
    if grid.stride(0) == s * grid.stride(1):
        return grid.flatten(0, 1)           # a view: the batch and sequence dims are one stride apart
    return None


def _consecutive(cols: list[int]) -> bool:
    return bool(cols) and cols == list(range(cols[0], cols[0] + len(cols)))


def _as_words(src: torch.Tensor) -> torch.Tensor:
    """``src [rows, L, K]`` viewed as ``[rows, L, words]`` of the widest int type dividing ``K *
    itemsize`` (the ``K`` ids of one (row, layer) as one machine word where they can be); ``src``
    itself where it cannot be viewed so (not contiguous, or a storage offset off the word size)."""
    rows, num_layers, topk = src.shape
    nbytes = topk * src.element_size()
    word, word_dtype = next((w, dt) for w, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16),
                                                   (1, torch.uint8)) if nbytes % w == 0)
    if word > src.element_size() and src.is_contiguous():
        try:
            return src.view(rows, num_layers * topk).view(word_dtype).view(rows, num_layers, nbytes // word)
        except RuntimeError:       # storage offset not aligned to the word size: keep elements
            pass
    return src


def _copy_runs_layer_major(src: torch.Tensor, first: np.ndarray, run_start: np.ndarray, run_end: np.ndarray,
                           covered: np.ndarray, cols: list[int]) -> torch.Tensor:
    """The read rows of consecutive layer columns ``cols`` of ``src [rows, L, K]`` layer-major
    (``[nl, T, K]``, src's dtype), where the read rows come in runs: read rows ``[run_start[r],
    run_end[r])`` are source rows ``first[r]...`` (rows of runs not covered: 0, never read).

    Speed (P1 in docs/benchmarks.md, the host path): one strided copy per run, moving machine
    words, into the layer-major buffer: no row index built, one pass instead of an index gather and
    a transposing copy (~1.5x faster on a rank's rows of THD packing, a few long runs)."""
    words = _as_words(src)
    nl, t = len(cols), int(run_end[-1]) if run_end.size else 0
    out = torch.empty((nl, t, words.shape[2]), dtype=words.dtype, device=src.device)
    view = words[:, cols[0]:cols[0] + nl]                                  # [rows, nl, n], a view
    for r0, r1, f in zip(run_start.tolist(), run_end.tolist(), first.tolist()):
        if covered[r0]:
            out[:, r0:r1].copy_(view[f:f + r1 - r0].transpose(0, 1))
        else:
            out[:, r0:r1] = 0
    if words is not src:
        out = out.view(torch.uint8).view(src.dtype).view(nl, t, src.shape[2])
    return out


def _gather_layer_major(src: torch.Tensor, row: torch.Tensor, cols: list[int]) -> torch.Tensor:
    """``src[row][:, cols].permute(1, 0, 2).contiguous()`` (``[nl, T, K]``, src's dtype).

    Speed (P1 in docs/benchmarks.md), same result: the ``K`` ids of one (row, layer) move as one
    machine word (``src`` viewed as ``[rows, L, words]`` of the widest int type dividing ``K *
    itemsize``), and a stage's consecutive layer columns are sliced (a view) before one
    ``index_select`` on rows (advanced indexing with two index tensors is ~20x slower on CPU).
    Plain element gathers where ``src`` cannot be viewed as words."""
    topk = src.shape[2]
    words = _as_words(src)
    first_col = cols[0]
    if _consecutive(cols):
        part = words[:, first_col:first_col + len(cols)].index_select(0, row)    # [T, nl, n]
    else:
        part = words.index_select(0, row).index_select(1, torch.tensor(cols, device=src.device))
    gathered = part.permute(1, 0, 2).contiguous()                         # [nl, T, n]
    if words is not src:
        gathered = gathered.view(torch.uint8).view(src.dtype).view(len(cols), row.numel(), topk)
    return gathered


def _runs(seq: np.ndarray, src: np.ndarray, covered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends of the runs of consecutive covered source rows of one sequence."""
    t = int(seq.size)
    brk = np.ones(t, dtype=bool)
    brk[1:] = (seq[1:] != seq[:-1]) | (src[1:] != src[:-1] + 1) | (covered[1:] != covered[:-1])
    run_start = np.flatnonzero(brk)
    return run_start, np.append(run_start[1:], t)


def _fill_from_arrays(routes: HandedBuffers, seq: np.ndarray, src_rows: np.ndarray, covered: np.ndarray,
                      cols: list[int]) -> torch.Tensor:
    """Engine arrays: one strided copy per run of consecutive covered rows (a view of the
    engine's array, its layer columns sliced where consecutive) into a layer-major buffer."""
    t, k = int(seq.size), routes.topk
    dtypes = {a.dtype for a in routes.arrays} or {np.dtype(np.uint8)}
    dt = max((exact_dtype(d) for d in dtypes), key=lambda d: torch.iinfo(d).bits - (d == torch.uint8))
    if len(dtypes) > 1:
        dt = torch.int64
    out = allocate((len(cols), t, k), dt, what="rank targets")
    if t == 0:
        return out
    dst = out.numpy().transpose(1, 0, 2)                           # [T, nl, K] view
    sel = layer_columns(routes.source_columns(cols))
    run_start, run_end = _runs(seq, src_rows, covered)
    for r0, r1 in zip(run_start.tolist(), run_end.tolist()):
        if not covered[r0]:
            continue           # rows without a route: filled with fillers after the check
        a = routes.arrays[int(seq[r0])]
        s0 = int(src_rows[r0])
        src = a[s0:s0 + r1 - r0]
        np.copyto(dst[r0:r1], src if sel is None else src[:, sel], casting="unsafe")
    return out


def read_weights(routes: HandedBuffers, seq: np.ndarray, src_rows: np.ndarray, covered: np.ndarray,
                 cols: list[int], want: list[int], dev: torch.device) -> dict[int, torch.Tensor]:
    """The routing weights of the rows :func:`gather_rows` reads, by the same row map (float32 ``[T, K]`` per layer,
    rounded through the schema's float16, 0 on rows without a route), checked as the schema
    checks weights where they were not checked before."""
    t, k = int(seq.size), routes.topk
    if routes.weights_arrays is not None:
        out = np.zeros((len(cols), t, k), dtype=np.float32)
        dst = out.transpose(1, 0, 2)
        sel = layer_columns(routes.source_columns(cols))
        run_start, run_end = _runs(seq, src_rows, covered)
        for r0, r1 in zip(run_start.tolist(), run_end.tolist()):
            if covered[r0]:
                w = routes.weights_arrays[int(seq[r0])]
                s0 = int(src_rows[r0])
                src = w[s0:s0 + r1 - r0]
                dst[r0:r1] = src if sel is None else src[:, sel]
        w_t = torch.from_numpy(out)
    else:
        g = routes.weights_grid
        src_cols = routes.source_columns(cols)
        b = np.where(covered, routes.seq_b[seq], 0)
        s = np.where(covered, routes.seq_s0[seq] + src_rows, 0)
        if g.shape[0] * g.shape[1] == 0 or t == 0:
            w_t = torch.zeros((len(cols), t, k), dtype=torch.float32)
        else:
            w_t = pick(g, b, s, src_cols).permute(1, 0, 2)
    w_t = w_t.to(dev)
    if not routes.trusted:
        w32 = w_t.float()
        narrow = w32.to(torch.float16)
        bad = (~torch.isfinite(w32) | (w32 < 0) | ~torch.isfinite(narrow)).any(-1).cpu().numpy().T & covered[:, None]
        if bad.any():
            r, c = (int(x) for x in np.argwhere(bad)[0])
            i, row = int(seq[r]), int(src_rows[r])
            raise RouteWeightsError(f"sequence {i}, row {row} (token {routes.starts[i] + row}), layer {want[c]}: "
                                    f"weights {w32[c, r].tolist()} must be finite, non-negative and within float16 "
                                    f"range")
        w_t = narrow
    out_w = w_t.to(torch.float32).clone()
    if not covered.all():
        out_w[:, torch.from_numpy(np.flatnonzero(~covered)).to(dev)] = 0
    return {lid: out_w[j] for j, lid in enumerate(want)}

"""Per-sequence engine route arrays -> one packed buffer in the schema dtype, in one sweep.

What ``ReplayBatch.from_vllm`` / ``from_ragged`` run on host arrays. Every block of rows is read
once from the engine's own array (a view: never a concatenation of the inputs, never an int64
copy), its MoE layers selected by id while it is copied, range-checked in its source dtype,
narrowed into its place in a buffer allocated once, and its rows checked for duplicate ids while
in cache (:mod:`r3bridge.engines.route_scan`), on a thread pool. The buffer is the only allocation that
grows with the batch besides the ``[rows]`` validity mask.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from r3bridge.engines.route_checks import raise_findings
from r3bridge.engines.route_scan import block_rows, run_blocks, scan_block
from r3bridge.errors import ReplayMemoryError, RouteShapeError

__all__ = ["host_array", "layer_columns", "allocate", "pack_sequences"]


def host_array(a: Any) -> np.ndarray | None:
    """A numpy view of a host array / CPU tensor (no copy), or None where there is none (a device
    tensor: the caller takes the torch path)."""
    if isinstance(a, np.ndarray):
        return a
    if isinstance(a, torch.Tensor) and a.device.type == "cpu" and not a.is_conj() and not a.is_neg():
        try:
            return a.detach().resolve_conj().numpy()
        except (TypeError, RuntimeError):
            return None
    return None


def layer_columns(cols: Sequence[int] | None) -> slice | list[int] | None:
    """The columns to read: a slice (a view) when they are consecutive, else the list."""
    if cols is None:
        return None
    cols = list(cols)
    if cols and cols == list(range(cols[0], cols[0] + len(cols))):
        return slice(cols[0], cols[0] + len(cols))
    return cols


def allocate(shape: tuple[int, ...], dtype: torch.dtype, *, what: str) -> torch.Tensor:
    """``torch.empty`` that turns an allocator refusal into a :class:`ReplayMemoryError` naming
    the sizes (never a raw ``DefaultCPUAllocator`` RuntimeError)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    try:
        return torch.empty(shape, dtype=dtype)
    except (RuntimeError, MemoryError) as e:
        if "alloc" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        raise ReplayMemoryError(
            f"{what}: {list(shape)} {str(dtype).replace('torch.', '')} needs {nbytes / 2**30:.1f} GiB and this "
            f"host refused it ({e}). Build only one rank's targets straight from the engine arrays "
            f"(r3bridge.rank_targets), or ingest the batch in parts.") from None


def pack_sequences(arrays: Sequence[np.ndarray], cols: slice | list[int] | None, out: np.ndarray,
                   num_experts: int, *, layer_ids: Sequence[int], starts: Sequence[int],
                   valid: Sequence[np.ndarray | None] | None = None) -> None:
    """Copy ``arrays[i][:, cols]`` (any integer dtype, ``[rows_i, *, K]``) into consecutive rows of
    ``out`` (``[sum rows_i, L, K]``, the schema dtype), checking every id of every valid row.
    Raises :class:`r3bridge.RouteValueError` naming sequence, row, token and layer (the first bad
    one in row order, with the batch's total) before the caller builds anything."""
    rows = [int(a.shape[0]) for a in arrays]
    if not rows:
        return
    block = block_rows(out.shape[1] * out.shape[2])
    tasks, where = [], []       # where[b] = (sequence, first row of the block in it)
    row = 0
    for i, a in enumerate(arrays):
        sel = a if cols is None else a[:, cols] if isinstance(cols, slice) else None
        v = None if valid is None else valid[i]
        for r0 in range(0, rows[i], block):
            r1 = min(rows[i], r0 + block)
            dst = out[row + r0: row + r1]
            vb = None if v is None else v[r0:r1]

            def task(i=i, r0=r0, r1=r1, sel=sel, dst=dst, vb=vb):
                src = sel[r0:r1] if sel is not None else arrays[i][r0:r1][:, cols]
                return scan_block(src, num_experts, dst=dst, valid=vb)
            tasks.append(task)
            where.append((i, r0))
        row += rows[i]
    findings = run_blocks(tasks)
    offs = np.concatenate([[0], np.cumsum(rows)])
    block_row0 = [int(offs[i]) + r0 for i, r0 in where]

    def locate(flat_row: int) -> tuple[int, int, int]:
        i = int(np.searchsorted(offs, flat_row, side="right")) - 1
        return i, flat_row - int(offs[i]), starts[i] + flat_row - int(offs[i])

    def values(flat_row: int, col: int) -> list:
        i, r, _ = locate(flat_row)
        src = arrays[i][r]
        return (src[col] if cols is None else src[cols][col]).tolist()

    raise_findings(findings, block_row0, values, num_experts, layer_ids, locate)


def check_shapes(arrays: Sequence[np.ndarray]) -> None:
    """Every sequence ``[rows, L, K]`` with sequence 0's ``[L, K]``."""
    ref = tuple(arrays[0].shape[1:])
    for i, a in enumerate(arrays):
        if tuple(a.shape[1:]) != ref:
            raise RouteShapeError(
                f"sequence {i}: [layers, topk] = {list(a.shape[1:])} differs from sequence 0's {list(ref)} "
                f"(inconsistent topk or layer count)")

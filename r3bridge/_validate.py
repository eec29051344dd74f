"""Vectorised validation of packed routes (errors name sequence, row, token and layer), and the
conversion of every number, mask and array the public API takes."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from r3bridge.errors import DegenerateRouteError, ReplayError, RouteValueError


def locate(offsets: torch.Tensor, starts: Sequence[int], flat_row: int) -> tuple[int, int, int]:
    """Packed row index -> (sequence, row within sequence, token position)."""
    seq = int(torch.searchsorted(offsets, torch.tensor([flat_row]), right=True)[0]) - 1
    row = flat_row - int(offsets[seq])
    return seq, row, starts[seq] + row


def route_value_error(kind: str, *, seq: int, row: int, tok: int, layer: int, values: list,
                      num_experts: int, total: int) -> RouteValueError:
    """The one message for a bad (row, layer): ``kind`` is "range" or "duplicate"."""
    where = f"sequence {seq}, row {row} (token {tok}), layer {layer}: "
    if kind == "range":
        # ids are logical (the router's, pre-EPLB): an engine's physical replica slots are not
        return RouteValueError(f"{where}expert ids {values} out of range [0, {num_experts}) "
                               f"({total} bad (row, layer) pairs in total; ids must be logical expert ids, "
                               f"pre-EPLB: map physical replica slots back first)")
    # a degenerate route: ids repeat inside the rows the engine returned (vLLM #54730's all-zero
    # rows), a row without a route read as one, or (all zeros) a dense layer's zero column picked
    # by an id off by one (engines report dense layers as zero rows)
    dense = (f"; or layer {layer} is a dense layer: layer ids are 0-based global, 1-based ids point one layer "
             f"further" if values and not any(values) else "")
    return DegenerateRouteError(f"{where}duplicate expert ids {values} (a degenerate route: a broken engine capture "
                                f"such as vLLM #54730's all-zero rows, or a zero/padding row that should be marked "
                                f"invalid{dense}; {total} bad (row, layer) pairs in total). "
                                f"r3bridge.degenerate_routes=native routes such rows natively, counted in metrics")


def raise_findings(findings, block_row0: Sequence[int], values, num_experts: int, layer_ids: Sequence[int],
                   where) -> None:
    """Raise the first finding of the blocks (range errors first, then duplicates), in row order,
    with the batch's total. ``block_row0[b]``: first packed row of block ``b``; ``values(row,
    col)`` the ids of a (row, layer); ``where(row)`` -> (sequence, row in sequence, token)."""
    for kind in ("range", "dup"):
        total = sum(getattr(f, f"{kind}_bad") for f in findings)
        if not total:
            continue
        b, f = next((b, f) for b, f in enumerate(findings) if getattr(f, f"{kind}_bad"))
        r, col = getattr(f, f"{kind}_first")
        row = block_row0[b] + r
        seq, srow, tok = where(row)
        raise route_value_error("range" if kind == "range" else "duplicate", seq=seq, row=srow, tok=tok,
                                layer=layer_ids[col], values=values(row, col), num_experts=num_experts,
                                total=total)


def check_routes(routes: torch.Tensor, valid: torch.Tensor, num_experts: int,
                 layer_ids: Sequence[int], offsets: torch.Tensor, starts: Sequence[int]) -> None:
    """Ids in ``[0, num_experts)`` and distinct within each row, on valid rows only.

    Invalid rows may hold anything (engines send zero rows); they are overwritten with fillers.
    On the host: block by block, no sort and no copy of the batch (:mod:`r3bridge.engines.route_scan`).
    """
    if routes.numel() == 0:
        return
    if routes.device.type != "cpu" or routes.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return _check_routes_torch(routes, valid, num_experts, layer_ids, offsets, starts)
    from r3bridge.engines.route_scan import block_rows, run_blocks, scan_block

    arr = routes.numpy() if routes.is_contiguous() else routes.contiguous().numpy()
    v = valid.cpu().numpy()
    all_valid = bool(v.all())
    step = block_rows(arr.shape[1] * arr.shape[2])
    row0 = list(range(0, arr.shape[0], step))
    tasks = [(lambda a=a: scan_block(arr[a:a + step], num_experts, valid=None if all_valid else v[a:a + step]))
             for a in row0]
    raise_findings(run_blocks(tasks), row0, lambda r, c: arr[r, c].tolist(), num_experts, layer_ids,
                   lambda r: locate(offsets, starts, r))


def _check_routes_torch(routes: torch.Tensor, valid: torch.Tensor, num_experts: int,
                        layer_ids: Sequence[int], offsets: torch.Tensor, starts: Sequence[int]) -> None:
    """Device tensors: the same checks in torch (a sort of the rows on the device)."""
    lo, hi = int(routes.min()), int(routes.max())
    if lo < 0 or hi >= num_experts:
        bad = ((routes < 0) | (routes >= num_experts)).any(-1) & valid[:, None].to(routes.device)
        hits = bad.nonzero()
        if hits.numel():
            r, l = int(hits[0, 0]), int(hits[0, 1])
            seq, row, tok = locate(offsets, starts, r)
            raise route_value_error("range", seq=seq, row=row, tok=tok, layer=layer_ids[l],
                                    values=routes[r, l].tolist(), num_experts=num_experts, total=int(bad.sum()))
    if routes.shape[2] > 1:
        s = routes.sort(dim=-1).values
        dup = (s[..., 1:] == s[..., :-1]).any(-1) & valid[:, None].to(routes.device)
        hits = dup.nonzero()
        if hits.numel():
            r, l = int(hits[0, 0]), int(hits[0, 1])
            seq, row, tok = locate(offsets, starts, r)
            raise route_value_error("duplicate", seq=seq, row=row, tok=tok, layer=layer_ids[l],
                                    values=routes[r, l].tolist(), num_experts=num_experts, total=int(dup.sum()))


# ------------------------------------------------------------------ numbers, byte order, devices
# Every number the public API takes (counts, ids, lengths, ranks) goes through ``as_index`` /
# ``as_index_list``: an exactly integral value of any numeric type is converted; anything else
# (10.5, NaN, inf, a string, a bool, a meta tensor) raises the caller's ReplayError subclass
# naming the parameter and position, never a foreign exception or a silent truncation.
_Err = type[ReplayError]


def _describe(x: Any) -> str:
    return f"{x!r} ({type(x).__name__})"


def check_readable(t: torch.Tensor, *, what: str, error: _Err) -> None:
    """Refuse a tensor whose values cannot be read (meta device: shape only, no data)."""
    if t.device.type == "meta":
        raise error(f"{what}: tensor is on the meta device (it has a shape but no values)")


def native_order(a: np.ndarray) -> np.ndarray:
    """Exact conversion of a non-native byte order array (e.g. ``astype('>i4')``): torch refuses those."""
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def as_index(x: Any, *, what: str, error: _Err) -> int:
    """One exactly integral number -> int."""
    if type(x) is int:
        return x
    if isinstance(x, (bool, np.bool_)):
        raise error(f"{what}: expected an integer, got the boolean {x!r}")
    if isinstance(x, torch.Tensor):
        check_readable(x, what=what, error=error)
        if x.numel() != 1:
            raise error(f"{what}: expected one integer, got a tensor of shape {tuple(x.shape)}")
        if x.dtype == torch.bool:
            raise error(f"{what}: expected an integer, got a bool tensor")
        x = x.item()
    if isinstance(x, np.ndarray) and x.ndim == 0:
        x = x.item()
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        if math.isfinite(x) and float(x).is_integer():
            return int(x)
        raise error(f"{what}: {float(x)!r} is not an integral number")
    raise error(f"{what}: expected an integer, got {_describe(x)}")


def as_index_list(xs: Any, *, what: str, error: _Err) -> list[int]:
    """A flat sequence / array / tensor of exactly integral numbers -> list[int]."""
    if isinstance(xs, torch.Tensor):
        check_readable(xs, what=what, error=error)
        xs = xs.detach().cpu().numpy()
    if isinstance(xs, np.ndarray):
        if xs.ndim != 1:
            raise error(f"{what}: expected a flat list, got shape {tuple(xs.shape)}")
        if xs.dtype.kind in "iu":
            return native_order(xs).astype(np.int64, copy=False).tolist()
        if xs.dtype.kind == "f":
            with np.errstate(invalid="ignore"):
                bad = ~(np.isfinite(xs) & (np.mod(xs, 1) == 0))
            if bad.any():
                i = int(bad.nonzero()[0][0])
                raise error(f"{what}[{i}]: {float(xs[i])!r} is not an integral number")
            return xs.astype(np.int64).tolist()
        if xs.dtype.kind != "O":
            raise error(f"{what}: expected integers, got an array of dtype {xs.dtype}")
    elif isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__"):
        raise error(f"{what}: expected a list of integers, got {_describe(xs)}")
    out = list(xs)
    if all(type(v) is int for v in out):
        return out
    return [as_index(v, what=f"{what}[{i}]", error=error) for i, v in enumerate(out)]


def as_number_tensor(x: Any, *, what: str, error: _Err, kinds: str, expected: str) -> torch.Tensor:
    """A tensor (readable, detached) or an array-like of numpy kinds ``kinds`` (any byte order) ->
    a tensor, without copying a native contiguous array; anything else raises ``error`` saying
    ``expected``. The one conversion of masks and routing weights."""
    if isinstance(x, torch.Tensor):
        check_readable(x, what=what, error=error)
        return x.detach()
    a = np.asarray(x)
    if a.dtype.kind not in kinds:
        raise error(f"{what}: expected {expected}, got dtype {a.dtype}")
    return torch.from_numpy(np.ascontiguousarray(native_order(a)))


def as_mask(x: Any, *, what: str, error: _Err) -> torch.Tensor:
    """A 0/1 mask (bool, integer or float dtype, any byte order) -> CPU bool tensor; any other
    value (0.5, NaN, 2) raises instead of being read as True."""
    t = as_number_tensor(x, what=what, error=error, kinds="biuf", expected="a 0/1 mask")
    if t.dtype == torch.bool:
        return t.cpu()
    bad = (t != 0) & (t != 1)
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise error(f"{what}: value {t[pos].item()!r} at {list(pos)} is not 0 or 1")
    return (t != 0).cpu()

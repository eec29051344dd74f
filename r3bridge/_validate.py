"""The conversion of every number, mask and array the public API takes (the checks of route ids'
values are :mod:`r3bridge.engines.route_checks`')."""
from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch

from r3bridge.errors import ReplayError

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
    a = np.ascontiguousarray(native_order(a))
    if a.flags.writeable:
        return torch.from_numpy(a)
    # a read-only array (np.frombuffer of wire bytes): shared, never written (masks are read, weights
    # narrowed or cloned before rows are zeroed), so torch's "not writable" warning would be noise
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


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

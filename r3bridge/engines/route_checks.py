"""Every check of route ids' values: each id in ``[0, num_experts)`` and the ``K`` ids of each
(row, layer) distinct. One message for a bad (row, layer) (:func:`route_value_error`: sequence, row,
token, layer, the ids, the total), and two paths, each id checked once on each:

* a batch's packed routes (:func:`check_routes`, what ``ReplayBatch``'s constructors run): on the
  host block by block, no sort and no copy (:mod:`r3bridge.engines.route_scan`); on a device a sort;
* a read's gathered ids (:func:`check_read`, what the one reader runs on a rank's compact targets
  where they go): one sort and one scalar back on a device, the sorting network on the host. A row
  whose ids repeat inside a sample's captured rows is degenerate (vLLM #54730):
  ``degenerate`` in :data:`DEGENERATE_CHOICES` refuses it or routes it natively.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence

import numpy as np
import torch

from r3bridge.engines.route_scan import block_rows, row_faults, run_blocks, scan_block
from r3bridge.errors import DegenerateRouteError, RouteValueError

__all__ = ["DEGENERATE_CHOICES", "locate", "route_value_error", "raise_findings", "check_routes", "check_read",
           "one_based_hint", "warn_if_no_expert_zero", "NO_ZERO_EXPECTED_PICKS"]

DEGENERATE_CHOICES = ("refuse", "native")

# expected picks of expert 0 (ids / num_experts) above which a batch without a single 0 is
# suspicious: under any routing that uses expert 0 at all, 50 expected picks and none seen is
# ~e^-50 by chance; a model whose expert 0 is dead is why this is a warning, not an error
NO_ZERO_EXPECTED_PICKS = 50


def one_based_hint(lowest: Optional[int], highest: Optional[int], num_experts: int) -> str:
    """``"; ..."`` naming 1-based expert ids when no id is below 1 and one equals ``num_experts``
    (ids counted from 1: ``[1, num_experts]``), else ``""``."""
    if lowest is None or highest is None or lowest < 1 or highest != num_experts:
        return ""
    return (f"; no id is below 1 and one equals num_experts={num_experts}: the ids look 1-based (expert ids "
            f"are 0-based, [0, {num_experts}); subtract 1 where the engine or adapter writes them)")


def warn_if_no_expert_zero(lowest: Optional[int], ids: int, num_experts: int, where: str = "routes") -> None:
    """Warn when ``ids`` route ids hold no expert 0 although ``ids / num_experts`` picks of it were
    expected (:data:`NO_ZERO_EXPECTED_PICKS`): 1-based ids that never reached ``num_experts``.
    A warning, not an error: a model may never pick expert 0."""
    if lowest is None or lowest < 1 or num_experts < 1 or ids < NO_ZERO_EXPECTED_PICKS * num_experts:
        return
    warnings.warn(f"{where}: {ids} expert ids and not one 0 (the smallest is {lowest}; about {ids // num_experts} "
                  f"picks of expert 0 were expected): are the ids 1-based? r3bridge's ids are 0-based, "
                  f"[0, {num_experts}). (Or expert 0 is never chosen by this model.)", stacklevel=3)


def locate(offsets: torch.Tensor, starts: Sequence[int], flat_row: int) -> tuple[int, int, int]:
    """Packed row index -> (sequence, row within sequence, token position)."""
    seq = int(torch.searchsorted(offsets, torch.tensor([flat_row]), right=True)[0]) - 1
    row = flat_row - int(offsets[seq])
    return seq, row, starts[seq] + row


def route_value_error(kind: str, *, seq: int, row: int, tok: int, layer: int, values: list,
                      num_experts: int, total: int, lowest: Optional[int] = None) -> RouteValueError:
    """The one message for a bad (row, layer): ``kind`` is "range" or "duplicate". ``lowest``: the
    smallest id of the checked batch where known (the 1-based hint; else the row's own)."""
    where = f"sequence {seq}, row {row} (token {tok}), layer {layer}: "
    if kind == "range":
        low = min(values) if lowest is None and values else lowest
        one_based = one_based_hint(low, max(values) if values else None, num_experts)
        # ids are logical (the router's, pre-EPLB): an engine's physical replica slots are not
        return RouteValueError(f"{where}expert ids {values} out of range [0, {num_experts}) "
                               f"({total} bad (row, layer) pairs in total{one_based}; otherwise: ids must be logical "
                               f"expert ids, pre-EPLB: map physical replica slots back first)")
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
    col)`` the ids of a (row, layer); ``where(row)`` -> (sequence, row in sequence, token). Ids
    that look 1-based are named (an error's hint; a warning when no 0 appears in a large batch)."""
    lows = [f.lowest for f in findings]
    lowest = min(lows) if lows and None not in lows else None
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
                                total=total, lowest=lowest)
    warn_if_no_expert_zero(lowest, sum(f.ids for f in findings), num_experts)


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
    arr = routes.numpy() if routes.is_contiguous() else routes.contiguous().numpy()
    v = valid.cpu().numpy()
    all_valid = bool(v.all())
    block = block_rows(arr.shape[1] * arr.shape[2])
    row0 = list(range(0, arr.shape[0], block))
    tasks = [(lambda a=a: scan_block(arr[a:a + block], num_experts, valid=None if all_valid else v[a:a + block]))
             for a in row0]
    raise_findings(run_blocks(tasks), row0, lambda r, c: arr[r, c].tolist(), num_experts, layer_ids,
                   lambda r: locate(offsets, starts, r))


def _check_routes_torch(routes: torch.Tensor, valid: torch.Tensor, num_experts: int,
                        layer_ids: Sequence[int], offsets: torch.Tensor, starts: Sequence[int]) -> None:
    """Device tensors: the same checks in torch (a sort of the rows on the device)."""
    on_rows = valid[:, None].to(routes.device)
    wide = routes.to(torch.int64) if routes.dtype in (torch.uint16, torch.uint32, torch.uint64) else routes
    lo, hi = int(wide.min()), int(wide.max())
    if lo < 0 or hi >= num_experts:
        _raise_first("range", ((routes < 0) | (routes >= num_experts)).any(-1) & on_rows, routes, num_experts,
                     layer_ids, offsets, starts, lowest=lo)
    if bool(valid.all()):
        warn_if_no_expert_zero(lo, routes.numel(), num_experts)
    if routes.shape[2] > 1:
        s = routes.sort(dim=-1).values
        _raise_first("duplicate", (s[..., 1:] == s[..., :-1]).any(-1) & on_rows, routes, num_experts, layer_ids,
                     offsets, starts)


def _raise_first(kind: str, bad: torch.Tensor, routes: torch.Tensor, num_experts: int, layer_ids: Sequence[int],
                 offsets: torch.Tensor, starts: Sequence[int], lowest: Optional[int] = None) -> None:
    """Raise ``kind``'s error at the first (row, layer) of ``bad`` (``[rows, L]``), if any."""
    hits = bad.nonzero()
    if hits.numel():
        r, l = int(hits[0, 0]), int(hits[0, 1])
        seq, row, tok = locate(offsets, starts, r)
        raise route_value_error(kind, seq=seq, row=row, tok=tok, layer=layer_ids[l], values=routes[r, l].tolist(),
                                num_experts=num_experts, total=int(bad.sum()), lowest=lowest)


# ------------------------------------------------------------------ a read's ids
def check_read(compact: torch.Tensor, covered: np.ndarray, *, seq: np.ndarray, row: np.ndarray,
               starts: Sequence[int], layer_ids: Sequence[int], num_experts: int, degenerate: str,
               names: Optional[Sequence[str]] = None, framework: Optional[str] = None,
               covered_on_device: Optional[torch.Tensor] = None) -> tuple[np.ndarray, np.ndarray]:
    """Range and distinct-within-row of every covered (row, layer) of a read's ids ``compact``
    (``[nl, T, K]``, layer-major: the gathered rows of ``layer_ids``; read row ``t`` is row
    ``row[t]`` of sequence ``seq[t]``), one sweep where the ids are (the device: a sort of the K
    ids; the host: a sorting network). Raises on an id out of range; a row whose ids repeat is
    degenerate: refused (raises) or routed natively (returned: ``covered`` without it, and the
    degenerate read rows). Errors name the sequence by ``names`` where given. ``covered_on_device``:
    ``covered`` already on ``compact``'s device (saves a copy); ``covered`` itself is returned when
    every covered row is sound."""
    if compact.device.type != "cpu" and not _any_fault(compact, covered, num_experts, covered_on_device):
        return covered, np.zeros(0, dtype=np.int64)       # the usual case: one scalar back from the device
    rng, dup = _faults(compact, num_experts)                   # bool [T, nl] on the host
    rng &= covered[:, None]
    dup &= covered[:, None]
    if rng.any():
        r, c = (int(x) for x in np.argwhere(rng)[0])
        i, j = int(seq[r]), int(row[r])
        on = torch.from_numpy(np.asarray(covered, dtype=bool)).to(compact.device)
        low = int(compact[:, on].to(torch.int64).min()) if bool(on.any()) else None   # the error path only
        raise _named(route_value_error("range", seq=i, row=j, tok=starts[i] + j, layer=layer_ids[c],
                                       values=compact[c, r].tolist(), num_experts=num_experts,
                                       total=int(rng.sum()), lowest=low), names, i, framework)
    bad_rows = np.flatnonzero(dup.any(1))
    if bad_rows.size and degenerate == "refuse":
        r = int(bad_rows[0])
        c = int(np.flatnonzero(dup[r])[0])
        i, j = int(seq[r]), int(row[r])
        raise _named(route_value_error("duplicate", seq=i, row=j, tok=starts[i] + j, layer=layer_ids[c],
                                       values=compact[c, r].tolist(), num_experts=num_experts,
                                       total=int(dup.sum())), names, i, framework)
    if bad_rows.size:
        covered = covered.copy()
        covered[bad_rows] = False
    return covered, bad_rows


def _named(err: Exception, names: Optional[Sequence[str]], i: int, framework: Optional[str] = None) -> Exception:
    """``err`` naming sequence ``i`` as the framework does (``names[i]``); with a ``framework``,
    the adapter's sample name leads the message."""
    if not names or i >= len(names):
        return err
    if framework is not None:
        return led_by_name(err, i, f"{framework} sample {names[i]}")
    return type(err)(str(err).replace(f"sequence {i}", names[i], 1))


def led_by_name(err: Exception, i: int, name: str) -> Exception:
    """``err`` (a core error naming "sequence i") as the same class, its message led by ``name`` (how
    a framework knows the sample) instead."""
    return type(err)(f"{name}: " + str(err).replace(f"sequence {i}", "", 1).lstrip(", :"))


def _faults_torch(compact: torch.Tensor, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_faults` where the ids are (the router's device): min / max and a sort of the K ids."""
    lo, hi = compact.amin(-1), compact.amax(-1)
    rng = (lo < 0) | (hi >= num_experts)
    if compact.shape[-1] > 1:
        s = compact.sort(-1).values
        dup = (s[..., 1:] == s[..., :-1]).any(-1)
    else:
        dup = torch.zeros_like(rng)
    both = torch.stack([rng, dup]).transpose(1, 2).cpu().numpy()
    return both[0], both[1]


def _any_fault(compact: torch.Tensor, covered: np.ndarray, num_experts: int,
               covered_on_device: Optional[torch.Tensor] = None) -> bool:
    """Whether any covered (row, layer) of a device tensor ``[nl, T, K]`` is out of range or repeats
    an id: min / max and a sort of the K ids on the device, one host sync."""
    bad = (compact.amin(-1) < 0) | (compact.amax(-1) >= num_experts)
    if compact.shape[-1] > 1:
        s = compact.sort(-1).values
        bad |= (s[..., 1:] == s[..., :-1]).any(-1)
    on = covered_on_device if covered_on_device is not None else torch.from_numpy(covered).to(compact.device)
    return bool((bad & on[None]).any())


def _faults(compact: torch.Tensor, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(out of range, repeats an id) per (row, layer) of ``compact`` ``[nl, T, K]``, as host
    ``[T, nl]`` bools. On a device: min / max and a sort of the K ids (one kernel each, the
    rank's compact ids only). On the host: the sorting network of :mod:`r3bridge.engines.route_scan`,
    in cache-sized blocks on a thread pool."""
    nl, t, k = compact.shape
    if compact.device.type != "cpu":
        return _faults_torch(compact, num_experts)
    arr = compact.numpy().transpose(1, 0, 2)              # [T, nl, K] view
    rng, dup = np.zeros((t, nl), dtype=bool), np.zeros((t, nl), dtype=bool)
    block = block_rows(nl * k)

    def task(a: int):
        def run():
            r, d = row_faults(arr[a:a + block], num_experts)
            rng[a:a + block], dup[a:a + block] = r, d
        return run
    run_blocks([task(a) for a in range(0, t, block)])
    return rng, dup

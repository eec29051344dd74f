"""The read: one rank's targets of one chunk's MoE layers, from a micro-batch's handed routes and
this rank's row map. The last step of the one reader (docs/architecture.md, "One reader"):
gather the rank's rows of the stage's layers in the source dtype (:mod:`r3bridge.parallel.gather`),
move them to the router's device, check every id read once there
(:func:`r3bridge.engines.route_checks.check_read`), write fillers into rows without a route and
widen to int64. :class:`ReadStats` counts what a driver read over its life.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from r3bridge.engines.layer_ids import shifted_layer_ids_hint
from r3bridge.engines.route_checks import DEGENERATE_CHOICES, check_read
from r3bridge.errors import LayerMappingError, RouteShapeError
from r3bridge.parallel.gather import gather_rows, read_weights, unrouted_rows
from r3bridge.parallel.handed import HandedRoutes
from r3bridge.parallel.rank_rows import RankRows
from r3bridge.parallel.targets import ShardedTargets

__all__ = ["read_targets", "ReadCounts", "ReadStats"]


@dataclass
class ReadStats:
    """How a driver read its routes, over its life (a trace of the path, cheap enough to keep on):
    ``reads`` (:func:`read_targets` calls: one per chunk and micro-batch, plus late recomputes),
    ``row_maps`` (:class:`RankRows` built: one per micro-batch, whatever its chunks), ``routes``
    (micro-batches' handed routes read: one per micro-batch) and ``forms`` (how many of those
    came in each (storage form, "no route" kind, route kind): what the adapters handed over)."""

    reads: int = 0
    row_maps: int = 0
    routes: int = 0
    forms: dict = field(default_factory=dict)

    def saw(self, routes: HandedRoutes) -> None:
        self.routes += 1
        key = f"{routes.form}/{routes.no_route}/{routes.route_kind}"
        self.forms[key] = self.forms.get(key, 0) + 1

    def as_dict(self) -> dict:
        return {"reads": self.reads, "row_maps": self.row_maps, "routes": self.routes, "forms": dict(self.forms)}


@dataclass
class ReadCounts:
    """What one read saw, per sequence of the micro-batch ((row, layer) pairs of this rank's rows
    and the layers read): pairs replayed, pairs whose route was degenerate (ids repeat: the row is
    routed natively under ``"native"``), the pairs of real tokens; and the rows the framework
    handed for the sequence, 0 where it was handed without any route
    (:meth:`HandedRoutes.without_routes`: counted apart)."""

    replayed: np.ndarray            # int64 [num_seqs]
    degenerate: np.ndarray          # int64 [num_seqs]
    token_pairs: np.ndarray = None  # int64 [num_seqs]
    handed: np.ndarray = None       # int64 [num_seqs]


def read_targets(routes: HandedRoutes, rank_rows: RankRows, layer_ids: Sequence[int], *,
                 device: Optional[torch.device] = None, degenerate: str = "refuse",
                 counts: Optional[list] = None, where: str = "this rank",
                 model_layers: Optional[Sequence[int]] = None) -> ShardedTargets:
    """This rank's targets of ``layer_ids`` for the micro-batch ``routes`` (``rank_rows`` already
    :meth:`RankRows.cover`-ed with them). ``counts`` (a list) receives a :class:`ReadCounts`."""
    if degenerate not in DEGENERATE_CHOICES:
        raise RouteShapeError(f"degenerate must be one of {DEGENERATE_CHOICES}, got {degenerate!r}")
    want = [int(x) for x in layer_ids]
    pos_of = {lid: j for j, lid in enumerate(routes.layer_ids)}
    missing = [x for x in want if x not in pos_of]
    if missing:
        hint = "" if model_layers is None else shifted_layer_ids_hint(routes.layer_ids, model_layers)
        raise LayerMappingError(f"{where} needs MoE layers {missing}, but the batch only has "
                                f"layers {list(routes.layer_ids)}{hint}")
    dev = torch.device(device if device is not None else routes.device)
    k, n = routes.topk, routes.num_seqs
    covered = rank_rows.covered.copy()
    degenerate_rows = np.zeros(0, dtype=np.int64)
    if not want:
        if counts is not None:
            zeros = np.zeros(n, dtype=np.int64)
            counts.append(ReadCounts(zeros, zeros, zeros, _handed_rows(routes)))
        return ShardedTargets({}, torch.from_numpy(covered).to(dev), (), k, int(covered.sum()),
                              {} if routes.has_weights else None)
    cols = [pos_of[x] for x in want]
    compact = gather_rows(routes, rank_rows.seq, rank_rows.src, covered, cols)   # [nl, T, K], source dtype
    compact = _to_device(compact, dev)
    covered &= ~unrouted_rows(compact, routes, covered)
    # the mask goes to the device once: the check and the fill below share it (per micro-batch,
    # each extra host-to-device copy and sync is a measurable part of P5 on the device host)
    valid_t = _to_device(torch.from_numpy(covered), dev)
    if not routes.trusted and covered.any():
        checked, degenerate_rows = check_read(compact, covered, seq=rank_rows.seq, row=rank_rows.src,
                                              starts=routes.starts, layer_ids=want,
                                              num_experts=routes.num_experts, degenerate=degenerate,
                                              names=routes.names, framework=routes.framework,
                                              covered_on_device=valid_t)
        if checked is not covered:          # degenerate rows routed natively: a new mask
            covered = checked
            valid_t = _to_device(torch.from_numpy(covered), dev)
    if counts is not None:          # before the fill: an int64 read is widened in place
        counts.append(_read_counts(rank_rows, routes, covered, compact, degenerate_rows, len(want)))
    out = _widened_with_fillers(compact, covered, valid_t, k)
    weights = (read_weights(routes, rank_rows.seq, rank_rows.src, covered, cols, want, dev) if routes.has_weights
               else None)
    return ShardedTargets({lid: out[j] for j, lid in enumerate(want)}, valid_t, tuple(want), k,
                          int(covered.sum()), weights)


def _to_device(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``host`` on ``dev``; to an accelerator through a page-locked copy, so the copy is queued
    and the host goes on: a copy from pageable memory first waits for the device's queue to
    drain (a host sync per micro-batch, which stalls a schedule that runs ahead of the device)."""
    if dev.type == "cpu" or host.device.type != "cpu":
        return host.to(dev)
    return host.pin_memory().to(dev, non_blocking=True)


def _widened_with_fillers(compact: torch.Tensor, covered: np.ndarray, valid_t: torch.Tensor, k: int) -> torch.Tensor:
    """``compact`` ``[nl, T, K]`` widened to int64, the fillers ``0..K-1`` in rows without a route.
    On an accelerator one ``torch.where`` kernel does both; on the host that select costs ~12x a
    plain widening pass (P1), so the host widens and writes the fillers into the few rows
    without a route (in place when ``compact`` is int64 already: it is the read's own buffer)."""
    fillers = torch.arange(k, dtype=torch.int64, device=compact.device)
    if compact.device.type != "cpu":
        return torch.where(valid_t[None, :, None], compact, fillers)
    out = compact.to(torch.int64)
    if not covered.all():
        out[:, torch.from_numpy(np.flatnonzero(~covered))] = fillers
    return out


def _read_counts(rank_rows: RankRows, routes: HandedRoutes, covered: np.ndarray, compact: torch.Tensor,
                 degenerate_rows: np.ndarray, num_layers: int) -> ReadCounts:
    """Per sequence: (row, layer) pairs replayed, degenerate (row, layer) pairs (each pair whose ids
    repeat counts once, as the error counts them, though its row is routed natively in every
    layer), real-token pairs, and the rows handed."""
    seq, n = rank_rows.seq, routes.num_seqs
    lens = rank_rows.plan.seq_lens.numpy()
    real = rank_rows.pos < lens[seq] if seq.size else np.zeros(0, dtype=bool)
    degenerate = np.zeros(n, dtype=np.int64)
    if degenerate_rows.size:
        rows = torch.from_numpy(degenerate_rows).to(compact.device)
        ids = compact[:, rows].sort(-1).values                              # [nl, bad rows, K]
        pairs = (ids[..., 1:] == ids[..., :-1]).any(-1).sum(0).cpu().numpy()
        np.add.at(degenerate, seq[degenerate_rows], pairs)
    return ReadCounts(np.bincount(seq[covered], minlength=n)[:n] * num_layers, degenerate,
                      np.bincount(seq[real], minlength=n)[:n] * num_layers, _handed_rows(routes))


def _handed_rows(routes: HandedRoutes) -> np.ndarray:
    """Rows handed per sequence, 0 for a sequence handed without any route."""
    return np.where(routes.without_routes(), 0, np.asarray(routes.rows, dtype=np.int64))

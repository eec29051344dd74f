"""Multi-turn / resubmit stitching: the one first-seen rule, for engine calls of a rollout.

Every engine call (a multi-turn turn, a resubmitted attempt) returns routes from some start row;
a later prefill re-routes earlier tokens, possibly differently, and the rows that *sampled* each
token are the first ones returned. So rows are appended only past what earlier calls covered
(first-seen wins), overlapping rows are counted (and those that disagree, among rows valid in
both), rows an earlier call lacked are filled, and a gap between calls raises.
:func:`stitch` does it on ReplayBatches, :func:`first_seen_rows` on raw arrays of calls that all
start at row 0 (an inference engine that does not know the model), :func:`rollout_routes` from
vLLM payloads of each sample. Payload decoding is :mod:`r3bridge.engines.decoders`'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from r3bridge.batch.canonical import with_route_kind
from r3bridge.batch.provenance import RouteProvenance, checked_provenance
from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.decoders import decode_vllm_routes
from r3bridge.errors import LayerMappingError, PayloadError, RouteShapeError, StitchError

__all__ = ["stitch", "StitchReport", "first_seen_rows", "rollout_routes"]


@dataclass
class StitchReport:
    """What stitching saw, per sequence: rows present in more than one piece, the subset whose
    routes disagreed (first-seen kept), and rows an earlier piece lacked (invalid) and a later one
    filled."""

    overlap_rows: list[int] = field(default_factory=list)
    disagreeing_rows: list[int] = field(default_factory=list)
    filled_rows: list[int] = field(default_factory=list)

    @property
    def total_disagreeing(self) -> int:
        return sum(self.disagreeing_rows)

    def as_metrics(self, prefix: str = "r3bridge/stitch/") -> dict[str, float]:
        return {f"{prefix}overlap_rows": float(sum(self.overlap_rows)),
                f"{prefix}disagreeing_rows": float(self.total_disagreeing),
                f"{prefix}filled_rows": float(sum(self.filled_rows))}


def stitch(pieces: Sequence[ReplayBatch]) -> tuple[ReplayBatch, StitchReport]:
    """Append-only multi-turn / resubmit stitching: ``pieces[t]`` holds, for every sequence, the
    rows engine call ``t`` returned (possibly none). First-seen valid rows win (they sampled the
    tokens); repeated rows are deduplicated; disagreements are counted; gaps raise. A sequence's
    provenance is that of the first piece that returned rows for it (the pass that sampled its
    earliest tokens; later pieces' provenance is not merged in). Pieces of one sequence from
    different attempts (:attr:`RouteProvenance.attempt`, both known) raise: a retry regenerated
    the tokens, so its rows never fill or follow another attempt's (NeMo RL #4057)."""
    if not pieces:
        raise StitchError("stitch of no pieces")
    a = pieces[0]
    for t, b in enumerate(pieces[1:], 1):
        if (b.layer_ids, b.num_experts, b.topk) != (a.layer_ids, a.num_experts, a.topk):
            raise LayerMappingError(f"stitch: piece {t} has (layer_ids, num_experts, topk) = ({list(b.layer_ids)}, "
                                    f"{b.num_experts}, {b.topk}); piece 0 has ({list(a.layer_ids)}, {a.num_experts}, {a.topk})")
        if b.num_seqs != a.num_seqs:
            raise StitchError(f"stitch: piece {t} has {b.num_seqs} sequences, piece 0 has {a.num_seqs}")
    with_weights = _stitch_weights_present(pieces)
    report = StitchReport()
    seq_routes, seq_valid, seq_start, seq_weights, seq_prov = [], [], [], [], []
    for i in range(a.num_seqs):
        prov = None if a.provenance is None else a.provenance[i]
        seen = None
        for t, p in enumerate(pieces):
            r, v = p.sequence(i)
            if r.shape[0] == 0:
                continue
            w = _piece_weights(p, i) if with_weights else None
            if seen is None:
                prov = None if p.provenance is None else p.provenance[i]
            else:
                _check_same_attempt(i, t, prov, None if p.provenance is None else p.provenance[i])
            seen = _first_seen(seen, r, v, p.start_rows[i], w, where=f"sequence {i}, piece {t}")
        start, routes, valid, weights = (None,) * 4 if seen is None else (seen.start, seen.routes, seen.valid,
                                                                          seen.weights)
        over, dis, fill = (0, 0, 0) if seen is None else (seen.overlap, seen.disagreeing, seen.filled)
        if start is None:
            start, routes = 0, a.routes[:0]
            valid = a.valid[:0]
            weights = None if not with_weights else a.weights[:0]
        report.overlap_rows.append(over)
        report.disagreeing_rows.append(dis)
        report.filled_rows.append(fill)
        seq_routes.append(routes)
        seq_valid.append(valid)
        seq_start.append(start)
        seq_weights.append(weights)
        seq_prov.append(prov)
    if not seq_routes:                     # pieces without sequences: nothing to stitch
        return a, report
    out = ReplayBatch.from_packed(torch.cat(seq_routes), [int(x.shape[0]) for x in seq_routes],
                                  num_experts=a.num_experts, layer_ids=a.layer_ids, start_rows=seq_start,
                                  valid=torch.cat(seq_valid), route_kind=a.route_kind, engine=a.engine,
                                  policy_versions=a.policy_versions,
                                  provenance=None if all(x is None for x in seq_prov) else seq_prov,
                                  weights=torch.cat(seq_weights) if with_weights else None)
    return out, report


def _check_same_attempt(seq: int, piece: int, first: RouteProvenance | None, this: RouteProvenance | None) -> None:
    a = None if first is None else first.attempt
    b = None if this is None else this.attempt
    if a is not None and b is not None and a != b:
        raise StitchError(f"sequence {seq}, piece {piece}: routes of attempt {b} after rows of attempt {a}: a retry "
                          f"regenerates the tokens, so its routes never fill or follow another attempt's; stitch "
                          f"only the pieces of the attempt whose tokens the sample keeps")


def _stitch_weights_present(pieces: Sequence[ReplayBatch]) -> bool:
    """Whether the stitched batch carries weights: all pieces have them or none does (a mix
    would leave some rows without a weight)."""
    have = [p.weights is not None for p in pieces]
    if any(have) and not all(have):
        j = have.index(not have[0])
        raise StitchError(f"stitch: piece {j} {'has' if have[j] else 'lacks'} routing weights, piece 0 "
                          f"{'has' if have[0] else 'lacks'} them")
    return all(have) and bool(have)


def _piece_weights(piece: ReplayBatch, i: int) -> torch.Tensor:
    a, b = int(piece.offsets[i]), int(piece.offsets[i + 1])
    return piece.weights[a:b]  # type: ignore[index]


@dataclass
class _Seen:
    """One sequence's rows so far: first-seen wins."""

    start: int
    routes: torch.Tensor
    valid: torch.Tensor
    weights: torch.Tensor | None
    overlap: int = 0
    disagreeing: int = 0
    filled: int = 0


def _first_seen(seen: _Seen | None, r: torch.Tensor, v: torch.Tensor, s: int, w: torch.Tensor | None, *,
                where: str) -> _Seen:
    """The one first-seen rule: ``r`` (rows from token ``s``, validity ``v``, weights ``w``) merged
    into ``seen``: rows seen valid before are kept (those valid in both that differ are counted),
    rows an earlier piece lacked are filled, rows before or after are added; a gap raises."""
    e = s + r.shape[0]
    if seen is None:
        return _Seen(s, r.clone(), v.clone(), None if w is None else w.clone())
    start, end = seen.start, seen.start + seen.routes.shape[0]
    if s > end or e < start:
        raise StitchError(f"{where}: rows [{s}, {e}) leave a gap after the rows [{start}, {end}) seen so far: "
                          f"cannot stitch unambiguously")
    lo, hi = max(s, start), min(e, end)
    old_r, old_v = seen.routes[lo - start:hi - start], seen.valid[lo - start:hi - start]
    new_r, new_v = r[lo - s:hi - s], v[lo - s:hi - s]
    both = old_v & new_v
    seen.overlap += hi - lo
    if hi > lo:
        seen.disagreeing += int(((old_r != new_r).reshape(hi - lo, -1).any(1) & both).sum())
    take = ~old_v & new_v
    seen.filled += int(take.sum())
    old_r[take] = new_r[take]
    if seen.weights is not None:        # a row's weights travel with its route: first seen wins too
        seen.weights[lo - start:hi - start][take] = w[lo - s:hi - s][take]
    old_v |= new_v
    if s < start:      # rows before anything seen so far
        seen.routes, seen.valid = torch.cat([r[:start - s], seen.routes]), torch.cat([v[:start - s], seen.valid])
        if seen.weights is not None:
            seen.weights = torch.cat([w[:start - s], seen.weights])
        seen.start = s
    if e > end:        # rows after
        seen.routes, seen.valid = torch.cat([seen.routes, r[end - s:]]), torch.cat([seen.valid, v[end - s:]])
        if seen.weights is not None:
            seen.weights = torch.cat([seen.weights, w[end - s:]])
    return seen


def first_seen_rows(calls: Sequence[Any]) -> tuple[np.ndarray, StitchReport]:
    """Calls of one request that all start at row 0, as raw ``[rows, ...]`` arrays (any trailing
    shape, nested lists too) -> (first-seen rows, report). :func:`stitch`'s rule where no schema is
    known yet: every row counts as valid, so overlapping rows that differ are disagreements."""
    if not calls:
        raise PayloadError("no engine call returned routes")
    first = np.asarray(calls[0])
    seen, shape = None, first.shape[1:]
    for t, c in enumerate(calls):
        a = first if t == 0 else np.asarray(c)
        if len(a) == 0:
            continue
        if seen is not None and a.shape[1:] != shape:
            raise RouteShapeError(f"call {t} returned routes of shape [*, {', '.join(map(str, a.shape[1:]))}], "
                                  f"earlier calls [*, {', '.join(map(str, shape))}]")
        shape = a.shape[1:]
        # an engine's array that crossed a process (Ray's object store) is a read-only view: the
        # stitched routes are written, so they get their own copy
        r = torch.from_numpy(a if a.flags.writeable and a.flags.c_contiguous else np.array(a, order="C"))
        if seen is not None:
            r = r.to(seen.routes.dtype)
        seen = _first_seen(seen, r, torch.ones(len(a), dtype=torch.bool), 0, None, where=f"call {t}")
    if seen is None:
        return first, StitchReport([0], [0], [0])
    return seen.routes.numpy(), StitchReport([seen.overlap], [seen.disagreeing], [0])


def rollout_routes(calls: Sequence[Sequence[Any]], *, num_experts: int, moe_layer_ids: Sequence[int],
                   start_rows: Sequence[Sequence[int]] | None = None,
                   report: list | None = None,
                   provenance: Sequence[RouteProvenance | None] | None = None) -> ReplayBatch:
    """``calls[i][t]``: the routes engine call ``t`` of sample ``i`` returned (any vLLM transport,
    :func:`r3bridge.engines.decoders.decode_vllm_routes`), from row 0 of that call's prompt unless ``start_rows[i][t]`` says
    otherwise (vLLM ``routed_experts_prompt_start``). Returns one sequence per sample, first-seen
    rows kept, ``route_kind="rollout"`` and no engine named (the canonical form). ``report`` (a list) receives one :class:`StitchReport` per
    sample. ``provenance``: one per sample, the engine pass its routes came from."""
    provenance = checked_provenance(provenance, len(calls))
    per_sample = []
    for i, sample_calls in enumerate(calls):
        if not sample_calls:
            raise PayloadError(f"sample {i}: no engine call returned routes")
        arrays = [decode_vllm_routes(p, seq=i) for p in sample_calls]
        starts = list(start_rows[i]) if start_rows is not None else [0] * len(arrays)
        prov = None if provenance is None else [provenance[i]]
        pieces = [ReplayBatch.from_vllm([a], num_experts=num_experts, moe_layer_ids=list(moe_layer_ids),
                                        start_rows=[s], provenance=prov) for a, s in zip(arrays, starts)]
        rb, rep = stitch(pieces)
        if report is not None:
            report.append(rep)
        per_sample.append(rb)
    return with_route_kind(ReplayBatch.concat(per_sample), "rollout")

"""The canonical trainer-side form every adapter produces, and the small edits adapters make to a
`ReplayBatch` on the way (docs/porting.md, "Canonical form").

Canonical form: one sequence per sample, ``start_rows = 0``, one row per token the trainer sees,
rows the engine never routed ``valid = False``; the final token's row is dropped when it has no
route (the last sampled token is never fed forward), so a complete single-call rollout of ``N``
tokens has ``N - 1`` rows, like vLLM's own output. ``route_kind`` is ``"rollout"`` for engine routes
and ``"recorded"`` for R2 (the driver checks it against the phase), with no ``engine`` named: the
same routes are the same bytes whichever engine produced them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.decoders import moe_layers_of  # the one MoE-layer selection rule (re-exported for adapters)
from r3bridge.errors import CoverageError

__all__ = ["drop_final_invalid_rows", "canonical_form", "with_empty_sequences", "with_route_kind", "nonzero_rows",
           "moe_layers_of"]


def drop_final_invalid_rows(rb: ReplayBatch) -> ReplayBatch:
    """Drop each sequence's last row when it has no route.

    Only sequences starting at row 0 whose rows cover every trainer token should be passed (the
    padded / jagged trainer formats); the last sampled token is never fed to the engine."""
    if rb.num_seqs == 0 or rb.total_rows == 0:
        return rb
    rows = torch.tensor(rb.rows_per_seq, dtype=torch.int64)
    ends = rb.offsets[1:] - 1
    has = rows > 0
    drop = torch.zeros(rb.num_seqs, dtype=torch.bool)
    drop[has] = ~rb.valid.cpu()[ends[has]]
    if not bool(drop.any()):
        return rb
    keep = torch.ones(rb.total_rows, dtype=torch.bool)
    keep[ends[drop]] = False
    keep_d = keep.to(rb.routes.device)
    return ReplayBatch.from_packed(rb.routes[keep_d], (rows - drop.long()).tolist(), num_experts=rb.num_experts,
                                   layer_ids=rb.layer_ids, start_rows=rb.start_rows, valid=rb.valid[keep_d],
                                   route_kind=rb.route_kind, engine=rb.engine, policy_versions=rb.policy_versions,
                                   provenance=rb.provenance,
                                   weights=None if rb.weights is None else rb.weights[keep_d])


def canonical_form(rb: ReplayBatch, seq_lens: Sequence[int]) -> ReplayBatch:
    """Extend each sequence (start 0) with invalid rows up to its token count, then drop a final
    row without a route."""
    if any(s != 0 for s in rb.start_rows):
        raise CoverageError("canonical form needs routes starting at token 0")
    lens = [int(n) for n in seq_lens]
    if len(lens) != rb.num_seqs:
        raise CoverageError(f"{len(lens)} seq_lens for {rb.num_seqs} sequences")
    seqs, valids, weights = [], [], []
    for i, n in enumerate(lens):
        r, v = rb.sequence(i)
        if r.shape[0] > n:
            raise CoverageError(f"sequence {i}: {r.shape[0]} route rows for {n} tokens")
        pad = n - r.shape[0]
        seqs.append(torch.cat([r, torch.zeros((pad,) + tuple(r.shape[1:]), dtype=r.dtype, device=r.device)]))
        valids.append(torch.cat([v, torch.zeros(pad, dtype=torch.bool, device=v.device)]))
        if rb.weights is not None:
            a = int(rb.offsets[i])
            w = rb.weights[a:a + r.shape[0]]
            weights.append(torch.cat([w, torch.zeros((pad,) + tuple(w.shape[1:]), dtype=w.dtype, device=w.device)]))
    full = ReplayBatch.from_packed(torch.cat(seqs) if seqs else rb.routes, lens, num_experts=rb.num_experts,
                                   layer_ids=rb.layer_ids, valid=torch.cat(valids) if valids else rb.valid,
                                   route_kind=rb.route_kind, engine=rb.engine, policy_versions=rb.policy_versions,
                                   provenance=rb.provenance,
                                   weights=None if rb.weights is None else (torch.cat(weights) if weights
                                                                            else rb.weights))
    return drop_final_invalid_rows(full)


def with_empty_sequences(rb: ReplayBatch, seq_lens: Sequence[int]) -> ReplayBatch:
    """``rb`` followed by one sequence without any route per entry of ``seq_lens`` (packing
    padding the trainer runs as a sequence): zero rows, starting past its last token."""
    lens = [int(n) for n in seq_lens]
    if not lens:
        return rb
    empty = ReplayBatch.from_packed(torch.zeros((0, rb.num_layers, rb.topk), dtype=rb.routes.dtype),
                                    [0] * len(lens), num_experts=rb.num_experts, layer_ids=rb.layer_ids,
                                    start_rows=lens, route_kind=rb.route_kind, engine=rb.engine)
    if rb.weights is not None:      # zero rows of weights: concat keeps the batch's weights
        empty = empty.with_weights(torch.zeros((0, rb.num_layers, rb.topk), dtype=rb.weights.dtype))
    # on the batch's device: a framework may hand its routes to the adapter on the GPU (first GPU run,
    # 2026-11-26: torch.cat of CUDA routes with these CPU rows failed in compute_logp)
    return ReplayBatch.concat([rb, empty.to(rb.routes.device)])


def with_route_kind(rb: ReplayBatch, route_kind: str, engine: Optional[str] = None) -> ReplayBatch:
    """The same routes tagged with another route kind and engine (e.g. vLLM ingest's ``("rollout",
    "vllm")`` -> the canonical ``("rollout", None)``)."""
    if (rb.route_kind, rb.engine) == (route_kind, engine):
        return rb
    return ReplayBatch(rb.routes, rb.valid, rb.rows_per_seq, rb.start_rows, rb.layer_ids, rb.num_experts,
                       rb.topk, route_kind, rb.policy_versions, rb.offsets, rb.provenance, weights=rb.weights,
                       engine=engine)


def nonzero_rows(routes: torch.Tensor, *, recorded: bool = False) -> torch.Tensor:
    """Validity of dense rows ``[..., L, K]`` in a transport that writes "no route" as a zero row
    (field notes 7). A row of distinct top-k ids is never all zero when ``K > 1``; with
    ``K == 1`` an expert-0 row cannot be told from "no route" and is routed natively (counted in
    coverage), except in ``recorded`` routes, whose every row is real.

    The one rule (docs/porting.md, "No route"): "no route" is explicit, a validity field or an
    in-band value no expert id takes (:func:`r3bridge.dense_routes`); this function is the only
    place validity is inferred from zeros, for transports that have neither."""
    if recorded and routes.shape[-1] == 1:
        return torch.ones(routes.shape[:-2], dtype=torch.bool, device=routes.device)
    return (routes != 0).flatten(-2).any(-1)


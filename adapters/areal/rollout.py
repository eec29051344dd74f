"""AReaL's rollout side: a trajectory's SGLang responses -> :class:`r3bridge.ReplayBatch` (no areal
import), stitched first-seen (:mod:`r3bridge.rollout.stitching`; one request's resubmits:
:mod:`r3bridge.adapters.areal.attempts`). docs/use-with-areal.md, "What happens where".

AReaL's workflows run a trajectory as parent-concat turns: each turn's request is the whole
conversation so far, so each call's routes cover its own tokens from row 0. A call is kept only as
far as its tokens agree with the final trajectory (:func:`trajectory_routes`), its top-k checked
first (:func:`check_flat_topk`: SGLang's flat ``[rows, L * K]`` rows, as AReaL keeps them).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.decoders import select_layers
from r3bridge.errors import PayloadError, RouteShapeError, StitchError
from r3bridge.parallel.handed import naming_samples
from r3bridge.rollout.stitching import first_seen_rows

__all__ = ["routes_from_responses", "trajectory_routes", "flat_trajectory_routes", "check_flat_topk", "sample_name",
           "StitchedTrajectory"]


class StitchedTrajectory(NamedTuple):
    """A trajectory's routes and what its stitching saw: ``overlap_rows`` rows that more than one
    turn returned (a later turn re-prefilling earlier tokens, often from SGLang's radix cache),
    ``disagreeing_rows`` of those whose later copy differed from the first-seen one (counted, the
    first-seen rows replayed: r3bridge.rollout.stitching says why)."""
    routes: ReplayBatch
    overlap_rows: int
    disagreeing_rows: int


def routes_from_responses(responses: Sequence[Any], tokens: Sequence[int], *, num_experts: int, num_layers: int,
                          topk: int, moe_layer_ids: Sequence[int], sample: Optional[str] = None) -> StitchedTrajectory:
    """One trajectory from its ``ModelResponse``s (one per turn, root first) and its final tokens:
    each one's ``routed_experts`` (``[rows, L_all*K]``, deduplicated across resubmits) covers its own
    ``input_tokens + output_tokens`` from row 0 (:func:`flat_trajectory_routes`)."""
    calls = [(getattr(r, "routed_experts", None), list(r.input_tokens) + list(r.output_tokens)) for r in responses]
    return flat_trajectory_routes(calls, tokens, num_experts=num_experts, num_layers=num_layers, topk=topk,
                                  moe_layer_ids=moe_layer_ids, sample=sample, framework="AReaL")


def check_flat_topk(routes: Any, *, num_layers: int, topk: int, sample: Any, turn: int = 0,
                    framework: str = "") -> None:
    """One call's routes decoded flat (``[token rows, num_layers * K]``: SGLang's, as AReaL keeps
    them) against the model's top-k, before anything reshapes them: ``RouteShapeError`` naming the
    sample, the turn, the first token and layer that cannot be read, and both top-k values."""
    shape = tuple(getattr(routes, "shape", ()))
    if len(shape) != 2:
        return                                   # base64 or None: the decoder checks those
    rows, width = int(shape[0]), int(shape[1])
    if width == num_layers * topk:
        return
    theirs = f"top-{width // num_layers}" if width % num_layers == 0 else f"{width} ids per token row"
    who = f"{framework} sample" if framework else "sample"
    raise RouteShapeError(
        f"{who} {sample}, turn {turn}: routes at token 0, layer 0 (and every one of the {rows} token rows) carry "
        f"{theirs} ({width} ids per token for {num_layers} layers); the model's config says top-{topk} "
        f"(num_experts_per_tok): the rollout engine serves another model or config")


def _agreeing_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    differ = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(differ.argmax()) if differ.any() else n


def trajectory_routes(calls: Sequence[tuple[Any, Sequence[int]]], tokens: Sequence[int], *, num_experts: int,
                      moe_layer_ids: Sequence[int], engine: str = "SGLang", sample: Optional[str] = None,
                      framework: str = "") -> StitchedTrajectory:
    """One trajectory from its calls, root first: each ``(routes [rows, L_all, K] from row 0, the
    call's own tokens)``, kept only while its token prefix agrees with the final ``tokens`` (a turn
    whose prompt rewrote the context keeps nothing past the divergence), every kept row's ids
    checked (also rows a later turn repeats: bad input is refused wherever it is, not dropped because
    an earlier turn saw the row first), stitched first-seen in one pass, the MoE layers selected,
    then one sequence in canonical form for ``len(tokens)`` tokens (the final row dropped when no
    call routed it). Errors name ``sample`` (and the turn) where given."""
    tokens = list(tokens)
    kept = [np.asarray(rows)[:min(len(rows), _agreeing_prefix(own, tokens))] for rows, own in calls]
    if not kept:
        raise PayloadError("no turn returned routes")
    moe = list(moe_layer_ids)
    who = f"{framework} sample {sample}" if framework else f"sample {sample}"
    for turn, rows in enumerate(kept):
        if len(rows) and rows.ndim == 3:
            with naming_samples([f"{who}, turn {turn}"] if sample is not None else []):
                ReplayBatch.from_ragged([select_layers(rows, moe, 0, engine)], num_experts=num_experts, layer_ids=moe,
                                        route_kind="rollout")
    rows, report = first_seen_rows(kept)
    rows = select_layers(rows, moe, 0, engine)
    n, got = len(tokens), int(rows.shape[0])
    if got > n:
        raise StitchError(f"{who if sample is not None else 'a trajectory'}: {got} route rows for {n} tokens")
    keep = n if got == n else max(n - 1, 0)
    full = np.zeros((keep,) + tuple(rows.shape[1:]), dtype=rows.dtype)
    full[:got] = rows
    with naming_samples([who] if sample is not None else []):
        rb = ReplayBatch.from_ragged([full], num_experts=num_experts, layer_ids=moe, valid=[np.arange(keep) < got],
                                     route_kind="rollout")
    return StitchedTrajectory(rb, int(sum(report.overlap_rows)), int(report.total_disagreeing))


def sample_name(data: Any, num_tokens: int, keys: Sequence[str] = ("query_id", "id", "uid", "index")) -> str:
    """How an error names an episode's sample: the dataset's id (the first of ``keys`` a dict
    ``data`` holds), else its token count."""
    for key in keys:
        if isinstance(data, dict) and data.get(key) is not None:
            return f"{key}={data[key]!r}"
    return f"(the episode of {num_tokens} tokens)"


def flat_trajectory_routes(calls: Sequence[tuple[Any, Sequence[int]]], tokens: Sequence[int], *, num_experts: int,
                           num_layers: int, topk: int, moe_layer_ids: Sequence[int], sample: Optional[str] = None,
                           framework: str = "") -> StitchedTrajectory:
    """:func:`trajectory_routes` of calls whose routes are flat, ``[rows, num_layers * K]`` (SGLang's
    decoded rows): with ``sample`` (the trajectory's name, :func:`sample_name`), every call's top-k
    is checked first, before anything reshapes them (:func:`check_flat_topk`: a clear error naming
    the turn); a call without routes is refused naming its turn."""
    if sample is not None:
        for turn, (rows, _) in enumerate(calls):
            check_flat_topk(rows, num_layers=num_layers, topk=topk, sample=sample, turn=turn, framework=framework)
    shaped = []
    for turn, (rows, own_tokens) in enumerate(calls):
        if rows is None:
            raise PayloadError(f"turn {turn}: the response has no routed_experts (return_routed_experts off?)")
        shaped.append((np.asarray(rows).reshape(len(rows), num_layers, topk), own_tokens))
    return trajectory_routes(shaped, tokens, num_experts=num_experts, moe_layer_ids=moe_layer_ids, sample=sample,
                             framework=framework)

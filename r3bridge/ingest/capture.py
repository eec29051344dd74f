"""Rollout-side capture: a sample's engine calls, as an adapter sees them inside a framework's
rollout loop, turned into first-seen routes (the rule is :mod:`r3bridge.ingest.stitching`'s).

A framework's rollout loop (verl's agent loop, SkyRL's generator, AReaL's workflows) calls its
inference engine several times per sample: one call per turn, a resubmit after an interruption,
a retry. Each call returns routes from row 0 of its own prompt; a later prefill re-routes
earlier tokens, possibly differently, so the rows that *sampled* each token are the first ones
returned. What every adapter needs there, with its framework's objects mapped onto it:

* :class:`StitchedRollout` - the :class:`~r3bridge.protocols.RolloutIngest` of a loop whose
  calls return vLLM-style routes: each sample's calls stitched first-seen;
* :class:`CallLog` - one sample's calls (routes, the engine's output for its provenance) and
  their attempts: a call whose prompt does not continue what the calls before it produced
  regenerates, so it starts the next attempt (NeMo RL #4057; verl's tool agent loop);
* :func:`checked_calls` / :func:`check_flat_topk` - each call's ``[rows, num_hidden_layers, K]``
  shape, or a flat ``[rows, num_hidden_layers * K]`` one's top-k, naming the sample;
* :func:`merge_first_seen` - a per-sample routes list accumulated over turns (SkyRL 0.3's), and
  :func:`first_seen_update` - a framework's per-turn state update made first-seen with it;
* :func:`trajectory_routes` - a trajectory's calls, each kept only as far as its tokens agree with
  the final trajectory (AReaL's parent-concat turns), stitched into one canonical sequence
  (:func:`flat_trajectory_routes`: of flat ``[rows, L * K]`` calls, each turn's top-k checked);
* :class:`RequestAttempts` - what each attempt of one request returned, per asyncio task
  (AReaL's resubmits after an interruption);
* :func:`reprefill_metrics` - the per-sample re-prefill counts of a batch as metrics.
"""
from __future__ import annotations

import contextvars
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

import numpy as np

from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.decoders import select_layers
from r3bridge.errors import PayloadError, RouteShapeError, StitchError
from r3bridge.ingest.stitching import first_seen_rows, rollout_routes

__all__ = ["StitchedRollout", "CallLog", "checked_calls", "check_flat_topk", "merge_first_seen", "first_seen_update",
           "trajectory_routes", "flat_trajectory_routes", "RequestAttempts", "reprefill_metrics", "sample_name"]

T = TypeVar("T")


class StitchedRollout:
    """``routes_from_rollout(engine_outputs, start_rows=None)``: ``engine_outputs[i][t]`` is what
    engine call ``t`` of sample ``i`` returned (any vLLM transport,
    :func:`r3bridge.engines.decoders.decode_vllm_routes`; ``None``: the call was aborted), from row 0 of
    its prompt unless ``start_rows[i][t]`` says otherwise -> one first-seen sequence per sample,
    the MoE layers, ``route_kind="rollout"``. A sample whose every call aborted trains without routes
    (no rows, the model's ``topk``; without it, refused)."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], topk: Optional[int] = None) -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]
        self.topk = None if topk is None else int(topk)

    def routes_from_rollout(self, engine_outputs: Sequence[Sequence[Any]],
                            start_rows: Optional[Sequence[Sequence[int]]] = None) -> ReplayBatch:
        per_sample = []
        for i, calls in enumerate(engine_outputs):
            starts = list(start_rows[i]) if start_rows is not None else [0] * len(calls)
            kept = [(c, s) for c, s in zip(calls, starts) if c is not None]
            if not kept and self.topk is not None:      # every call aborted: no rows, the model's top-k
                empty = np.zeros((0, len(self.moe_layer_ids), self.topk), dtype=np.uint8)
                per_sample.append(ReplayBatch.from_ragged([empty], num_experts=self.num_experts,
                                                          layer_ids=self.moe_layer_ids, route_kind="rollout"))
                continue
            if not kept:
                raise PayloadError(f"sample {i}: no engine call returned routes")
            per_sample.append(rollout_routes([[c for c, _ in kept]], num_experts=self.num_experts,
                                             moe_layer_ids=self.moe_layer_ids, start_rows=[[s for _, s in kept]]))
        return ReplayBatch.concat(per_sample)


class CallLog:
    """One sample's engine calls in call order: :attr:`calls` (each call's routes, those that
    returned some), :attr:`outputs` (the engine's output of each: where its provenance is read)
    and :attr:`attempts` (the attempt each belongs to)."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.outputs: list[Any] = []
        self.attempts: list[int] = []
        self._attempt = 0
        self._context: Optional[list[int]] = None

    def record(self, prompt_ids: Optional[Sequence[int]], output_ids: Optional[Sequence[int]], routes: Any,
               output: Any = None) -> None:
        """One call: its prompt and generated token ids (numbering the attempt), its routes
        (``None``: the call returned none, it is not kept) and the engine's output."""
        prompt = [int(x) for x in prompt_ids or []]
        if self._context is not None and prompt[:len(self._context)] != self._context:
            self._attempt += 1                     # the output before is thrown away: a retry
        self._context = prompt + [int(x) for x in output_ids or []]
        if routes is not None:
            self.calls.append(routes)
            self.outputs.append(output)
            self.attempts.append(self._attempt)


def checked_calls(calls: Sequence[Any], *, num_hidden_layers: int, topk: Optional[int] = None,
                  sample: str = "", what: str = "routed_experts") -> None:
    """Each call's routes ``[rows, num_hidden_layers, K]`` (every decoder layer, as vLLM / SGLang
    report them) of the model's top-k, else ``RouteShapeError`` naming the sample and the call."""
    where = f"sample {sample}: " if sample else ""
    for t, call in enumerate(calls):
        shape = np.shape(call)
        if len(shape) != 3 or shape[1] != num_hidden_layers:
            raise RouteShapeError(f"{where}server call {t} returned {what} of shape {list(shape)}; "
                                  f"expected [rows, num_hidden_layers={num_hidden_layers}, topk]")
        if topk is not None and shape[2] != topk:
            raise RouteShapeError(f"{where}server call {t} returned {what} with top-k {shape[2]}, "
                                  f"the model routes top-{topk} (num_experts_per_tok)")


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


def merge_first_seen(previous: Optional[list], new: Optional[list]) -> Optional[list]:
    """A sample's routes as nested lists ``[rows, L, K]`` accumulated over turns, first-seen (both
    from row 0: each turn's prompt is the whole conversation)."""
    if new is None:
        return previous
    if previous is None or len(previous) == 0:
        return list(new)
    return first_seen_rows([previous, new])[0].tolist()


def first_seen_update(update: Callable[[Any, Any], Any], state: Any, turn: Any, field: str) -> Any:
    """``update(state, turn)``, a framework's per-turn update that replaces ``state.<field>`` with
    ``turn.<field>`` (a sample's routes from row 0), with the turn's routes merged first-seen into
    the earlier turns' rows instead (:func:`merge_first_seen`)."""
    previous = getattr(state, field)
    state = update(state, turn)
    if getattr(state, field) is not None:
        setattr(state, field, merge_first_seen(previous, getattr(turn, field)))
    return state


def _agreeing_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    differ = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(differ.argmax()) if differ.any() else n


def trajectory_routes(calls: Sequence[tuple[Any, Sequence[int]]], tokens: Sequence[int], *, num_experts: int,
                      moe_layer_ids: Sequence[int], engine: str = "SGLang") -> ReplayBatch:
    """One trajectory from its calls, root first: each ``(routes [rows, L_all, K] from row 0, the
    call's own tokens)``, kept only while its token prefix agrees with the final ``tokens`` (a turn
    whose prompt rewrote the context keeps nothing past the divergence), stitched first-seen in
    one pass, the MoE layers selected, then one sequence in canonical form for ``len(tokens)``
    tokens (the final row dropped when no call routed it)."""
    tokens = list(tokens)
    kept = [np.asarray(rows)[:min(len(rows), _agreeing_prefix(own, tokens))] for rows, own in calls]
    if not kept:
        raise PayloadError("no turn returned routes")
    rows, _ = first_seen_rows(kept)
    moe = list(moe_layer_ids)
    rows = select_layers(rows, moe, 0, engine)
    n, got = len(tokens), int(rows.shape[0])
    if got > n:
        raise StitchError(f"{got} route rows for {n} tokens")
    keep = n if got == n else max(n - 1, 0)
    full = np.zeros((keep,) + tuple(rows.shape[1:]), dtype=rows.dtype)
    full[:got] = rows
    return ReplayBatch.from_ragged([full], num_experts=num_experts, layer_ids=moe, valid=[np.arange(keep) < got],
                                   route_kind="rollout")


class RequestAttempts:
    """What every attempt of one engine request returned (a resubmit after an interruption sends
    the request again): the engine's client :meth:`record` s each attempt's result while
    :meth:`around` runs the request, in a context variable, so concurrent requests never see each
    other's."""

    def __init__(self, name: str = "r3bridge_attempts") -> None:
        self._attempts: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar(name, default=None)

    def record(self, item: Any) -> None:
        attempts = self._attempts.get()
        if attempts is not None:
            attempts.append(item)

    async def around(self, request: Callable[[], Awaitable[T]]) -> tuple[T, Optional[list]]:
        """``(request's result, what each of its attempts returned)``; ``None`` for the attempts
        when an outer :meth:`around` already collects them (the outer one stitches)."""
        if self._attempts.get() is not None:
            return await request(), None
        token = self._attempts.set([])
        try:
            result = await request()
            return result, self._attempts.get()
        finally:
            self._attempts.reset(token)


def reprefill_metrics(overlap: Sequence[Any], disagreeing: Sequence[Any],
                      prefix: str = "r3bridge/rollout/") -> dict[str, float]:
    """A batch's per-sample re-prefill counts (:class:`~r3bridge.ingest.stitching.StitchReport`'s
    ``overlap_rows`` / ``disagreeing_rows``; ``None`` for samples that have none) as
    ``{prefix}reprefill_rows``, ``{prefix}reprefill_disagreeing_rows`` and their ratio."""
    total_overlap = float(sum(float(v) for v in overlap if v is not None))
    total_disagreeing = float(sum(float(v) for v in disagreeing if v is not None))
    return {f"{prefix}reprefill_rows": total_overlap, f"{prefix}reprefill_disagreeing_rows": total_disagreeing,
            f"{prefix}reprefill_disagreement": total_disagreeing / total_overlap if total_overlap else 0.0}


def sample_name(data: Any, num_tokens: int, keys: Sequence[str] = ("query_id", "id", "uid", "index")) -> str:
    """How an error names an episode's sample: the dataset's id (the first of ``keys`` a dict
    ``data`` holds), else its token count."""
    for key in keys:
        if isinstance(data, dict) and data.get(key) is not None:
            return f"{key}={data[key]!r}"
    return f"(the episode of {num_tokens} tokens)"


def flat_trajectory_routes(calls: Sequence[tuple[Any, Sequence[int]]], tokens: Sequence[int], *, num_experts: int,
                           num_layers: int, topk: int, moe_layer_ids: Sequence[int], sample: Optional[str] = None,
                           framework: str = "") -> ReplayBatch:
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
    return trajectory_routes(shaped, tokens, num_experts=num_experts, moe_layer_ids=moe_layer_ids)


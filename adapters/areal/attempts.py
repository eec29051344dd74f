"""One SGLang request's attempts (the first submit, then every resubmit after an interruption)
-> one sequence of first-seen routes, as AReaL's client makes them.

SGLang returns each attempt's routes from row 0 (``meta_info["routed_experts"]``); AReaL 1.0.4's
client concatenates the attempts' arrays (AReaL #1207), repeating the prefix. The attempts'
``meta_info`` (:class:`RequestAttempts` collects them, recorded at AReaL's backend by the one call
recorder, :class:`~r3bridge.rollout.forwarding.CallRecorder`) are stitched first-seen here instead
(:mod:`r3bridge.rollout.stitching`). :func:`generate_first_seen` does the whole of it for one
generate call of a client: its backend wrapped (:class:`RecordingBackend`), the attempts seen,
stitched; their provenance is the one rule's (:func:`r3bridge.rollout.provenance.first_seen_provenance`).
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

import numpy as np

from r3bridge.batch.provenance import RouteProvenance, reported_int, sglang_provenance
from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.decoders import decode_sglang_routes, select_layers, sglang_rows
from r3bridge.rollout.forwarding import CallRecorder, RecordedCall
from r3bridge.rollout.provenance import first_seen_provenance
from r3bridge.rollout.stitching import first_seen_rows, stitch

__all__ = ["RequestAttempts", "decode_sglang", "routes_from_attempts", "AttemptRows", "first_seen_attempts",
           "attempt_provenance", "RecordingBackend", "generate_first_seen"]

T = TypeVar("T")


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


_ATTEMPTS = RequestAttempts("r3bridge_sglang_attempts")   # each attempt's meta_info, per generate call (per task)


def decode_sglang(meta_info: dict, *, num_layers: int, topk: int, seq: int = 0) -> np.ndarray:
    """One SGLang response's ``meta_info`` -> int32 ``[prompt + completion - 1, L_all, K]`` (the
    row count checked when the response reports its token counts). Also accepts an already
    decoded ``[rows, L_all*K]`` array as ``routed_experts``."""
    rows = sglang_rows(meta_info, seq=seq) if {"prompt_tokens", "completion_tokens"} <= set(meta_info) else None
    return decode_sglang_routes(meta_info.get("routed_experts"), num_layers=num_layers, topk=topk, rows=rows, seq=seq)


def routes_from_attempts(meta_infos: Sequence[dict], *, num_experts: int, num_layers: int, topk: int,
                         moe_layer_ids: Sequence[int]) -> ReplayBatch:
    """All SGLang responses of one request -> one sequence, the MoE layers, duplicates removed
    first-seen."""
    moe = list(moe_layer_ids)
    decoded = [select_layers(decode_sglang(m, num_layers=num_layers, topk=topk), moe, 0, "SGLang") for m in meta_infos]
    pieces = [ReplayBatch.from_ragged([d], num_experts=num_experts, layer_ids=moe, route_kind="rollout")
              for d in decoded]
    return stitch(pieces)[0]


@dataclass(frozen=True)
class AttemptRows:
    """A request's first-seen rows (``[tokens - 1, L_all*K]`` int32: the client need not know the
    model), how many resubmits returned routes, how many overlapping rows they routed differently,
    and the first attempt's ``meta_info`` (where the rows' provenance is read)."""

    rows: np.ndarray
    resubmits: int
    disagreeing_rows: int
    first: dict


def first_seen_attempts(attempts: Optional[Sequence[dict]]) -> Optional[AttemptRows]:
    """The attempts' ``meta_info`` that carry ``routed_experts``, stitched (``None``: none do)."""
    with_routes = [m for m in attempts or () if m.get("routed_experts") is not None]
    if not with_routes:
        return None
    rows, report = first_seen_rows([decode_sglang_routes(m["routed_experts"], rows=sglang_rows(m, seq=0))
                                    for m in with_routes])
    return AttemptRows(rows, len(with_routes) - 1, report.total_disagreeing, with_routes[0])


def attempt_provenance(meta_info: dict, token_versions: Optional[Sequence[Any]], *,
                       engine: str = "sglang") -> tuple[RouteProvenance, RouteProvenance]:
    """(route, log-prob provenance) of first-seen rows from the attempt of ``meta_info``: the routes
    are that attempt's pass (:func:`r3bridge.batch.provenance.sglang_provenance`: SGLang's
    ``num_retractions``, numeric ``weight_version``; miles #3277); its first tokens' log-probs were
    sampled in the first pass (epoch 0) under the first reported of ``token_versions`` (AReaL's
    weight version of each output token; ``None``: unknown)."""
    first = next((v for v in (token_versions or []) if reported_int(v) is not None), None)
    return first_seen_provenance(sglang_provenance(meta_info, engine=engine), sampled_version=first)


class RecordingBackend(CallRecorder):
    """A client's SGLang backend (``inner``) whose method named ``parse`` (one attempt's response
    JSON parsed) also records that response's ``meta_info`` for the generate call in flight
    (:func:`generate_first_seen`); every other attribute is ``inner``'s."""

    def __init__(self, inner: Any, parse: str) -> None:
        super().__init__(inner, parse, record=_record_meta_info)


def _record_meta_info(call: RecordedCall) -> None:
    _ATTEMPTS.record(call.args[0].get("meta_info", {}))


async def generate_first_seen(generate: Callable[[], Awaitable[T]], client: Any, *, parse: str,
                              backend: str = "backend") -> tuple[T, Optional[AttemptRows]]:
    """``generate()`` (one request of ``client``, which resubmits it after an interruption), with
    every attempt's SGLang response seen: ``client.<backend>`` is wrapped once in a
    :class:`RecordingBackend` recording what its method ``parse`` parses (on the instance:
    composition, no class patched). Returns the request's result and its attempts' rows stitched
    first-seen (:func:`first_seen_attempts`; ``None``: no attempt returned routes, or an outer
    call collects the attempts and stitches them)."""
    if hasattr(client, backend) and not isinstance(getattr(client, backend), RecordingBackend):
        setattr(client, backend, RecordingBackend(getattr(client, backend), parse))
    result, attempts = await _ATTEMPTS.around(generate)
    return result, first_seen_attempts(attempts)

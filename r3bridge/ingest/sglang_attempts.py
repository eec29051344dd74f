"""One SGLang request's attempts (the first submit, then every resubmit after an interruption)
-> one sequence of first-seen routes.

SGLang returns each attempt's routes from row 0 (``meta_info["routed_experts"]``); a client that
concatenates the attempts' arrays (AReaL 1.0.4, AReaL #1207) repeats the prefix. The attempts'
``meta_info`` (:class:`r3bridge.ingest.capture.RequestAttempts` collects them) are stitched
first-seen here instead (:mod:`r3bridge.ingest.stitching`). :func:`generate_first_seen` does the
whole of it for one generate call of a client: its backend wrapped (:class:`RecordingBackend`), the
attempts seen, stitched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

import numpy as np

from r3bridge.batch.provenance import RouteProvenance, reported_int, sglang_provenance
from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.decoders import decode_sglang_routes, select_layers, sglang_rows
from r3bridge.ingest.capture import RequestAttempts
from r3bridge.ingest.forwarding import Intercepting
from r3bridge.ingest.stitching import first_seen_rows, stitch

__all__ = ["decode_sglang", "routes_from_attempts", "AttemptRows", "first_seen_attempts", "attempt_provenance",
           "RecordingBackend", "generate_first_seen"]

T = TypeVar("T")
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
    sampled in the first pass (epoch 0) under the first reported of ``token_versions`` (the
    client's weight version of each output token; ``None``: unknown)."""
    routes = sglang_provenance(meta_info, engine=engine)
    first = next((v for v in (token_versions or []) if reported_int(v) is not None), None)
    return routes, RouteProvenance(engine, routes.request_id, first, None if routes.epoch is None else 0)


class RecordingBackend(Intercepting):
    """A client's SGLang backend (``inner``) whose method named ``parse`` (one attempt's response
    JSON parsed) also records that response's ``meta_info`` for the generate call in flight
    (:func:`generate_first_seen`); every other attribute is ``inner``'s."""

    def __init__(self, inner: Any, parse: str) -> None:
        super().__init__(inner, parse, _recording)


def _recording(parse: Callable[..., Any]) -> Callable[..., Any]:
    def recording(response: dict, *args: Any, **kwargs: Any) -> Any:
        out = parse(response, *args, **kwargs)
        _ATTEMPTS.record(response.get("meta_info", {}))
        return out
    return recording


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

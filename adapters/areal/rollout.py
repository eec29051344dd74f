"""AReaL's rollout side: SGLang responses -> :class:`r3bridge.ReplayBatch` (no areal import).

Rollout side. SGLang returns ``meta_info["routed_experts"]``: base64 of flat int32, token-major,
``prompt_tokens + completion_tokens - 1`` rows of ``num_hidden_layers * K`` ids, *from row 0 of the
request*. AReaL 1.0.4's ``RemoteInfEngine.agenerate`` resubmits an interrupted request with the
tokens generated so far appended to the prompt and ``np.concatenate``s every attempt's routes, so
the prefix is duplicated (AReaL #1207: ~2.4% of samples zeroed downstream). Multi-turn workflows
("parent-concat": each turn's prompt is the previous turn's prompt + output + new message) get the
whole context re-routed by every turn's prefill. Both are stitched first-seen here: rows an
earlier call returned are kept (they sampled those tokens), later calls only add rows past them,
and rows are kept only as far as the call's tokens agree with the final trajectory.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.decoders import decode_sglang_routes, select_layers, sglang_rows
from r3bridge.errors import PayloadError, StitchError
from r3bridge.ingest.stitching import first_seen_rows, stitch

__all__ = ["ArealRollout", "decode_sglang", "first_seen_rows", "routes_from_attempts", "routes_from_responses"]


class ArealRollout:
    """The :class:`r3bridge.protocols.RolloutIngest` of AReaL's workflows: one trajectory's
    ``ModelResponse`` list (one per turn, root first) and its final tokens."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_layers: int, topk: int) -> None:
        self.num_experts, self.num_layers, self.topk = int(num_experts), int(num_layers), int(topk)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]

    def routes_from_rollout(self, engine_outputs: tuple[Sequence[Any], Sequence[int]]) -> ReplayBatch:
        responses, tokens = engine_outputs
        return routes_from_responses(responses, tokens, num_experts=self.num_experts, num_layers=self.num_layers,
                                     topk=self.topk, moe_layer_ids=self.moe_layer_ids)


def decode_sglang(meta_info: dict, *, num_layers: int, topk: int, seq: int = 0) -> np.ndarray:
    """One SGLang response's ``meta_info`` -> int32 ``[prompt + completion - 1, L_all, K]`` (the
    row count checked when the response reports its token counts). Also accepts AReaL's already
    decoded ``[rows, L_all*K]`` array as ``routed_experts``."""
    rows = sglang_rows(meta_info, seq=seq) if {"prompt_tokens", "completion_tokens"} <= set(meta_info) else None
    return decode_sglang_routes(meta_info.get("routed_experts"), num_layers=num_layers, topk=topk, rows=rows, seq=seq)


def _piece(arr: np.ndarray, *, num_experts: int, moe_layer_ids: Sequence[int], rows: Optional[int] = None) -> ReplayBatch:
    moe = list(moe_layer_ids)
    a = select_layers(arr[: arr.shape[0] if rows is None else rows], moe, 0, "SGLang")
    return ReplayBatch.from_ragged([a], num_experts=num_experts, layer_ids=moe, route_kind="rollout")


def routes_from_attempts(meta_infos: Sequence[dict], *, num_experts: int, num_layers: int, topk: int,
                         moe_layer_ids: Sequence[int]) -> ReplayBatch:
    """All SGLang responses of one request (first submit, then every resubmit after an
    interruption) -> one sequence, duplicates removed first-seen."""
    pieces = [_piece(decode_sglang(m, num_layers=num_layers, topk=topk, seq=0), num_experts=num_experts,
                     moe_layer_ids=moe_layer_ids) for m in meta_infos]
    rb, _ = stitch(pieces)
    return rb


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(x.argmax()) if x.any() else n


def routes_from_responses(responses: Sequence[Any], tokens: Sequence[int], *, num_experts: int,
                          num_layers: int, topk: int, moe_layer_ids: Sequence[int]) -> ReplayBatch:
    """One trajectory from its ``ModelResponse``s (one per turn, root first: parent-concat) and
    its final token list. Each response's ``routed_experts`` (``[rows, L_all*K]``, already deduped
    across resubmits) covers its own ``input_tokens + output_tokens`` from row 0; only rows whose
    whole token prefix agrees with ``tokens`` are kept. The turns are stitched in one first-seen
    pass on the arrays (:func:`r3bridge.ingest.stitching.first_seen_rows`, the core's one rule) and the
    trajectory is built and checked once, in canonical form for ``len(tokens)`` tokens."""
    tokens = list(tokens)
    calls = []
    for t, r in enumerate(responses):
        arr = getattr(r, "routed_experts", None)
        if arr is None:
            raise PayloadError(f"turn {t}: the response has no routed_experts (return_routed_experts off?)")
        arr = np.asarray(arr).reshape(len(arr), num_layers, topk)
        own = list(r.input_tokens) + list(r.output_tokens)
        calls.append(arr[:min(len(arr), _lcp(own, tokens))])
    if not calls:
        raise PayloadError("no turn returned routes")
    rows, _ = first_seen_rows(calls)
    moe = list(moe_layer_ids)
    rows = select_layers(rows, moe, 0, "SGLang")
    n, got = len(tokens), int(rows.shape[0])
    if got > n:
        raise StitchError(f"{got} route rows for {n} tokens")
    # canonical form: one row per token, the final one dropped when it has no route
    keep = n if got == n else max(n - 1, 0)
    full = np.zeros((keep,) + tuple(rows.shape[1:]), dtype=rows.dtype)
    full[:got] = rows
    valid = np.arange(keep) < got
    return ReplayBatch.from_ragged([full], num_experts=num_experts, layer_ids=moe, valid=[valid], route_kind="rollout")

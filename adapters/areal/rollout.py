"""AReaL's rollout side: SGLang responses -> :class:`r3bridge.ReplayBatch` (no areal import).

SGLang returns each request's routes from row 0 (``meta_info["routed_experts"]``); AReaL 1.0.4
concatenates a resubmitted request's attempts (the prefix twice, AReaL #1207) and re-routes a
parent-concat workflow's whole context on every turn. Both are stitched first-seen here
(:mod:`r3bridge.ingest.capture`, :mod:`r3bridge.ingest.stitching`). docs/use-with-areal.md, "What happens where".
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.decoders import decode_sglang_routes, select_layers, sglang_rows
from r3bridge.errors import PayloadError
from r3bridge.ingest.capture import trajectory_routes
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


def routes_from_attempts(meta_infos: Sequence[dict], *, num_experts: int, num_layers: int, topk: int,
                         moe_layer_ids: Sequence[int]) -> ReplayBatch:
    """All SGLang responses of one request (first submit, then every resubmit after an
    interruption) -> one sequence, duplicates removed first-seen."""
    moe = list(moe_layer_ids)
    pieces = [ReplayBatch.from_ragged([select_layers(decode_sglang(m, num_layers=num_layers, topk=topk), moe, 0, "SGLang")],
                                      num_experts=num_experts, layer_ids=moe, route_kind="rollout") for m in meta_infos]
    return stitch(pieces)[0]


def routes_from_responses(responses: Sequence[Any], tokens: Sequence[int], *, num_experts: int,
                          num_layers: int, topk: int, moe_layer_ids: Sequence[int]) -> ReplayBatch:
    """One trajectory from its ``ModelResponse``s (one per turn, root first) and its final tokens:
    each response's ``routed_experts`` (``[rows, L_all*K]``, deduplicated across resubmits) covers
    its own ``input_tokens + output_tokens`` from row 0 (:func:`r3bridge.ingest.capture.trajectory_routes`)."""
    calls = []
    for t, r in enumerate(responses):
        rows = getattr(r, "routed_experts", None)
        if rows is None:
            raise PayloadError(f"turn {t}: the response has no routed_experts (return_routed_experts off?)")
        calls.append((np.asarray(rows).reshape(len(rows), num_layers, topk), list(r.input_tokens) + list(r.output_tokens)))
    return trajectory_routes(calls, tokens, num_experts=num_experts, moe_layer_ids=moe_layer_ids)

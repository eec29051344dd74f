"""AReaL's rollout side: a trajectory's SGLang responses -> :class:`r3bridge.ReplayBatch` (no areal
import), stitched first-seen (:mod:`r3bridge.ingest.capture`; one request's resubmits:
:mod:`r3bridge.ingest.sglang_attempts`). docs/use-with-areal.md, "What happens where".
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from r3bridge.batch.schema import ReplayBatch
from r3bridge.errors import PayloadError
from r3bridge.ingest.capture import trajectory_routes

__all__ = ["ArealRollout", "routes_from_responses"]


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

"""AReaL's rollout side: a trajectory's SGLang responses -> :class:`r3bridge.ReplayBatch` (no areal
import), stitched first-seen (:mod:`r3bridge.ingest.capture`; one request's resubmits:
:mod:`r3bridge.ingest.sglang_attempts`). docs/use-with-areal.md, "What happens where".
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from r3bridge.batch.schema import ReplayBatch
from r3bridge.ingest.capture import flat_trajectory_routes

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


def routes_from_responses(responses: Sequence[Any], tokens: Sequence[int], *, num_experts: int, num_layers: int,
                          topk: int, moe_layer_ids: Sequence[int], sample: Optional[str] = None) -> ReplayBatch:
    """One trajectory from its ``ModelResponse``s (one per turn, root first) and its final tokens:
    each one's ``routed_experts`` (``[rows, L_all*K]``, deduplicated across resubmits) covers its own
    ``input_tokens + output_tokens`` from row 0 (:func:`r3bridge.ingest.capture.flat_trajectory_routes`)."""
    calls = [(getattr(r, "routed_experts", None), list(r.input_tokens) + list(r.output_tokens)) for r in responses]
    return flat_trajectory_routes(calls, tokens, num_experts=num_experts, num_layers=num_layers, topk=topk,
                                  moe_layer_ids=moe_layer_ids, sample=sample, framework="AReaL")

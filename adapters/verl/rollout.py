"""verl's rollout side: the engine's per-call routes of each sample -> what verl's agent loop
carries.

verl 0.9's agent loop takes each sample's ``routed_experts`` array (``[rows, num_hidden_layers,
K]``, every decoder layer) from its vLLM / SGLang server and places it from the prompt start in
the padded batch; a multi-turn loop keeps only the last call's. r3bridge asks for the calls
stitched first-seen instead (the rows that sampled each token): :class:`VerlRollout` does that
(:func:`r3bridge.ingest.rollout_routes`).
"""
from __future__ import annotations

from typing import Any, Sequence

from r3bridge.ingest import rollout_routes
from r3bridge.schema import ReplayBatch

__all__ = ["VerlRollout"]


class VerlRollout:
    """The :class:`r3bridge.protocols.RolloutIngest` of verl's agent loop."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: int) -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]
        self.num_hidden_layers = int(num_hidden_layers)

    def routes_from_rollout(self, engine_outputs: Sequence[Sequence[Any]]) -> ReplayBatch:
        """``engine_outputs[i]``: sample ``i``'s engine calls (vLLM arrays, ``.npy`` base64, nested
        lists), each from row 0 -> one first-seen sequence per sample, MoE layers."""
        return rollout_routes(engine_outputs, num_experts=self.num_experts, moe_layer_ids=self.moe_layer_ids)

"""Rollout side: the inference engine's calls of each sample -> ReplayBatch (source "rollout").

Engines report every decoder layer (dense ones as zero rows); ``moe_layer_ids`` keeps the MoE
ones. One piece per engine call (multi-turn turns, resubmitted attempts), each from its start
row, stitched first-seen (:func:`r3bridge.stitch`: the rows that sampled each token win, gaps
raise). Never concatenate or overwrite. vLLM payloads in any transport:
:func:`r3bridge.ingest.rollout_routes`; SGLang ``meta_info``: ``ReplayBatch.from_sglang`` per call,
then ``r3bridge.stitch``.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from r3bridge.ingest import rollout_routes
from r3bridge.schema import ReplayBatch

__all__ = ["TemplateRollout"]


class TemplateRollout:
    """The :class:`r3bridge.protocols.RolloutIngest` of your framework's generator."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int]) -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]

    def routes_from_rollout(self, engine_outputs: Sequence[Sequence[Any]],
                            start_rows: Optional[Sequence[Sequence[int]]] = None) -> ReplayBatch:
        """``engine_outputs[i][t]``: the routes engine call ``t`` of sample ``i`` returned, from
        row 0 of that call's prompt unless ``start_rows[i][t]`` says otherwise."""
        return rollout_routes(engine_outputs, num_experts=self.num_experts, moe_layer_ids=self.moe_layer_ids,
                              start_rows=start_rows)

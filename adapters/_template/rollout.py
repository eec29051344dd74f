"""Rollout side: the inference engine's calls of each sample -> ReplayBatch (route kind "rollout").

Engines report every decoder layer (dense ones as zero rows); ``moe_layer_ids`` keeps the MoE
ones. One piece per engine call (multi-turn turns, resubmitted attempts), each from its start
row, stitched first-seen (:func:`r3bridge.stitch`: the rows that sampled each token win, gaps
raise). Never concatenate or overwrite. vLLM payloads in any transport:
:class:`r3bridge.rollout.capture.StitchedRollout` (each sample's calls,
:func:`r3bridge.rollout.stitching.rollout_routes`); SGLang ``meta_info``: ``ReplayBatch.from_sglang``
per call, then ``r3bridge.stitch``. An aborted call returned no routes (``None``): it is left out,
and a sample with no routes at all gets no rows (every token invalid: routed natively), with the
model's top-k. Where a sample's routes and log-probs came from:
:func:`r3bridge.rollout.provenance.first_seen_provenance`, fed by the engine format's reader.
"""
from __future__ import annotations

from typing import Sequence

from r3bridge.rollout.capture import StitchedRollout

__all__ = ["TemplateRollout"]


class TemplateRollout(StitchedRollout):
    """The :class:`r3bridge.protocols.RolloutIngest` of your framework's generator:
    ``routes_from_rollout(engine_outputs, start_rows=None)``, ``engine_outputs[i][t]`` the routes
    engine call ``t`` of sample ``i`` returned (``None``: the call was aborted), from row 0 of that
    call's prompt unless ``start_rows[i][t]`` says otherwise."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], topk: int) -> None:
        super().__init__(num_experts=num_experts, moe_layer_ids=moe_layer_ids, topk=topk)

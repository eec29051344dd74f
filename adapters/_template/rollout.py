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

Routes by reference (``r3bridge.route_transport: handles``, docs/route-handles.md):
:meth:`TemplateRollout.handles_from_rollout` writes each sample's stitched routes once to a
:class:`r3bridge.handles.RouteStore` and returns one small handle per sample, what your
framework's batch field carries instead of the route bytes.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from r3bridge.rollout.capture import StitchedRollout

__all__ = ["TemplateRollout"]


class TemplateRollout(StitchedRollout):
    """The :class:`r3bridge.protocols.RolloutIngest` of your framework's generator:
    ``routes_from_rollout(engine_outputs, start_rows=None)``, ``engine_outputs[i][t]`` the routes
    engine call ``t`` of sample ``i`` returned (``None``: the call was aborted), from row 0 of that
    call's prompt unless ``start_rows[i][t]`` says otherwise."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], topk: int) -> None:
        super().__init__(num_experts=num_experts, moe_layer_ids=moe_layer_ids, topk=topk)

    def handles_from_rollout(self, engine_outputs: Sequence[Sequence[Any]], store: Any, samples: Sequence[str], *,
                             step: int, start_rows: Optional[Sequence[Sequence[int]]] = None) -> list:
        """:meth:`routes_from_rollout`, each sample's stitched routes written once to ``store`` (a
        :class:`r3bridge.handles.RouteStore`) for RL step ``step`` under ``samples[i]`` (your
        framework's sample id): one :class:`r3bridge.handles.RouteHandle` per sample, batch order."""
        return store.put_batch(self.routes_from_rollout(engine_outputs, start_rows), samples, step=step)

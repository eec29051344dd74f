"""Rollout side: the inference engine's calls of each sample -> ReplayBatch (source "rollout").

Engines report every decoder layer (dense ones as zero rows); ``moe_layer_ids`` keeps the MoE
ones. One piece per engine call (multi-turn turns, resubmitted attempts), each from its start
row, stitched first-seen (:func:`r3bridge.stitch`: the rows that sampled each token win, gaps
raise). Never concatenate or overwrite. vLLM payloads in any transport:
:func:`r3bridge.ingest.stitching.rollout_routes`; SGLang ``meta_info``: ``ReplayBatch.from_sglang`` per call,
then ``r3bridge.stitch``. An aborted call returned no routes (``None``): it is left out, and a
sample with no routes at all gets no rows (every token invalid: routed natively), with the
model's top-k.

Routes by reference (``r3bridge.route_transport: handles``, docs/route-handles.md):
:meth:`TemplateRollout.handles_from_rollout` writes each sample's stitched routes once to a
:class:`r3bridge.handles.RouteStore` and returns one small handle per sample, what your
framework's batch field carries instead of the route bytes.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from r3bridge.batch.schema import ReplayBatch
from r3bridge.ingest.stitching import rollout_routes

__all__ = ["TemplateRollout"]


class TemplateRollout:
    """The :class:`r3bridge.protocols.RolloutIngest` of your framework's generator."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], topk: int) -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]
        self.topk = int(topk)

    def routes_from_rollout(self, engine_outputs: Sequence[Sequence[Any]],
                            start_rows: Optional[Sequence[Sequence[int]]] = None) -> ReplayBatch:
        """``engine_outputs[i][t]``: the routes engine call ``t`` of sample ``i`` returned (``None``:
        the call was aborted), from row 0 of that call's prompt unless ``start_rows[i][t]`` says
        otherwise."""
        per_sample = []
        for i, calls in enumerate(engine_outputs):
            starts = list(start_rows[i]) if start_rows is not None else [0] * len(calls)
            kept = [(c, s) for c, s in zip(calls, starts) if c is not None]
            if not kept:        # every call aborted: no rows, the model's top-k
                per_sample.append(ReplayBatch.from_ragged(
                    [np.zeros((0, len(self.moe_layer_ids), self.topk), dtype=np.uint8)],
                    num_experts=self.num_experts, layer_ids=self.moe_layer_ids, route_kind="rollout"))
                continue
            per_sample.append(rollout_routes([[c for c, _ in kept]], num_experts=self.num_experts,
                                             moe_layer_ids=self.moe_layer_ids, start_rows=[[s for _, s in kept]]))
        return ReplayBatch.concat(per_sample)

    def handles_from_rollout(self, engine_outputs: Sequence[Sequence[Any]], store: Any, samples: Sequence[str], *,
                             step: int, start_rows: Optional[Sequence[Sequence[int]]] = None) -> list:
        """:meth:`routes_from_rollout`, each sample's stitched routes written once to ``store`` (a
        :class:`r3bridge.handles.RouteStore`) for RL step ``step`` under ``samples[i]`` (your
        framework's sample id): one :class:`r3bridge.handles.RouteHandle` per sample, batch order."""
        return store.put_batch(self.routes_from_rollout(engine_outputs, start_rows), samples, step=step)

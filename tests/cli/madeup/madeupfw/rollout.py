"""Rollout side: madeup_framework's engine calls of each sample -> ReplayBatch (route kind "rollout").

The engine reports each call's MoE-layer routes keyed by 1-based layer number, from the call's
first prompt token; a later call re-sends the whole context. One piece per call, stitched
first-seen (:func:`r3bridge.stitch`: the rows that sampled each token win). An aborted call
(``routes=None``) is left out; a sample with no routes at all gets no rows, with the model's top-k.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.layer_ids import layers_from_mapping
from r3bridge.rollout.stitching import stitch

__all__ = ["MadeupfwRollout"]


class MadeupfwRollout:
    """The :class:`r3bridge.protocols.RolloutIngest` of madeup_framework's generator."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], topk: int) -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]
        self.topk = int(topk)

    def _piece(self, routes: Any, what: str) -> ReplayBatch:
        from madeup_framework import LAYER_BASE

        if routes is None:
            rows = np.zeros((0, len(self.moe_layer_ids), self.topk), dtype=np.uint8)
        else:
            rows = layers_from_mapping({int(k) - LAYER_BASE: v for k, v in routes.items()}, self.moe_layer_ids,
                                       field=what, topk=self.topk)
        return ReplayBatch.from_ragged([rows], num_experts=self.num_experts, layer_ids=self.moe_layer_ids,
                                       route_kind="rollout")

    def routes_from_rollout(self, engine_outputs: Sequence[Any]) -> ReplayBatch:
        """``engine_outputs[i]``: sample ``i``'s ``madeup_framework.Completion`` objects, in call order."""
        per_sample = []
        for i, completions in enumerate(engine_outputs):
            pieces = [self._piece(c.routes, f"sample {i}, call {t}") for t, c in enumerate(completions)]
            per_sample.append(stitch(pieces)[0])
        return ReplayBatch.concat(per_sample)

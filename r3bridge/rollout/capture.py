"""Rollout-side capture: a rollout loop's engine calls of each sample, turned into first-seen
routes (the rule is :mod:`r3bridge.rollout.stitching`'s).

A framework's rollout loop calls its inference engine several times per sample: one call per
turn, a resubmit after an interruption, a retry. Each call returns routes from row 0 of its own
prompt (or from the start row the engine reports); a later prefill re-routes earlier tokens,
possibly differently, so the rows that *sampled* each token are the first ones returned.
:class:`StitchedRollout` is the :class:`~r3bridge.protocols.RolloutIngest` of a loop whose calls
return vLLM-style routes: each sample's calls stitched first-seen, aborted calls left out.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from r3bridge.batch.schema import ReplayBatch
from r3bridge.errors import PayloadError
from r3bridge.rollout.stitching import rollout_routes

__all__ = ["StitchedRollout"]


class StitchedRollout:
    """``routes_from_rollout(engine_outputs, start_rows=None)``: ``engine_outputs[i][t]`` is what
    engine call ``t`` of sample ``i`` returned (any vLLM transport,
    :func:`r3bridge.engines.decoders.decode_vllm_routes`; ``None``: the call was aborted), from row 0 of
    its prompt unless ``start_rows[i][t]`` says otherwise -> one first-seen sequence per sample,
    the MoE layers, ``route_kind="rollout"``. A sample whose every call aborted trains without routes
    (no rows, the model's ``topk``; without it, refused)."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], topk: Optional[int] = None) -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]
        self.topk = None if topk is None else int(topk)

    def routes_from_rollout(self, engine_outputs: Sequence[Sequence[Any]],
                            start_rows: Optional[Sequence[Sequence[int]]] = None) -> ReplayBatch:
        per_sample = []
        for i, calls in enumerate(engine_outputs):
            starts = list(start_rows[i]) if start_rows is not None else [0] * len(calls)
            kept = [(c, s) for c, s in zip(calls, starts) if c is not None]
            if not kept and self.topk is not None:      # every call aborted: no rows, the model's top-k
                empty = np.zeros((0, len(self.moe_layer_ids), self.topk), dtype=np.uint8)
                per_sample.append(ReplayBatch.from_ragged([empty], num_experts=self.num_experts,
                                                          layer_ids=self.moe_layer_ids, route_kind="rollout"))
                continue
            if not kept:
                raise PayloadError(f"sample {i}: no engine call returned routes")
            per_sample.append(rollout_routes([[c for c, _ in kept]], num_experts=self.num_experts,
                                             moe_layer_ids=self.moe_layer_ids, start_rows=[[s for _, s in kept]]))
        return ReplayBatch.concat(per_sample)

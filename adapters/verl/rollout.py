"""verl's rollout side: a sample's server calls -> the first-seen routes verl's agent loop carries.

verl 0.9.1's tool agent loop keeps only the last server call's ``routed_experts``, whose rows for
earlier turns' tokens are the re-prefill's routes; r3bridge keeps the rows that sampled each
token (:mod:`r3bridge.ingest.capture`, :mod:`r3bridge.ingest.stitching`). docs/use-with-verl.md, "Multi-turn".
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from r3bridge.batch.provenance import RouteProvenance, reported_int
from r3bridge.errors import ProvenanceError
from r3bridge.hf import ModelInfo
from r3bridge.ingest.capture import StitchedRollout, checked_calls
from r3bridge.ingest.stitching import StitchReport, first_seen_rows

__all__ = ["VerlRollout", "call_provenance"]


class VerlRollout(StitchedRollout):
    """The :class:`r3bridge.protocols.RolloutIngest` of verl's agent loop (its servers' calls of
    each sample, stitched first-seen), and one agent-loop sample's calls in verl's own transport."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: int,
                 topk: int | None = None) -> None:
        super().__init__(num_experts=num_experts, moe_layer_ids=moe_layer_ids, topk=topk)
        self.num_hidden_layers = int(num_hidden_layers)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "VerlRollout":
        info = ModelInfo.from_hf_config(hf_config)
        return cls(num_experts=info.num_experts, moe_layer_ids=info.moe_layer_ids, num_hidden_layers=info.num_layers,
                   topk=info.topk)

    def agent_loop_routes(self, calls: Sequence[Any], *, sample: str = "") -> tuple[np.ndarray, StitchReport]:
        """One agent-loop sample's ``TokenOutput.routed_experts`` (``[rows, num_hidden_layers, K]``
        each, from row 0) -> the first-seen rows in verl's own transport and the stitch report."""
        checked_calls(calls, num_hidden_layers=self.num_hidden_layers, topk=self.topk, sample=sample)
        return first_seen_rows(calls)


def call_provenance(outputs: Sequence[Any], *, engine: str, request_id: str = "",
                    attempts: Sequence[int] | None = None) -> tuple[RouteProvenance, RouteProvenance]:
    """One sample's server calls (verl ``TokenOutput``s, in call order) -> (where its routes came
    from, where its log-probs came from). First-seen keeps the first call's rows for the earliest
    tokens: the routes are its pass (weight version ``extra_fields["global_steps"]``, epoch
    ``num_preempted``: each vLLM preemption re-prefills, vLLM #39917); the first tokens' log-probs
    were sampled in its first pass (epoch 0, ``min_global_steps`` when verl's resuming client
    reports it). ``attempts`` (the :class:`~r3bridge.ingest.capture.CallLog`'s): the routes are the first
    call's attempt, the log-probs (and tokens) the last call's; ``None``: unknown."""
    if not outputs:
        raise ProvenanceError(f"sample {request_id or '?'}: no server call to take provenance from")
    if attempts is not None and len(attempts) != len(outputs):
        raise ProvenanceError(f"sample {request_id or '?'}: {len(attempts)} attempts for {len(outputs)} server calls")
    first = outputs[0]
    extra = getattr(first, "extra_fields", None) or {}
    version, sampled = reported_int(extra.get("global_steps")), reported_int(extra.get("min_global_steps"))
    routes = RouteProvenance(engine, str(request_id), version, reported_int(getattr(first, "num_preempted", None)),
                             None if attempts is None else attempts[0])
    logprobs = RouteProvenance(engine, str(request_id), version if sampled is None else sampled, 0,
                               None if attempts is None else attempts[-1])
    return routes, logprobs

"""verl's rollout side: a sample's server calls -> the first-seen routes verl's agent loop carries
(verl 0.9.1's keeps the last call's, re-prefill routes for earlier turns' tokens). docs/use-with-verl.md,
"Multi-turn".
"""
from __future__ import annotations

from typing import Any, Sequence

from r3bridge.adapters.verl.calls import FirstSeenCalls, outputs_provenance
from r3bridge.batch.provenance import RouteProvenance

__all__ = ["VerlRollout", "call_provenance"]


class VerlRollout(FirstSeenCalls):
    """The :class:`r3bridge.protocols.RolloutIngest` of verl's agent loop (its servers' calls of
    each sample, stitched first-seen); :meth:`~r3bridge.adapters.verl.calls.FirstSeenCalls.sample_rows`
    gives one agent-loop sample's ``TokenOutput.routed_experts`` as its first-seen rows in verl's own
    transport (``[rows, num_hidden_layers, K]``) and the stitch report."""


def call_provenance(outputs: Sequence[Any], *, engine: str, request_id: str = "",
                    attempts: Sequence[int] | None = None) -> tuple[RouteProvenance, RouteProvenance]:
    """:func:`r3bridge.adapters.verl.calls.outputs_provenance` of one sample's verl ``TokenOutput``s (in
    call order): weight version ``extra_fields["global_steps"]`` (``min_global_steps`` for the first
    tokens' log-probs when verl's resuming client reports it), epoch ``num_preempted`` (each vLLM
    preemption re-prefills, vLLM #39917)."""
    return outputs_provenance(outputs, engine=engine, request_id=request_id, attempts=attempts,
                              version="extra_fields.global_steps", sampled_version="extra_fields.min_global_steps")

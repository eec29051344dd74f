"""verl's rollout side: a sample's server calls -> the first-seen routes verl's agent loop carries
(verl 0.9.1's keeps the last call's, re-prefill routes for earlier turns' tokens). docs/use-with-verl.md,
"Multi-turn".
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from r3bridge.batch.provenance import RouteProvenance, reported_int
from r3bridge.ingest.call_capture import FirstSeenCalls, first_seen_provenance
from r3bridge.ingest.stitching import StitchReport

__all__ = ["VerlRollout", "call_provenance"]


class VerlRollout(FirstSeenCalls):
    """The :class:`r3bridge.protocols.RolloutIngest` of verl's agent loop (its servers' calls of
    each sample, stitched first-seen), and one agent-loop sample's calls in verl's own transport."""

    def agent_loop_routes(self, calls: Sequence[Any], *, sample: str = "") -> tuple[np.ndarray, StitchReport]:
        """One agent-loop sample's ``TokenOutput.routed_experts`` -> its first-seen rows in verl's
        own transport (``[rows, num_hidden_layers, K]``) and the stitch report."""
        return self.sample_rows(calls, sample=sample)


def call_provenance(outputs: Sequence[Any], *, engine: str, request_id: str = "",
                    attempts: Sequence[int] | None = None) -> tuple[RouteProvenance, RouteProvenance]:
    """One sample's server calls (verl ``TokenOutput``s, in call order) -> (where its routes came
    from, where its log-probs came from) (:func:`r3bridge.ingest.call_capture.first_seen_provenance`):
    weight version ``extra_fields["global_steps"]`` (``min_global_steps`` for the first tokens'
    log-probs when verl's resuming client reports it), epoch ``num_preempted`` (each vLLM
    preemption re-prefills, vLLM #39917)."""
    first = outputs[0] if outputs else None
    extra = getattr(first, "extra_fields", None) or {}
    return first_seen_provenance(engine, request_id, calls=len(outputs),
                                 version=reported_int(extra.get("global_steps")),
                                 epoch=reported_int(getattr(first, "num_preempted", None)),
                                 sampled_version=reported_int(extra.get("min_global_steps")), attempts=attempts)

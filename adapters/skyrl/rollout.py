"""SkyRL's generator side: each engine call's routes, stitched first-seen (SkyRL 0.3 overwrites a
sample's routes with each new turn's). docs/use-with-skyrl.md, "Formats and hook points"."""
from __future__ import annotations

from typing import Optional

from r3bridge.adapters.skyrl.codec import ENGINE
from r3bridge.batch.provenance import RouteProvenance, first_call_provenance
from r3bridge.engines.decoders import decode_vllm_routes
from r3bridge.ingest.capture import StitchedRollout, merge_first_seen
from r3bridge.ingest.stitching import rollout_routes

__all__ = ["SkyRLRollout", "decode_routed_experts", "rollout_routes", "merge_first_seen", "call_provenance"]

decode_routed_experts = decode_vllm_routes


class SkyRLRollout(StitchedRollout):
    """The :class:`r3bridge.protocols.RolloutIngest` of SkyRL's generator."""


def call_provenance(version_at_submit: Optional[int], version_at_return: Optional[int], *,
                    epoch: Optional[int] = None) -> tuple[RouteProvenance, RouteProvenance]:
    """:func:`r3bridge.batch.provenance.first_call_provenance` from SkyRL's inference client ``weight_version``."""
    return first_call_provenance(ENGINE, version_at_submit, version_at_return, epoch=epoch)

"""SkyRL's generator side: each engine call's routes, stitched first-seen (SkyRL 0.3 overwrites a
sample's routes with each new turn's). docs/use-with-skyrl.md, "Formats and hook points"."""
from __future__ import annotations

from r3bridge.ingest.capture import StitchedRollout

__all__ = ["SkyRLRollout"]


class SkyRLRollout(StitchedRollout):
    """The :class:`r3bridge.protocols.RolloutIngest` of SkyRL's generator."""

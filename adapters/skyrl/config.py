"""The ``r3bridge`` section for SkyRL: passed explicitly (a :class:`r3bridge.ReplayConfig` or its
mapping) or through ``R3BRIDGE_CONFIG`` (JSON) / ``R3BRIDGE_REPLAY_MODE``, else off."""
from __future__ import annotations

from typing import Any, Mapping

from r3bridge.config import ReplayConfig

__all__ = ["replay_config"]


def replay_config(cfg: ReplayConfig | Mapping[str, Any] | None = None) -> ReplayConfig:
    """An explicit config, else ``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``, else off."""
    return ReplayConfig.resolve(cfg)

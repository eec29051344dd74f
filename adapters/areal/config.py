"""The ``r3bridge`` section for AReaL (explicit, ``engine.r3_config``, or ``R3BRIDGE_CONFIG`` /
``R3BRIDGE_REPLAY_MODE``) and what the adapter needs to know about the model."""
from __future__ import annotations

from typing import Any, Mapping

from r3bridge.config import ReplayConfig
from r3bridge.hf import ModelInfo  # what the adapter needs to know about the model (re-exported)

__all__ = ["replay_config", "ModelInfo"]


def replay_config(cfg: ReplayConfig | Mapping[str, Any] | None = None) -> ReplayConfig:
    """An explicit config, else ``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``, else off."""
    return ReplayConfig.resolve(cfg)

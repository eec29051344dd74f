"""The ``r3bridge`` section: the same :class:`r3bridge.ReplayConfig` in every adapter, passed
explicitly or through ``R3BRIDGE_CONFIG`` (JSON) / ``R3BRIDGE_REPLAY_MODE``. If your framework's
workers only see part of the job config, carry the section in the environment (see the verl
adapter's ``config.py``)."""
from __future__ import annotations

from typing import Any, Mapping

from r3bridge.config import ReplayConfig

__all__ = ["replay_config"]


def replay_config(cfg: ReplayConfig | Mapping[str, Any] | None = None) -> ReplayConfig:
    """An explicit config, else ``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``, else off."""
    return ReplayConfig.resolve(cfg)

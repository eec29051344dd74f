"""The ``r3bridge`` section for AReaL (explicit, ``engine.r3_config``, or ``R3BRIDGE_CONFIG`` /
``R3BRIDGE_REPLAY_MODE``) and what the adapter needs to know about the model."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from r3bridge.config import ReplayConfig

__all__ = ["replay_config", "ModelInfo"]


def replay_config(cfg: ReplayConfig | Mapping[str, Any] | None = None) -> ReplayConfig:
    """An explicit config, else ``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``, else off."""
    return ReplayConfig.resolve(cfg)


class ModelInfo:
    """What the adapter needs to know about the model (from its HF config)."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_layers: int, topk: int) -> None:
        self.num_experts, self.num_layers, self.topk = int(num_experts), int(num_layers), int(topk)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "ModelInfo":
        from r3bridge.hf import (moe_layer_ids_from_hf_config, num_experts_from_hf_config,
                                 num_hidden_layers_from_hf_config, topk_from_hf_config)
        return cls(num_experts=num_experts_from_hf_config(hf_config), moe_layer_ids=moe_layer_ids_from_hf_config(hf_config),
                   num_layers=num_hidden_layers_from_hf_config(hf_config), topk=topk_from_hf_config(hf_config))

"""r3bridge for AReaL 1.0.x: ``replay_mode: R2 | R3 | off`` on AReaL's Megatron engine.

The files of every adapter (docs/porting.md, "The seam"), plus ``launch.py`` (AReaL's local
launcher after r3bridge's checks). See docs/use-with-areal.md.
"""
from __future__ import annotations

from r3bridge.adapters.areal.codec import (
    RECORDED_KEY,
    ROUTES_KEY,
    SAMPLE_KEY,
    ArealCodec,
    batch_handed_routes,
    batch_tensor,
    handed_routes,
    trajectory_tensor,
)
from r3bridge.adapters.areal.config import ModelInfo, grpo_config_class, replay_config
from r3bridge.adapters.areal.hooks import (
    MegatronEngineMixin,
    PPOActorMixin,
    RecordingBackend,
    RoleEngineMixin,
    SGLangEngineMixin,
    WorkflowMixin,
    megatron_ppo_actor_class,
    megatron_role_engine_class,
    trainer_class,
    workflow_class,
)
from r3bridge.adapters.areal.rollout import ArealRollout, routes_from_responses

__all__ = ["ROUTES_KEY", "RECORDED_KEY", "SAMPLE_KEY", "routes_from_responses", "trajectory_tensor",
           "batch_handed_routes", "handed_routes", "batch_tensor", "ModelInfo", "SGLangEngineMixin", "RecordingBackend",
           "WorkflowMixin", "PPOActorMixin", "MegatronEngineMixin", "RoleEngineMixin", "megatron_role_engine_class",
           "replay_config", "ArealCodec", "ArealRollout", "megatron_ppo_actor_class", "trainer_class", "workflow_class",
           "grpo_config_class"]

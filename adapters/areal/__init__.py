"""r3bridge for AReaL 1.0.x: ``replay_mode: R2 | R3 | off`` on AReaL's Megatron engine.

Files (the same in every adapter):

* ``config.py`` - the ``r3bridge:`` section in AReaL's own YAML (:func:`grpo_config_class`: AReaL's
  ``GRPOConfig`` plus the section, parsed by AReaL's ``load_expr_config``), :func:`replay_config`
  (explicit, else ``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``), the top-k check at ingest and
  :class:`ModelInfo`;
* ``rollout.py`` - rollout side (:class:`ArealRollout`): SGLang ``meta_info["routed_experts"]``
  (base64 int32) -> :class:`r3bridge.ReplayBatch`, resubmits deduplicated and parent-concat turns
  stitched first-seen;
* ``codec.py`` - trainer side (:class:`ArealCodec`): the per-trajectory routes tensor of AReaL's
  batched dicts <-> ReplayBatch;
* ``hooks.py`` - mixins for AReaL's classes: :class:`SGLangEngineMixin` (AReaL 1.0.4
  concatenates every resubmitted attempt's routes, duplicating the prefix), :class:`WorkflowMixin`,
  :class:`PPOActorMixin` (phases, R2 write-back) and :class:`MegatronEngineMixin` (one
  :class:`r3bridge.megatron.MicroBatch` per micro-batch, per-(chunk, micro-batch) install: VPP
  works), and the class factories;
* ``launch.py`` - the launch line (``python3 -m r3bridge.adapters.areal.launch SCRIPT --config YAML``):
  AReaL's local launcher after r3bridge's checks (mode announced at launch, one line per thing the
  launcher would fail on late or wait for silently, the wait for inference servers watched);
* ``_compat.py`` - importing AReaL's modules without its agent stack.

See docs/use-with-areal.md.
"""
from __future__ import annotations

from r3bridge.adapters.areal.codec import (
    RECORDED_KEY,
    ROUTES_KEY,
    SAMPLE_KEY,
    ArealCodec,
    batch_tensor,
    replay_batch_from_batch,
    replay_batch_from_tensor,
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
from r3bridge.adapters.areal.rollout import (
    ArealRollout,
    decode_sglang,
    first_seen_rows,
    routes_from_attempts,
    routes_from_responses,
)

__all__ = ["ROUTES_KEY", "RECORDED_KEY", "SAMPLE_KEY", "decode_sglang", "first_seen_rows", "routes_from_attempts",
           "routes_from_responses", "trajectory_tensor", "replay_batch_from_batch", "replay_batch_from_tensor",
           "batch_tensor", "ModelInfo", "SGLangEngineMixin", "RecordingBackend", "WorkflowMixin", "PPOActorMixin",
           "MegatronEngineMixin", "RoleEngineMixin", "megatron_role_engine_class", "replay_config", "ArealCodec", "ArealRollout", "megatron_ppo_actor_class",
           "trainer_class", "workflow_class", "grpo_config_class"]

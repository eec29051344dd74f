"""r3bridge for SkyRL 0.3.x: ``replay_mode: R2 | R3 | off`` on SkyRL's Megatron backend.

Files (the same in every adapter):

* ``config.py`` - the same ``r3bridge`` section as every adapter (:class:`r3bridge.ReplayConfig`) on
  SkyRL's own command line, ``trainer.r3bridge.replay_mode=R3`` (:func:`skyrl_config_class`, parsed
  by SkyRL's parser), with ``R3BRIDGE_CONFIG`` (JSON) / ``R3BRIDGE_REPLAY_MODE`` as the fallback;
* ``main.py`` - the entry point (``python -m r3bridge.adapters.skyrl.main``);
* ``rollout.py`` - generator side (:class:`SkyRLRollout`): every vLLM call's routes in any of
  SkyRL's transports, stitched first-seen (:func:`merge_first_seen` on SkyRL's list format);
* ``codec.py`` - trainer side (:class:`SkyRLCodec`): ``TrainingInputBatch`` fields
  ``rollout_expert_indices`` + ``router_padding_mask`` <-> ReplayBatch;
* ``hooks.py`` - subclasses of SkyRL's own classes: ``MegatronModelWrapper``
  (:func:`model_wrapper_class`, per-micro-batch install through :class:`r3bridge.megatron.PhaseRunner`),
  ``MegatronPolicyWorkerBase`` (:class:`PolicyWorkerMixin`), ``RayPPOTrainer``
  (:class:`TrainerMixin`, R2 write-back) and ``SkyRLGymGenerator`` (:class:`FirstSeenRoutesMixin`);
* ``_compat.py`` - importing SkyRL's modules on Python 3.11.

What SkyRL lacks and this adds: R2, VPP, first-seen multi-turn routes, validity instead of zero
rows. See docs/use-with-skyrl.md.
"""
from __future__ import annotations

from r3bridge.adapters.skyrl._compat import SUPPORTED_RELEASES, skyrl_release
from r3bridge.adapters.skyrl.codec import (
    MASK_KEY,
    ROUTES_KEY,
    ROUTES_MARK,
    SkyRLCodec,
    make_router_padding_mask,
    packed_training_batch_fields,
    replay_batch_from_training_batch,
    training_batch_fields,
)
from r3bridge.adapters.skyrl.config import parse_cli, prepare_skyrl_config, replay_config, skyrl_config_class
from r3bridge.adapters.skyrl.hooks import (
    RECORDED_KEY,
    FirstSeenRoutesMixin,
    PolicyWorkerMixin,
    RefWorkerMixin,
    SkyRLReplay,
    TrainerMixin,
    model_wrapper_class,
    policy_worker_class,
    record_ids_field,
    ref_worker_class,
)
from r3bridge.adapters.skyrl.rollout import SkyRLRollout, decode_routed_experts, merge_first_seen, rollout_routes

# SkyRL 0.3.x or 0.4.x (None: not installed); any other installed release is refused here, at import
SKYRL_RELEASE = skyrl_release()

__all__ = ["SKYRL_RELEASE", "SUPPORTED_RELEASES", "skyrl_release", "packed_training_batch_fields", "ROUTES_KEY", "MASK_KEY", "ROUTES_MARK", "RECORDED_KEY", "decode_routed_experts", "rollout_routes",
           "merge_first_seen", "replay_batch_from_training_batch", "training_batch_fields", "make_router_padding_mask",
           "record_ids_field", "SkyRLReplay", "model_wrapper_class", "PolicyWorkerMixin", "RefWorkerMixin", "TrainerMixin",
           "replay_config", "skyrl_config_class", "parse_cli", "prepare_skyrl_config", "FirstSeenRoutesMixin", "policy_worker_class", "ref_worker_class", "SkyRLCodec", "SkyRLRollout"]

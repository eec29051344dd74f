"""r3bridge for SkyRL 0.3.x / 0.4.x: ``replay_mode: R2 | R3 | off`` on SkyRL's Megatron backend
(files as in docs/porting.md, "The seam"; docs/use-with-skyrl.md)."""
from __future__ import annotations

from r3bridge.adapters.skyrl._compat import SUPPORTED_RELEASES, skyrl_release
from r3bridge.adapters.skyrl.codec import (
    MASK_KEY,
    ROUTES_KEY,
    ROUTES_MARK,
    SkyRLCodec,
    handed_routes,
    packed_training_batch_fields,
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
           "merge_first_seen", "handed_routes", "training_batch_fields",
           "record_ids_field", "SkyRLReplay", "model_wrapper_class", "PolicyWorkerMixin", "RefWorkerMixin", "TrainerMixin",
           "replay_config", "skyrl_config_class", "parse_cli", "prepare_skyrl_config", "FirstSeenRoutesMixin", "policy_worker_class", "ref_worker_class", "SkyRLCodec", "SkyRLRollout"]

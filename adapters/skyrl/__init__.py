"""r3bridge for SkyRL 0.3.x / 0.4.x: ``replay_mode: R2 | R3 | off`` on SkyRL's Megatron backend
(files as in docs/porting.md, "The seam"; docs/use-with-skyrl.md)."""
from __future__ import annotations

from r3bridge.adapters.skyrl._compat import skyrl_release
from r3bridge.adapters.skyrl.codec import SkyRLCodec
from r3bridge.adapters.skyrl.config import skyrl_config_class
from r3bridge.adapters.skyrl.hooks import (
    FirstSeenRoutesMixin,
    PolicyWorkerMixin,
    RefWorkerMixin,
    TrainerMixin,
    model_wrapper_class,
    policy_worker_class,
    ref_worker_class,
)
from r3bridge.adapters.skyrl.replay import SkyRLReplay

# SkyRL 0.3.x or 0.4.x (None: not installed); any other installed release is refused here, at import
SKYRL_RELEASE = skyrl_release()

__all__ = ["SKYRL_RELEASE", "SkyRLCodec", "skyrl_config_class", "FirstSeenRoutesMixin", "TrainerMixin",
           "PolicyWorkerMixin", "RefWorkerMixin", "SkyRLReplay", "model_wrapper_class", "policy_worker_class",
           "ref_worker_class"]

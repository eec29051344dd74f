"""verl 0.9.1's SGLang server and replica, their routes read by r3bridge
(:mod:`r3bridge.adapters.verl.sglang_routes` says why verl's own reading fails on SGLang 0.5.12).

Imports SGLang (through verl's server module): loaded only by the rollout loader
:func:`~r3bridge.adapters.verl.sglang_routes.register_sglang_rollout` puts under verl's name
``sglang``, in the process where verl starts an SGLang rollout.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import ray
from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer, SGLangReplica

from r3bridge.adapters.verl.sglang_routes import (
    RoutesReadingTokenizerManager,
    check_sglang_rollout,
    sglang_release,
    verl_routes,
)
from r3bridge.config import ReplayConfig
from r3bridge.engines.route_formats import route_format
from r3bridge.hf import ModelInfo

__all__ = ["R3SGLangHttpServer", "R3SGLangReplica"]

logger = logging.getLogger("r3bridge.adapters.verl")


class R3SGLangHttpServer(SGLangHttpServer):
    """verl's ``SGLangHttpServer``; with ``enable_rollout_routing_replay`` its tokenizer manager
    is wrapped (:class:`RoutesReadingTokenizerManager`) so that verl's own ``generate`` hands the
    agent loop routes decoded by SGLang's release. The release and the rollout settings are checked
    before SGLang starts."""

    async def launch_server(self, master_address: Any = None, master_port: Any = None) -> None:
        read = None
        if self.config.enable_rollout_routing_replay:
            check_sglang_rollout(self.config)
            version = sglang_release(ReplayConfig.from_env().engine_version)
            info = ModelInfo.from_hf_config(self.model_config.hf_config)
            read = functools.partial(verl_routes, version=version, num_hidden_layers=info.num_layers,
                                     topk=info.topk, moe_layer_ids=info.moe_layer_ids)
            logger.info("r3bridge reads SGLang %s's routes as %s (%d layers, top-%s, MoE layers %s)", version,
                        route_format("sglang", version).name, info.num_layers, info.topk, info.moe_layer_ids)
        await super().launch_server(master_address, master_port)
        if read is not None and getattr(self, "tokenizer_manager", None) is not None:
            self.tokenizer_manager = RoutesReadingTokenizerManager(self.tokenizer_manager, read=read)


class R3SGLangReplica(SGLangReplica):
    """verl's ``SGLangReplica`` starting :class:`R3SGLangHttpServer` actors; its rollout config is
    checked here, in the process that starts the replica, before any server."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_sglang_rollout(self.config)
        self.server_class = ray.remote(R3SGLangHttpServer)

"""r3bridge's engine in verl's ``EngineRegistry`` for ``(language_model, megatron, cuda, nvidia)``.

verl's plugin loader swallows import errors: :func:`r3bridge.launch.plugin_load.load_plugin` logs
the outcome (ERROR on failure) and fails the worker of a job that asked for replay.
"""
from __future__ import annotations

import logging
from typing import Optional

from r3bridge.launch.plugin_load import load_plugin, outcome_recorder, register_once

__all__ = ["ENGINE_KEY", "LOADED", "LOAD_ERROR", "register"]

logger = logging.getLogger("r3bridge.adapters.verl")
ENGINE_KEY = ("language_model", "megatron", "cuda", "nvidia")
LOADED = False          # True once the engine is registered and the registry resolves to it
LOAD_ERROR: Optional[str] = None


def _install() -> str:
    """Register the engine at ENGINE_KEY (:func:`~r3bridge.launch.plugin_load.register_once`)."""
    from verl.workers.engine.base import EngineRegistry

    from r3bridge.versions import check_internals, check_release

    check_release("verl", what="'s verl adapter")
    check_internals("verl", [("verl.workers.engine.base.EngineRegistry._engines", EngineRegistry, "_engines")])
    from r3bridge.adapters.verl.hooks import R3BridgeMegatronEngine

    model_type, backend, device, vendor = ENGINE_KEY
    decorator = EngineRegistry.register(model_type=model_type, backend=backend, device=device, vendor=vendor)
    return register_once(R3BridgeMegatronEngine, "EngineRegistry", ENGINE_KEY, register=decorator, lookup=lambda: (
        EngineRegistry._engines.get(model_type, {}).get(backend, {}).get((device, vendor))))


def register() -> bool:
    """Register r3bridge's engine in verl's ``EngineRegistry`` (idempotent). Returns :data:`LOADED`."""
    if not LOADED:
        load_plugin("verl", _install, logger, outcome_recorder(globals()))
    return LOADED

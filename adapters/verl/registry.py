"""r3bridge's engine in verl's ``EngineRegistry`` for ``(language_model, megatron, cuda, nvidia)``.

verl's plugin loader swallows import errors: :func:`r3bridge.launch.plugin_load.load_plugin` logs
the outcome (ERROR on failure) and fails the worker of a job that asked for replay.
"""
from __future__ import annotations

import logging
from typing import Optional

from r3bridge.launch.plugin_load import load_plugin

__all__ = ["ENGINE_KEY", "LOADED", "LOAD_ERROR", "register"]

logger = logging.getLogger("r3bridge.adapters.verl")
ENGINE_KEY = ("language_model", "megatron", "cuda", "nvidia")
LOADED = False          # True once the engine is registered and the registry resolves to it
LOAD_ERROR: Optional[str] = None


def _install() -> str:
    """Register the engine (idempotent); the registry must then resolve ENGINE_KEY to it."""
    from verl.workers.engine.base import EngineRegistry

    from r3bridge.versions import check_internals, check_release

    check_release("verl", what="'s verl adapter")
    check_internals("verl", [("verl.workers.engine.base.EngineRegistry._engines", EngineRegistry, "_engines")])
    from r3bridge.adapters.verl.hooks import R3BridgeMegatronEngine

    model_type, backend, device, vendor = ENGINE_KEY
    got = EngineRegistry._engines.get(model_type, {}).get(backend, {}).get((device, vendor))
    if got is None:
        EngineRegistry.register(model_type=model_type, backend=backend, device=device, vendor=vendor)(
            R3BridgeMegatronEngine)
        got = EngineRegistry._engines[model_type][backend][(device, vendor)]
    if got is not R3BridgeMegatronEngine:
        raise RuntimeError(f"EngineRegistry holds {got!r} for {ENGINE_KEY}, not the r3bridge engine")
    return f"{R3BridgeMegatronEngine.__name__} registered for {ENGINE_KEY}"


def _record(error: Optional[str]) -> None:
    global LOADED, LOAD_ERROR
    LOADED, LOAD_ERROR = error is None, error


def _register() -> None:
    load_plugin("verl", _install, logger, _record)


def register() -> bool:
    """Register r3bridge's engine in verl's ``EngineRegistry`` (idempotent). Returns :data:`LOADED`."""
    if not LOADED:
        _register()
    return LOADED

"""r3bridge for verl 0.9: ``replay_mode: R2 | R3 | off`` in an existing Megatron job.

Loaded in the driver and every Ray worker, through verl's plugin entry points (``verl.plugins``)
or ``actor_rollout_ref.model.external_lib=r3bridge.adapters.verl``. Opt-in: only when the mode
the launcher (``python -m r3bridge.adapters.verl.main_ppo``) hands every worker
(``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``) is R2 or R3 does this import verl's Megatron
engine and register :class:`~r3bridge.adapters.verl.hooks.R3BridgeMegatronEngine` for
``(language_model, megatron, cuda, nvidia)``; replay off leaves verl untouched. verl swallows
plugin import errors, so :func:`register` checks the registration took effect and logs the outcome
(ERROR on failure); a job that asked for replay fails instead of training without it.

Files as in every adapter (docs/porting.md), plus ``main_ppo.py`` (the launcher) and
``agent_loop.py`` (the first-seen tool agent loop). See docs/use-with-verl.md.
"""
from __future__ import annotations

import logging
import os

from r3bridge.adapters.verl.codec import ROUTES_KEY, SAMPLE_KEY, VerlCodec
from r3bridge.adapters.verl.config import (
    ENV_VAR,
    check_engine_config,
    prepare_verl_config,
    replay_config_from_env,
    replay_config_from_verl,
    validate_verl_config,
)
from r3bridge.adapters.verl.rollout import VerlRollout
from r3bridge.announce import ensure_visible

logger = logging.getLogger(__name__)
ensure_visible()        # the INFO lines below reach a handler (verl's root logger sits at WARNING)

ENGINE_KEY = ("language_model", "megatron", "cuda", "nvidia")
LOADED = False          # True once the engine is registered and the registry resolves to it
LOAD_ERROR: str | None = None


def _install() -> type:
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
    return R3BridgeMegatronEngine


def _register() -> None:
    global LOADED, LOAD_ERROR
    try:
        engine = _install()
        LOADED, LOAD_ERROR = True, None
        logger.info("r3bridge verl adapter loaded (pid %d): %s registered for %s; replay config: %s",
                    os.getpid(), engine.__name__, ENGINE_KEY, replay_config_from_env().as_dict())
    except Exception as e:  # noqa: BLE001  (verl would hide it: say it loudly instead)
        LOAD_ERROR = f"{type(e).__name__}: {e}"
        logger.error("r3bridge verl adapter NOT loaded in pid %d: %s. Routing replay is inactive in "
                     "this process.", os.getpid(), LOAD_ERROR)
        mode = _requested_mode()
        if mode != "off":
            # A job that asked for replay must not train without it. verl's plugin loader only
            # logs this at DEBUG, but its external_lib import (which the launcher always sets)
            # re-imports this module and fails the worker with it.
            raise ImportError(f"r3bridge verl adapter failed to load in pid {os.getpid()} although "
                              f"replay_mode={mode}: {LOAD_ERROR}") from e


def register() -> bool:
    """Register r3bridge's engine in verl's ``EngineRegistry`` (idempotent). Returns :data:`LOADED`."""
    if not LOADED:
        _register()
    return LOADED


def _requested_mode() -> str:
    try:
        return replay_config_from_env().replay_mode.value
    except Exception as e:  # noqa: BLE001  (a broken R3BRIDGE_CONFIG is a request we cannot read)
        return f"unreadable ({e})"


if _requested_mode() != "off":      # opt-in: replay off imports nothing more and registers nothing
    _register()

__all__ = ["LOADED", "LOAD_ERROR", "ENGINE_KEY", "ENV_VAR", "ROUTES_KEY", "SAMPLE_KEY", "VerlCodec", "VerlRollout",
           "register", "replay_config_from_env",
           "replay_config_from_verl", "validate_verl_config", "check_engine_config", "prepare_verl_config"]

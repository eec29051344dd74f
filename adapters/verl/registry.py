"""r3bridge's engine in verl's ``EngineRegistry`` for ``(language_model, megatron, cuda, nvidia)``, loudly.

``import verl`` imports the adapter in the driver and every Ray worker (its ``verl.plugins`` entry
point; ``actor_rollout_ref.model.external_lib`` too) and hides an import error at DEBUG: replay would
be off in that process without a word. :func:`register` therefore logs the outcome (INFO, or ERROR
naming the error) and, when the job asked for replay (``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``,
which the launcher hands every worker), fails with an ``ImportError`` instead of training without it.
:func:`requested_mode` is the opt-in: a job that did not ask for replay imports nothing of verl's internals.
With the engine, verl's rollout name ``sglang`` is served by r3bridge's SGLang replica, whose server reads
SGLang's routes itself (:mod:`r3bridge.adapters.verl.sglang_routes`: verl 0.9.1's own reading fails on
SGLang 0.5.12); SGLang is imported only when verl starts that rollout.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping, Optional

from r3bridge.config import ReplayConfig

__all__ = ["ENGINE_KEY", "LOADED", "LOAD_ERROR", "register", "requested_mode"]

logger = logging.getLogger("r3bridge.adapters.verl")
ENGINE_KEY = ("language_model", "megatron", "cuda", "nvidia")
LOADED = False          # True once the engine is registered and the registry resolves to it
LOAD_ERROR: Optional[str] = None


def requested_mode(environ: Optional[Mapping[str, str]] = None) -> str:
    """The replay mode this process's environment asks for (``off``, ``R2``, ``R3``); a broken
    ``R3BRIDGE_CONFIG`` is a request that cannot be read (``unreadable (...)``), never ``off``."""
    try:
        return ReplayConfig.from_env(environ).replay_mode.value
    except Exception as e:  # noqa: BLE001
        return f"unreadable ({e})"


def _install() -> str:
    """Register the engine at ENGINE_KEY unless the registry already holds it; the registry must
    then resolve to it, else a ``RuntimeError`` names what it holds. Returns what was registered."""
    from verl.workers.engine.base import EngineRegistry

    from r3bridge.versions import check_internals, check_release

    check_release("verl", what="'s verl adapter")
    check_internals("verl", [("verl.workers.engine.base.EngineRegistry._engines", EngineRegistry, "_engines")])
    from r3bridge.adapters.verl.hooks import R3BridgeMegatronEngine

    model_type, backend, device, vendor = ENGINE_KEY

    def lookup():
        return EngineRegistry._engines.get(model_type, {}).get(backend, {}).get((device, vendor))

    if lookup() is None:
        EngineRegistry.register(model_type=model_type, backend=backend, device=device,
                                vendor=vendor)(R3BridgeMegatronEngine)
    if lookup() is not R3BridgeMegatronEngine:
        raise RuntimeError(f"EngineRegistry holds {lookup()!r} for {ENGINE_KEY}, not the r3bridge engine")
    # verl's SGLang rollout cannot read SGLang 0.5.11+'s routes itself (sglang_routes.py): r3bridge's
    # replica serves verl's name "sglang" (SGLang is imported only when verl starts that rollout)
    from r3bridge.adapters.verl.sglang_routes import register_sglang_rollout

    register_sglang_rollout()
    return f"{R3BridgeMegatronEngine.__name__} registered for {ENGINE_KEY}; rollout 'sglang' read by r3bridge"


def register() -> bool:
    """Register r3bridge's engine in verl's ``EngineRegistry`` (idempotent). Returns :data:`LOADED`;
    raises ``ImportError`` when it could not and this process's job asked for replay."""
    global LOADED, LOAD_ERROR
    if LOADED:
        return True
    try:
        registered = _install()
    except Exception as e:  # noqa: BLE001  (verl would hide it: say it loudly instead)
        LOAD_ERROR = f"{type(e).__name__}: {e}"
        logger.error("r3bridge verl adapter NOT loaded in pid %d: %s. Routing replay is inactive in this process.",
                     os.getpid(), LOAD_ERROR)
        mode = requested_mode()
        if mode != "off":
            raise ImportError(f"r3bridge verl adapter failed to load in pid {os.getpid()} although "
                              f"replay_mode={mode}: {LOAD_ERROR}") from e
        return False
    LOADED, LOAD_ERROR = True, None
    try:
        config = ReplayConfig.from_env().as_dict()
    except Exception as e:  # noqa: BLE001  (the engine refuses it when it resolves its options)
        config = f"unreadable ({e})"
    logger.info("r3bridge verl adapter loaded (pid %d): %s; replay config: %s", os.getpid(), registered, config)
    return True

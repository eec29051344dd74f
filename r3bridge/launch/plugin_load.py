"""An adapter registering itself where a framework imports it as a plugin, loudly.

A framework that imports plugins itself (verl: its ``verl.plugins`` entry points and
``external_lib``, in the driver and every Ray worker) may hide an import error: replay would be off
in that process without a word. :func:`load_plugin` runs the adapter's registration, logs the
outcome (INFO, or ERROR naming the error), and, when the job asked for replay
(``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE``, which the launcher hands every worker), fails
with an ``ImportError`` instead of training without it. :func:`requested_mode` is the opt-in: an
adapter whose job did not ask for replay imports nothing of its framework's internals.
:func:`register_once` puts the adapter's engine class into the framework's registry and checks that
the registry then resolves to it; :func:`outcome_recorder` keeps the outcome where the adapter reads it.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping, MutableMapping, Optional

from r3bridge.config import ReplayConfig

__all__ = ["load_plugin", "requested_mode", "register_once", "outcome_recorder"]


def requested_mode(environ: Optional[Mapping[str, str]] = None) -> str:
    """The replay mode this process's environment asks for (``off``, ``R2``, ``R3``); a broken
    ``R3BRIDGE_CONFIG`` is a request that cannot be read (``unreadable (...)``), never ``off``."""
    try:
        return ReplayConfig.from_env(environ).replay_mode.value
    except Exception as e:  # noqa: BLE001
        return f"unreadable ({e})"


def load_plugin(adapter: str, register: Callable[[], str], logger: logging.Logger,
                record: Callable[[Optional[str]], None] = lambda error: None) -> bool:
    """Run ``register()`` (returns what it registered, for the log line); ``record`` receives
    ``None`` or the error. Returns whether it registered; raises ``ImportError`` when it did not
    and replay was asked for."""
    try:
        registered = register()
    except Exception as e:  # noqa: BLE001  (the framework would hide it: say it loudly instead)
        error = f"{type(e).__name__}: {e}"
        record(error)
        logger.error("r3bridge %s adapter NOT loaded in pid %d: %s. Routing replay is inactive in this process.",
                     adapter, os.getpid(), error)
        mode = requested_mode()
        if mode != "off":
            raise ImportError(f"r3bridge {adapter} adapter failed to load in pid {os.getpid()} although "
                              f"replay_mode={mode}: {error}") from e
        return False
    record(None)
    logger.info("r3bridge %s adapter loaded (pid %d): %s; replay config: %s", adapter, os.getpid(), registered,
                ReplayConfig.from_env().as_dict())
    return True


def register_once(engine: type, registry: str, key: Any, *, lookup: Callable[[], Any],
                  register: Callable[[type], Any]) -> str:
    """``register(engine)`` unless ``lookup()`` (what ``registry`` holds at ``key``, ``None``: nothing)
    already returns it; the registry must then resolve to ``engine``, else a ``RuntimeError`` names
    what it holds. Returns what was registered, for :func:`load_plugin`'s log line."""
    got = lookup()
    if got is None:
        register(engine)
        got = lookup()
    if got is not engine:
        raise RuntimeError(f"{registry} holds {got!r} for {key}, not the r3bridge engine")
    return f"{engine.__name__} registered for {key}"


def outcome_recorder(namespace: MutableMapping[str, Any]) -> Callable[[Optional[str]], None]:
    """A :func:`load_plugin` ``record`` keeping the outcome in ``namespace`` (an adapter module's
    ``globals()``): ``LOADED`` (whether it registered) and ``LOAD_ERROR`` (``None`` or the error)."""
    def record(error: Optional[str]) -> None:
        namespace.update(LOADED=error is None, LOAD_ERROR=error)
    return record

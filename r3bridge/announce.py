"""The one startup line every adapter logs, and the ``r3bridge/replay_mode`` metric.

A job whose ``r3bridge`` setting is missing or mistyped trains with replay off; that must be seen,
not found out later. Each adapter calls :func:`announce` once per process and model when it
starts, and logs :func:`replay_mode_metric` with its metrics (``off`` is 0, ``R2`` 2, ``R3`` 3).
"""
from __future__ import annotations

import logging
import os

from r3bridge.config import ORIGIN_DEFAULT, ReplayConfig, ReplayMode

__all__ = ["announce", "replay_mode_metric", "ensure_visible", "REPLAY_MODE_CODES", "logger"]

REPLAY_MODE_CODES = {ReplayMode.OFF: 0.0, ReplayMode.R2: 2.0, ReplayMode.R3: 3.0}

logger = logging.getLogger("r3bridge")


def ensure_visible() -> None:
    """The INFO line reaches a handler: unless someone set the ``r3bridge`` logger's level, it is
    INFO (``R3BRIDGE_LOGGING_LEVEL`` overrides), since a framework that configured only the root
    logger (a root handler, root at WARNING) would drop it; a process that configured no
    logging at all (Ray workers) gets a stderr handler."""
    if logger.level == logging.NOTSET:
        logger.setLevel(os.getenv("R3BRIDGE_LOGGING_LEVEL", "INFO"))
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = _UntilRootHandles()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    logger.addHandler(handler)


class _UntilRootHandles(logging.StreamHandler):
    """stderr, while the root logger has no handler: a framework that configures logging later
    (hydra, ``logging.basicConfig``) then prints each line once, through its own handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def replay_mode_metric(cfg: ReplayConfig) -> dict[str, float]:
    """``{prefix}replay_mode``: 0 (off), 2 (R2) or 3 (R3)."""
    return {f"{cfg.metrics_prefix}replay_mode": REPLAY_MODE_CODES[cfg.replay_mode]}


def announce(cfg: ReplayConfig, origin: str, where: str) -> str:
    """Log which replay mode is in force in ``where`` (e.g. ``"policy worker"``) and where it
    came from (``config``, ``environment (...)``, ``default``). Replay off is a WARNING (shown with
    its level, :func:`ensure_visible`), saying whether a setting asked for it or none was found; returns
    the line."""
    mode = cfg.replay_mode
    ensure_visible()        # a handler that prints the level: Python's last-resort handler prints the bare message
    line = f"r3bridge ({where}, pid {os.getpid()}): replay_mode={mode.value} (from {origin})"
    ensure_visible()        # off too: a process without logging set-up would print it without its level
    if mode is ReplayMode.OFF:
        if origin == ORIGIN_DEFAULT:
            line += ("; no r3bridge setting was found, so routing replay is OFF (set the framework's r3bridge "
                     "section, or R3BRIDGE_REPLAY_MODE / R3BRIDGE_CONFIG)")
        else:
            line += "; routing replay is OFF: the trainer routes natively (the baseline R2 / R3 are compared with)"
        logger.warning(line)
    else:
        logger.info(line)
    return line

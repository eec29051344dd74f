"""A module every worker of a job imports, added to the job's setting that lists them."""
from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["ensure_listed"]


def ensure_listed(section: Any, key: str, item: str) -> None:
    """``item`` in ``section[key]``, a setting that takes one string or a list (e.g. the modules a
    framework imports in every worker): appended after the user's own entries, a lone item kept
    a string. ``section``: an OmegaConf node (its struct mode is respected) or a dict."""
    from omegaconf import DictConfig, open_dict

    current = section.get(key)
    items = [] if not current else [current] if isinstance(current, str) else list(current)
    if item not in items:
        with open_dict(section) if isinstance(section, DictConfig) else contextlib.nullcontext():
            section[key] = items + [item] if items else item

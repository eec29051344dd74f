"""Importing SkyRL 0.3.x / 0.4.x modules (:func:`r3bridge.versions.import_skipping_inits`), and
telling the two releases apart (their transports differ)."""
from __future__ import annotations

import sys
from typing import Optional

from r3bridge.versions import import_skipping_inits, supported_series

SUPPORTED_RELEASES = ("0.3", "0.4")


def _chain_failure(e: BaseException) -> bool:
    """SkyRL's package ``__init__`` chains: pydantic refuses their ``TypedDict`` models on Python < 3.12,
    and SkyRL 0.4 imports packages its ``--no-deps`` install lacks (the adapter's modules need neither)."""
    missing = isinstance(e, ModuleNotFoundError) and not (e.name or "").startswith("skyrl")
    return missing or ("TypedDict" in str(e) and sys.version_info < (3, 12))


def import_skyrl(name: str):
    """``importlib.import_module(name)``, skipping the failing ``__init__`` s of its chain."""
    parts = name.split(".")
    return import_skipping_inits(name, ("skyrl.backends", *(".".join(parts[:i]) for i in range(2, len(parts)))),
                                 when=_chain_failure)


def skyrl_release(version: Optional[str] = None) -> Optional[str]:
    """``"0.3"`` / ``"0.4"`` for the installed SkyRL (or ``version``), ``None`` if not installed;
    ``ConfigError`` for any other release (the extra's range and the known transports must agree)."""
    return supported_series("skyrl", version, SUPPORTED_RELEASES, what="'s SkyRL adapter",
                            knows="the route transport of SkyRL")

"""Importing SkyRL 0.3.x / 0.4.x modules, and telling the two releases apart.

SkyRL's package ``__init__`` chains define pydantic models over ``typing.TypedDict``, which pydantic
refuses on Python < 3.12, and SkyRL 0.4's import packages its ``--no-deps`` install lacks; the
modules this adapter uses need neither. :func:`import_skyrl` imports normally and, only if that
fails *in the chain*, skips the failing package ``__init__`` s and retries
(:func:`r3bridge.versions.import_skipping_inits`). :func:`skyrl_release`: ``"0.3"`` / ``"0.4"``
(the transports differ), ``None`` when not installed; any other release is refused.
"""
from __future__ import annotations

import sys
from typing import Optional

from r3bridge.errors import ConfigError
from r3bridge.versions import check_release, import_skipping_inits, release_series

SUPPORTED_RELEASES = ("0.3", "0.4")


def _chain_failure(e: BaseException) -> bool:
    """The package-init chain's pydantic refusal (Python < 3.12), or a module outside skyrl that
    SkyRL 0.4's ``--no-deps`` install lacks."""
    missing = isinstance(e, ModuleNotFoundError) and not (e.name or "").startswith("skyrl")
    return missing or ("TypedDict" in str(e) and sys.version_info < (3, 12))


def import_skyrl(name: str):
    """``importlib.import_module(name)`` for a ``skyrl.*`` module, skipping ``skyrl.backends``'
    and the module's parent packages' ``__init__`` where they fail as described above."""
    parts = name.split(".")
    return import_skipping_inits(name, ("skyrl.backends", *(".".join(parts[:i]) for i in range(2, len(parts)))),
                                 when=_chain_failure)


def skyrl_release(version: Optional[str] = None) -> Optional[str]:
    """``"0.3"`` / ``"0.4"`` for the installed SkyRL (or ``version``), ``None`` if not installed.
    ``ConfigError`` outside the range r3bridge's ``skyrl`` extra declares (:mod:`r3bridge.versions`)."""
    checked = check_release("skyrl", version, what="'s SkyRL adapter")
    if checked is None:
        return None
    release = release_series(checked)
    if release not in SUPPORTED_RELEASES:   # the extra's range and the known transports must agree
        raise ConfigError(f"skyrl {version or checked} is installed; r3bridge's SkyRL adapter knows the route transport "
                          f"of SkyRL {' and '.join(r + '.x' for r in SUPPORTED_RELEASES)} only")
    return release

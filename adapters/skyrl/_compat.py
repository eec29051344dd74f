"""Importing SkyRL 0.3.x / 0.4.x modules, and telling the two releases apart.

SkyRL's package ``__init__`` chains (``skyrl.backends`` -> ``backend.py`` -> ``skyrl.tinker.types``;
``skyrl.train.generators`` -> the VLM generator -> ``skyrl.backends.renderer`` -> the same types)
defines pydantic models over ``typing.TypedDict``, which pydantic refuses on Python < 3.12
("Please use typing_extensions.TypedDict"). The modules this adapter uses do not need that chain.
:func:`import_skyrl` imports normally and, only if that fails *in the chain*, registers
``skyrl.backends`` and any parent package of the requested module whose ``__init__`` fails as
bare package objects pointing at the real directories (the ``__init__`` is skipped, every
submodule is SkyRL's own file) and retries. SkyRL 0.4's chain also imports packages its
``--no-deps`` install lacks (``skyrl.backends.backend`` -> ``cloudpathlib``): a missing module
raised from inside that chain is handled the same way. Anything else is raised.

:func:`skyrl_release` reads the installed distribution's version: ``"0.3"`` or ``"0.4"`` (the
transports differ), ``None`` when SkyRL is not installed; any other release is refused with a
:class:`r3bridge.errors.ConfigError` when the adapter is imported.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Optional

from r3bridge.errors import ConfigError
from r3bridge.versions import check_release, release_series

SUPPORTED_RELEASES = ("0.3", "0.4")

_SHIMMED = ("skyrl.backends",)


def _shim_package(name: str) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.find_spec("skyrl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("skyrl is not installed")
    root = list(spec.submodule_search_locations)[0]
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.join(root, *name.split(".")[1:])]
    pkg.__package__ = name
    pkg.__r3bridge_shim__ = True    # type: ignore[attr-defined]
    sys.modules[name] = pkg


def import_skyrl(name: str):
    """``importlib.import_module(name)`` for a ``skyrl.*`` module, working around the Python 3.11
    package-init failure described above."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        chain = "TypedDict" in str(e) and sys.version_info < (3, 12)
        missing = isinstance(e, ModuleNotFoundError) and not (e.name or "").startswith("skyrl")
        if not (chain or missing):
            raise
        for mod in [m for m in sys.modules if m == "skyrl.backends" or m.startswith("skyrl.backends.")]:
            if sys.modules.get(mod) is None:
                del sys.modules[mod]
        parts = name.split(".")
        parents = [".".join(parts[:i]) for i in range(2, len(parts))]   # e.g. skyrl.train.generators
        for pkg in (*_SHIMMED, *parents):
            try:
                importlib.import_module(pkg)
            except Exception:  # noqa: BLE001 - this package's __init__ is in the failing chain
                for mod in [m for m in sys.modules if m == pkg and sys.modules.get(m) is None]:
                    del sys.modules[mod]
                _shim_package(pkg)
        return importlib.import_module(name)


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

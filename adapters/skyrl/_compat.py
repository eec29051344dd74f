"""Importing SkyRL 0.3.x modules.

SkyRL's package ``__init__`` chains (``skyrl.backends`` -> ``backend.py`` -> ``skyrl.tinker.types``;
``skyrl.train.generators`` -> the VLM generator -> ``skyrl.backends.renderer`` -> the same types)
defines pydantic models over ``typing.TypedDict``, which pydantic refuses on Python < 3.12
("Please use typing_extensions.TypedDict"). The modules this adapter uses do not need that chain.
:func:`import_skyrl` imports normally and, only if that fails *in the chain*, registers
``skyrl.backends`` and any parent package of the requested module whose ``__init__`` fails as
bare package objects pointing at the real directories (the ``__init__`` is skipped, every
submodule is SkyRL's own file) and retries. On Python >= 3.12 nothing is changed.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

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
        if "TypedDict" not in str(e) or sys.version_info >= (3, 12):
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

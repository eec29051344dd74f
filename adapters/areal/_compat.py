"""Importing AReaL 1.0.x modules without its whole agent stack.

``import areal`` runs ``areal/__init__`` -> ``areal.infra`` -> workflow executor -> the OpenAI
agent client (``openai``, ``litellm``, ...), which this adapter never uses. :func:`import_areal`
imports normally and, if that fails, registers ``areal`` and ``areal.infra`` as bare package
objects pointing at the real directories (their ``__init__`` is skipped, every submodule is
AReaL's own file) and retries.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

_SHIMMED = ("areal", "areal.infra")


def _shim_packages() -> None:
    spec = importlib.util.find_spec("areal")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("areal is not installed")
    root = list(spec.submodule_search_locations)[0]
    for name in _SHIMMED:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None) is not None and not hasattr(mod, "__r3bridge_shim__"):
            continue                                   # the real package imported fine earlier
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(root, *name.split(".")[1:])]
        pkg.__package__ = name
        pkg.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        pkg.__spec__.submodule_search_locations = list(pkg.__path__)
        pkg.__r3bridge_shim__ = True                   # type: ignore[attr-defined]
        sys.modules[name] = pkg
    try:    # what areal/__init__ re-exports and the workflows import from it
        wc = importlib.import_module("areal.infra.workflow_context")
        sys.modules["areal"].workflow_context = wc              # type: ignore[attr-defined]
        sys.modules["areal.infra"].workflow_context = wc        # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - only the workflows need it
        pass


def import_areal(name: str):
    """Import ``name`` (see the module docstring)."""
    try:
        return importlib.import_module(name)
    except ImportError as first:
        for mod in [m for m in list(sys.modules) if m == "areal" or m.startswith("areal.")]:
            if sys.modules.get(mod) is None:
                del sys.modules[mod]
        _shim_packages()
        try:
            return importlib.import_module(name)
        except ImportError as again:
            # the first failure is the cause a user can act on (a missing package, say): keep it
            raise again from first

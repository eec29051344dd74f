"""Importing AReaL 1.0.x modules without its whole agent stack.

``import areal`` runs ``areal/__init__`` -> ``areal.infra`` -> workflow executor -> the OpenAI
agent client (``openai``, ``litellm``, ...), which this adapter never uses. :func:`import_areal`
imports normally and, if that fails, registers ``areal`` and ``areal.infra`` as bare package
objects pointing at the real directories (their ``__init__`` is skipped, every submodule is
AReaL's own file) and retries.

``stub_binary_deps=True`` (tests only) also registers stand-ins for two compiled packages that
AReaL imports at module level but the imported code paths never need: ``uvloop`` (whose
``install()`` at ``areal.api.cli_args`` import would change the process-wide asyncio policy; the
stand-in's is a no-op) and ``numba`` (``@numba.njit`` becomes the identity: same results, pure
Python speed). Product code never passes it.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
import logging

_SHIMMED = ("areal", "areal.infra")


def _stub_binary_deps() -> list[str]:
    done = []
    if "uvloop" not in sys.modules and importlib.util.find_spec("uvloop") is None:
        m = types.ModuleType("uvloop")
        m.__spec__ = importlib.machinery.ModuleSpec("uvloop", None)
        m.install = lambda: None                       # type: ignore[attr-defined]
        m.new_event_loop = asyncio.new_event_loop      # type: ignore[attr-defined]
        m.run = asyncio.run                            # type: ignore[attr-defined]
        m.__r3bridge_stub__ = True                     # type: ignore[attr-defined]
        sys.modules["uvloop"] = m
        done.append("uvloop")
    if "numba" not in sys.modules and importlib.util.find_spec("numba") is None:
        m = types.ModuleType("numba")
        m.__spec__ = importlib.machinery.ModuleSpec("numba", None)

        def njit(*a, **k):
            if len(a) == 1 and callable(a[0]) and not k:
                return a[0]
            return lambda f: f
        m.njit = njit                                  # type: ignore[attr-defined]
        m.jit = njit                                   # type: ignore[attr-defined]
        m.__r3bridge_stub__ = True                     # type: ignore[attr-defined]
        sys.modules["numba"] = m
        done.append("numba")
    return done


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


@contextlib.contextmanager
def _keep_logging():
    """``areal.utils.logging.getLogger`` (called at import by most AReaL modules) replaces
    ``logging.Logger.root`` / ``Logger.manager`` with fresh ones and applies a dictConfig with
    ``disable_existing_loggers``: fine in an AReaL process, but in a shared test process every
    logger created afterwards would hang off AReaL's root. Put the process's own back."""
    root, manager = logging.Logger.root, logging.Logger.manager
    try:
        yield
    finally:
        logging.Logger.root, logging.Logger.manager = root, manager


def import_areal(name: str, *, stub_binary_deps: bool = False):
    """Import ``name`` (see the module docstring). ``stub_binary_deps=True`` is the test mode: also
    the stand-ins for uvloop / numba, and the process's logging tree is kept."""
    ctx = _keep_logging() if stub_binary_deps else contextlib.nullcontext()
    with ctx:
        if stub_binary_deps:
            _stub_binary_deps()
        try:
            return importlib.import_module(name)
        except ImportError:
            for mod in [m for m in list(sys.modules) if m == "areal" or m.startswith("areal.")]:
                if sys.modules.get(mod) is None:
                    del sys.modules[mod]
            _shim_packages()
            return importlib.import_module(name)

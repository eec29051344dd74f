"""Importing AReaL 1.0.4's Megatron engine in a CPU test process (tests only).

``areal/engine/megatron_engine.py`` imports, at module level, two things that cannot exist on
this CPU machine; everything else it imports is AReaL's own code or a small package installed by
``make install`` (``uvloop``, ``numba``, ``pybase64``, ...: pyproject.toml's ``frameworks`` dependency
group, pinned in constraints.txt):

* ``megatron.bridge`` (package ``megatron-bridge``): AReaL 1.0.4 pins ``megatron-bridge==0.4.0``
  for Python >= 3.12 only, and every release that installs on Python 3.11 (0.3.x) imports
  Transformer Engine at package import (``megatron/bridge/peft/lora_layers.py``). The engine
  uses it only when ``megatron.bridge_type == "megatron-bridge"`` (and for LoRA); the default
  ``"mbridge"`` path, the one tested, never touches it. The stand-in's ``AutoBridge`` and
  ``LoRA`` raise :class:`StandInUsed` when called, so a test that took that path fails loudly.
* ``areal.engine.megatron_utils.fp8.kernels``: Triton kernels for FP8 weight casts
  (``import triton`` at module level; Triton kernels run on CUDA only, and a Triton stand-in
  would change what ``torch._dynamo`` believes about the machine). Used only with
  ``megatron.fp8_config`` set; the stand-in's two functions raise :class:`StandInUsed`.

And one package ``__init__`` is skipped: ``areal/trainer/__init__`` imports every trainer and,
through ``areal.utils.stats_logger``, the experiment loggers (``swanlab``, ``wandb``,
``tensorboardX``), which the actor never uses; ``areal.trainer`` is registered as a bare package
over its real directory (as the adapter's importer does for ``areal`` / ``areal.infra``), so
``areal.trainer.ppo.actor`` and every other submodule are AReaL's own files.

None of this changes what the engine does with batches, micro-batches or schedules.
:func:`apply` registers them (worker processes only); :func:`import_areal` imports through the
adapter's own importer, keeping this process's logging tree (tests in one process share it).
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import logging
import os
import sys
import types
from typing import Any, Iterator

__all__ = ["StandInUsed", "apply", "import_areal", "STAND_INS"]

_BARE = ("areal.trainer",)
STAND_INS = ("megatron.bridge", "megatron.bridge.peft", "megatron.bridge.peft.lora",
             "areal.engine.megatron_utils.fp8.kernels")


class StandInUsed(RuntimeError):
    """A code path that needs a package the CPU test machine cannot have was taken."""


def _unavailable(what: str):
    def call(*args: Any, **kwargs: Any) -> Any:
        raise StandInUsed(f"{what} is a test stand-in (testlab.areal_env): the tested AReaL path "
                          f"must not reach it")
    call.__name__ = what.rsplit(".", 1)[-1]
    return call


def _module(name: str, *, package: bool = False, **attrs: Any) -> None:
    if name in sys.modules:
        return
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        m.__path__ = []
    m.__r3bridge_stand_in__ = True                    # type: ignore[attr-defined]
    m.__dict__.update(attrs)
    sys.modules[name] = m


def apply() -> list[str]:
    """Register the stand-ins (idempotent; a real module already imported is left alone)."""
    import importlib.util

    done = []
    try:
        real_bridge = importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):
        real_bridge = False
    if not real_bridge:
        _module("megatron.bridge", package=True, AutoBridge=_unavailable("megatron.bridge.AutoBridge"))
        _module("megatron.bridge.peft", package=True)
        _module("megatron.bridge.peft.lora", LoRA=_unavailable("megatron.bridge.peft.lora.LoRA"))
        done += ["megatron.bridge"]
    if importlib.util.find_spec("triton") is None:
        name = "areal.engine.megatron_utils.fp8.kernels"
        _module(name, blockwise_cast_to_fp8_triton=_unavailable(f"{name}.blockwise_cast_to_fp8_triton"),
                weight_dequant=_unavailable(f"{name}.weight_dequant"))
        done.append(name)
    if importlib.util.find_spec("swanlab") is None:
        for name in _BARE:
            if name not in sys.modules:
                root = importlib.util.find_spec("areal").submodule_search_locations[0]
                _module(name, package=True)
                sys.modules[name].__path__ = [os.path.join(root, *name.split(".")[1:])]
                sys.modules[name].__spec__.submodule_search_locations = list(sys.modules[name].__path__)
                done.append(name)
    return done


@contextlib.contextmanager
def _keep_logging() -> Iterator[None]:
    """``areal.utils.logging.getLogger`` (called at import by most AReaL modules) replaces
    ``logging.Logger.root`` / ``Logger.manager`` with fresh ones and applies a dictConfig with
    ``disable_existing_loggers``: fine in an AReaL process, but in a shared test process every
    logger created afterwards would hang off AReaL's root (pytest's ``caplog`` would see nothing).
    Put the process's own back."""
    root, manager = logging.Logger.root, logging.Logger.manager
    try:
        yield
    finally:
        logging.Logger.root, logging.Logger.manager = root, manager


def import_areal(name: str, *, stand_ins: bool = False) -> Any:
    """``name`` imported through the adapter's importer, keeping this process's logging tree.
    ``stand_ins=True`` (worker processes that import ``areal.engine.megatron_engine``) registers
    the stand-ins above first; the shared pytest process never needs them (verl, for one, tells
    whether megatron-bridge is installed by importing it)."""
    from r3bridge.adapters.areal._compat import import_areal as _import

    if stand_ins:
        apply()
    with _keep_logging():
        return _import(name)

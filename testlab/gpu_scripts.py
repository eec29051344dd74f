"""The GPU scripts of ``scripts/gpu/`` as modules, for the CPU tests that check their pure parts
(payload checks, comparisons, canaries) on recorded payloads."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

GPU_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "gpu"


def gpu_script(name: str) -> ModuleType:
    """``scripts/gpu/<name>.py`` imported as module ``name`` (registered in ``sys.modules``: its
    dataclasses and the scripts that import each other need it)."""
    spec = importlib.util.spec_from_file_location(name, GPU_SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

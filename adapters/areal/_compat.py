"""Importing AReaL 1.0.x modules without its agent stack (``import areal`` imports the OpenAI agent
client, which this adapter never uses): docs/frameworks.md, "How the modules are imported"."""
from __future__ import annotations

import importlib
import sys

from r3bridge.versions import import_skipping_inits


def _workflow_context() -> None:
    try:    # what areal/__init__ re-exports and the workflows import from it
        wc = importlib.import_module("areal.infra.workflow_context")
        sys.modules["areal"].workflow_context = wc              # type: ignore[attr-defined]
        sys.modules["areal.infra"].workflow_context = wc        # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - only the workflows need it
        pass


def import_areal(name: str):
    """Import ``name``; if that fails, again with the ``__init__`` of ``areal`` and ``areal.infra`` skipped."""
    return import_skipping_inits(name, ("areal", "areal.infra"), skipped=_workflow_context)

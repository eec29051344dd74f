"""Importing AReaL 1.0.x modules without its whole agent stack.

``import areal`` runs ``areal/__init__`` -> ``areal.infra`` -> workflow executor -> the OpenAI
agent client (``openai``, ``litellm``, ...), which this adapter never uses. :func:`import_areal`
imports normally and, if that fails, skips the ``__init__`` of ``areal`` and ``areal.infra``
(:func:`r3bridge.versions.import_skipping_inits`) and retries.
"""
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
    """Import ``name`` (see the module docstring)."""
    return import_skipping_inits(name, ("areal", "areal.infra"), skipped=_workflow_context)

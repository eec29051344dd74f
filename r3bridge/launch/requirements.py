"""What the environment must offer for the workers a launcher is about to start, checked before
they start (each worker would otherwise die on its first import, one after another in Ray): a
Python release or an importable module per :class:`Requirement`, each with the adapter's own
words for why; :func:`unmet` says every missing one in one line (for :func:`r3bridge.launch.refuse`).
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Requirement", "unmet"]


@dataclass(frozen=True)
class Requirement:
    """``why``: said when unmet; ``python``: at least this ``(major, minor)``; ``module``: importable."""

    why: str
    python: Optional[tuple[int, int]] = None
    module: Optional[str] = None

    def met(self) -> bool:
        if self.python is not None and sys.version_info < self.python:
            return False
        return self.module is None or importlib.util.find_spec(self.module) is not None


def unmet(requirements: Sequence[Requirement], *, lead: str, remedy: str) -> Optional[str]:
    """``"{lead}: {why}; {why}. {remedy}"`` over the unmet requirements; ``None`` when all are met."""
    reasons = [r.why for r in requirements if not r.met()]
    return f"{lead}: {'; '.join(reasons)}. {remedy}" if reasons else None

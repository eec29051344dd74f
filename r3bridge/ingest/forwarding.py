"""Wrapping a framework's client by composition (never a patched class): the rollout side's
capture sits between a framework's loop and its engine client."""
from __future__ import annotations

from typing import Any

__all__ = ["Forwarding"]


class Forwarding:
    """Every attribute a subclass does not define is :attr:`inner`'s (the wrapped object's)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

"""Wrapping a framework's client by composition (never a patched class): the rollout side's
capture sits between a framework's loop and its engine client."""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

__all__ = ["Forwarding", "Intercepting", "RecordingCalls"]


class Forwarding:
    """Every attribute a subclass does not define is :attr:`inner`'s (the wrapped object's)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Intercepting(Forwarding):
    """:attr:`inner` with its method named ``method`` (the framework's name) replaced by
    ``wrap(inner's method)``; every other attribute is ``inner``'s."""

    def __init__(self, inner: Any, method: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        super().__init__(inner)
        self._method = method
        self._wrap = wrap

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.inner, name)
        return self._wrap(found) if name == self.__dict__.get("_method") else found


class RecordingCalls(Intercepting):
    """:attr:`inner` (an engine client) whose async method named ``method`` also keeps each result
    in :attr:`results`, in call order (what a framework's rollout loop got for one sample).
    ``through(inner's method, *args, **kwargs)``: what each call awaits instead of the method itself
    (e.g. one that sees and dedupes the call's attempts)."""

    def __init__(self, inner: Any, method: str,
                 through: Optional[Callable[..., Awaitable[Any]]] = None) -> None:
        super().__init__(inner, method, self._recording)
        self.results: list[Any] = []
        self._through = through

    def _recording(self, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def recorded(*args: Any, **kwargs: Any) -> Any:
            result = await (call(*args, **kwargs) if self._through is None else self._through(call, *args, **kwargs))
            self.results.append(result)
            return result
        return recorded

"""The one call recorder: a framework's client wrapped by composition (never a patched class), so
the rollout side's capture sits between a framework's loop and its engine client and sees each call.

:class:`CallRecorder` wraps one method of the client (an engine client's generate, a backend's
response parser: the framework's name); every other attribute is the client's. Each adapter's
hook point wraps its client in one and says what to keep of each call (:attr:`CallRecorder.results`
by default, or its own ``record``).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

__all__ = ["Forwarding", "CallRecorder", "RecordedCall"]


class Forwarding:
    """Every attribute a subclass does not define is :attr:`inner`'s (the wrapped object's)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass(frozen=True)
class RecordedCall:
    """One finished call of the recorded method: its arguments and what it returned."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    result: Any = None


class CallRecorder(Forwarding):
    """:attr:`inner` (an engine client, or its backend) whose method named ``method`` (sync or
    async) runs as before and hands each finished call to ``record`` (a :class:`RecordedCall`);
    without ``record`` each call's result is kept in :attr:`results`, in call order (what a
    framework's rollout loop got for one sample). ``through(inner's method, *args, **kwargs)``:
    what each call runs instead of the method itself (e.g. one that sees and dedupes the call's
    attempts). A call that raises records nothing. Every other attribute is ``inner``'s."""

    def __init__(self, inner: Any, method: str, *, record: Optional[Callable[[RecordedCall], None]] = None,
                 through: Optional[Callable[..., Any]] = None) -> None:
        super().__init__(inner)
        self.results: list[Any] = []
        self._method = method
        self._record = record
        self._through = through

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.inner, name)
        return self._recorded(found) if name == self.__dict__.get("_method") else found

    def _keep(self, args: tuple, kwargs: dict, result: Any) -> None:
        if self._record is None:
            self.results.append(result)
        else:
            self._record(RecordedCall(args, kwargs, result))

    def _recorded(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            out = call(*args, **kwargs) if self._through is None else self._through(call, *args, **kwargs)
            if not inspect.isawaitable(out):
                self._keep(args, kwargs, out)
                return out
            return self._awaited(out, args, kwargs)
        return recorded

    async def _awaited(self, pending: Awaitable[Any], args: tuple, kwargs: dict) -> Any:
        result = await pending
        self._keep(args, kwargs, result)
        return result

"""SkyRL's generator side: each turn's routes merged first-seen into the earlier turns' rows (SkyRL
0.3's generator replaces a sample's routes with each new turn's, re-prefill routes for the earlier
tokens). docs/use-with-skyrl.md, "Formats and hook points"."""
from __future__ import annotations

from typing import Any, Callable, Optional

from r3bridge.rollout.stitching import first_seen_rows

__all__ = ["merge_first_seen", "first_seen_update"]


def merge_first_seen(previous: Optional[list], new: Optional[list]) -> Optional[list]:
    """A sample's routes as nested lists ``[rows, L, K]`` accumulated over turns, first-seen (both
    from row 0: each turn's prompt is the whole conversation)."""
    if new is None:
        return previous
    if previous is None or len(previous) == 0:
        return list(new)
    return first_seen_rows([previous, new])[0].tolist()


def first_seen_update(update: Callable[[Any, Any], Any], state: Any, turn: Any, field: str) -> Any:
    """``update(state, turn)``, a framework's per-turn update that replaces ``state.<field>`` with
    ``turn.<field>`` (a sample's routes from row 0), with the turn's routes merged first-seen into
    the earlier turns' rows instead (:func:`merge_first_seen`)."""
    previous = getattr(state, field)
    state = update(state, turn)
    if getattr(state, field) is not None:
        setattr(state, field, merge_first_seen(previous, getattr(turn, field)))
    return state

"""Route errors that name the sample as the framework knows it (every adapter's codec uses this).

r3bridge's core validates a packed batch and names what is wrong by *sequence* (the position in
the batch it was given), row, token and layer. An adapter ingests a framework's batch or
micro-batch, where that position means nothing to the user: verl's micro-batches are re-ordered
samples of the engine's batch, AReaL's carry global trajectory ids, SkyRL's are rows of its
``TrainingInputBatch``. :func:`naming_samples` re-raises the core's error (same class) with the
sequence replaced by the framework's name for the sample; :func:`check_topk`
(:func:`r3bridge.hf.check_topk`) refuses routes of another top-k at ingest, naming the field and both values.
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterator, Sequence

from r3bridge.errors import ReplayError
from r3bridge.hf import check_topk  # noqa: F401  (the one top-k check, re-exported for the codecs)

__all__ = ["naming_samples", "check_topk"]

_SEQUENCE = re.compile(r"\bsequence (\d+)")


@contextlib.contextmanager
def naming_samples(framework: str, names: Sequence[str]) -> Iterator[None]:
    """Inside the block, a :class:`~r3bridge.ReplayError` naming "sequence i" is raised again (same
    class, chained) as "<framework> sample <names[i]>"."""
    try:
        yield
    except ReplayError as e:
        msg = str(e)
        hit = _SEQUENCE.search(msg)
        if hit is None or int(hit.group(1)) >= len(names):
            raise
        i = int(hit.group(1))
        raise type(e)(f"{framework} sample {names[i]}: " + _SEQUENCE.sub("", msg, count=1).lstrip(", :")) from e

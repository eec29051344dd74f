"""Per-sample fields of a framework's batch, read the ways frameworks carry them, and the names
errors give each sample (``HandedRoutes(names=)``, ``ProvenancePairing.names``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["sample_field", "indexed_names"]


def sample_field(batch: Any, key: str, *, nested: Optional[str] = None) -> Any:
    """``key`` of each sample: a batch field, else (``nested``) the ``key`` of each sample's dict
    in the batch's ``nested`` field (e.g. verl 0.9.1's V1 trainer keeps ``extra_fields`` per
    sample); ``None`` when neither has it."""
    value = batch.get(key, None) if hasattr(batch, "get") else None
    if value is not None or nested is None:
        return value
    per_sample = batch.get(nested, None) if hasattr(batch, "get") else None
    rows = None if per_sample is None else per_sample.tolist() if hasattr(per_sample, "tolist") else list(per_sample)
    if not rows or not all(isinstance(r, dict) for r in rows) or not any(key in r for r in rows):
        return None
    return [r.get(key) for r in rows]


def indexed_names(count: int, indices: Any = None, uids: Any = None) -> list[str]:
    """Each sample's name: its batch-level index (``indices``, an int tensor the adapter added
    before the framework split the batch) else its micro-batch position, plus its ``uids`` entry
    (a framework's prompt-group id, non-tensor) where there is one per sample."""
    names = [f"batch index {int(i)}" for i in indices.tolist()] if indices is not None else \
        [f"micro-batch position {i}" for i in range(count)]
    try:
        uids = list(uids) if uids is not None and not isinstance(uids, torch.Tensor) else None
    except TypeError:
        uids = None
    if uids is not None and len(uids) == len(names):
        names = [f"{n} (uid {u})" for n, u in zip(names, uids)]
    return names

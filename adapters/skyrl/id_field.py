"""Sample ids carried in a routes-shaped field, for R2's recording pass.

Some frameworks copy only their routes field into micro-batches (SkyRL's
``rollout_expert_indices``, through token-based re-batching and padding too), so the recording
pass learns which sample each micro-batch row holds from that field: sample ``i`` travels as
``i + 1`` on every token, ``[n, S, 1, 1]`` int32, and a row of zeros is the framework's padding
sample (no sample id).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

__all__ = ["sample_id_field", "is_sample_id_field", "sample_ids_from_field"]

_ID_BIAS = 1        # sample i travels as i + 1: 0 stays the framework's padding


def sample_id_field(sample_ids: Iterable[int], seq_len: int) -> torch.Tensor:
    """``[n, seq_len, 1, 1]`` int32 of ``id + 1``."""
    ids = torch.as_tensor(list(sample_ids), dtype=torch.int32) + _ID_BIAS
    return ids.view(-1, 1, 1, 1).expand(ids.numel(), int(seq_len), 1, 1).contiguous()


def is_sample_id_field(field: Any) -> bool:
    """``field`` is :func:`sample_id_field`'s ``[n, S, 1, 1]`` (anything else is routes)."""
    return tuple(torch.as_tensor(field).shape[2:]) == (1, 1)


def sample_ids_from_field(field: Any, num_rows: int) -> list[Optional[int]]:
    """Each row's sample id (``None``: the framework's padding row, all zeros)."""
    raw = torch.as_tensor(field).reshape(int(num_rows), -1).max(1).values.long() - _ID_BIAS
    return [int(x) if x >= 0 else None for x in raw.tolist()]

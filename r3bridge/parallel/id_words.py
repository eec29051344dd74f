"""Route ids moved as machine words: the ``K`` ids of one (row, layer) viewed as one wider
integer (one int64 for top-8 uint8), so a gather, scatter or stack moves one element instead of
``K``. The bytes are moved, never reinterpreted."""
from __future__ import annotations

import torch

__all__ = ["as_words"]


def as_words(t: torch.Tensor) -> torch.Tensor:
    """View a contiguous ``[..., K]`` id tensor as ``[..., w]`` machine words (same bytes): moving
    one int64 per (row, layer) instead of K single bytes makes gathers and scatters ~8x cheaper."""
    nbytes = t.shape[-1] * t.element_size()
    for size, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        # torch views a tensor as a wider dtype only where its first byte is aligned to it
        if (nbytes % size == 0 and size > t.element_size() and t.is_contiguous()
                and (t.storage_offset() * t.element_size()) % size == 0):
            return t.view(dt)
    return t

"""A micro-batch the trainer packed itself (THD) as the :class:`~r3bridge.megatron.MicroBatch`
an adapter installs, with the trainer's own ``cu_seqlens_padded``."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge.megatron.phase import MicroBatch

__all__ = ["thd_micro_batch"]


def thd_micro_batch(seq_lens: Sequence[int], cu_seqlens_padded: Any, *, routes: Any = None,
                    sample_ids: Optional[Sequence[Optional[int]]] = None,
                    uids: Optional[Sequence[Any]] = None) -> MicroBatch:
    """``seq_lens``: the real sequences; ``cu_seqlens_padded`` may hold one more, a trailing
    page-padding "sequence" (AReaL's): it is declared a 1-token sequence without routes (no
    sample), so coverage counts no missing route for it; the plan still takes its padded length
    from ``cu_seqlens_padded``, which is what the CP zigzag and the SP split use."""
    cu_padded = torch.as_tensor(cu_seqlens_padded)
    lens = list(seq_lens)
    ids = None if sample_ids is None else list(sample_ids)
    names = None if uids is None else list(uids)
    if int(cu_padded.numel()) - 1 > len(lens):
        lens.append(1)
        ids = None if ids is None else ids + [None]
        names = None if names is None else names + [None]
    return MicroBatch(lens, routes, ids, format="thd", cu_seqlens_padded=cu_padded.cpu(), uids=names)

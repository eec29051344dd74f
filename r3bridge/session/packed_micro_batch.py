"""A micro-batch the trainer packed itself (THD) as the :class:`~r3bridge.megatron.MicroBatch`
an adapter installs, with the trainer's own ``cu_seqlens_padded``; :func:`packed_micro_batches`:
every micro-batch of a pass, its sequences numbered by the batch's sample ids."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from r3bridge.megatron.replay_pass import MicroBatch

__all__ = ["thd_micro_batch", "packed_micro_batches"]


def thd_micro_batch(seq_lens: Sequence[int], cu_seqlens_padded: Any, *, routes: Any = None,
                    sample_ids: Optional[Sequence[Optional[int]]] = None,
                    uids: Optional[Sequence[Any]] = None) -> MicroBatch:
    """``seq_lens``: the real sequences; ``cu_seqlens_padded`` may hold one more, a trailing
    page-padding "sequence": it is declared a 1-token sequence without routes (no
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


def packed_micro_batches(packed: Iterable[tuple[Any, Any, Any]], sample_ids: Sequence[int], *,
                         routes: Optional[Callable[[list[int], list[int]], Any]] = None,
                         uids: Optional[Callable[[Iterator[Any]], Optional[Sequence[Any]]]] = None) -> list[MicroBatch]:
    """One :func:`thd_micro_batch` per packed micro-batch, in order. ``packed``: each one's
    ``(cu_seqlens, cu_seqlens_padded, input_ids)`` (``input_ids`` packed, any shape); its sequences
    are the next ones of ``sample_ids`` (the batch's samples in the order the trainer packed them).
    ``routes(sample ids, lengths)``: the micro-batch's routes (``None``: routed natively);
    ``uids(each sequence's tokens)``: their names in a trace (e.g. ``AdapterSession.sample_uids``)."""
    out: list[MicroBatch] = []
    offset = 0
    for cu_seqlens, cu_seqlens_padded, input_ids in packed:
        cu = torch.as_tensor(cu_seqlens).tolist()
        count = len(cu) - 1
        ids = [int(i) for i in sample_ids[offset:offset + count]]
        offset += count
        lens = [end - start for start, end in zip(cu, cu[1:])]
        handed = None if routes is None else routes(ids, lens)
        flat = input_ids.reshape(-1)
        names = None if uids is None else uids(flat[cu[j]:cu[j + 1]] for j in range(count))
        out.append(thd_micro_batch(lens, cu_seqlens_padded, routes=handed, sample_ids=ids, uids=names))
    return out

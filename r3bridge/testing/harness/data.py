"""Packed-batch data helpers: the *reference* for which token each router row is.

Deliberately plain torch with no megatron imports except ``PackedSeqParams``: the replay
code is checked against these functions, so they must stay obviously right.

Conventions (which rows a router sees, in which order: docs/architecture.md, docs/driver-api.md):

* a micro-batch is one packed stream of sequences, b = 1, each sequence padded to a
  multiple of ``align_for(tp, cp)`` (``tp*cp*2`` if cp > 1 else ``tp``);
* CP (zigzag, per sequence): each padded sequence is cut into ``2*cp`` equal chunks; CP rank
  r keeps chunks ``r`` and ``2cp-1-r`` of *every* sequence, concatenated sequence by sequence;
* SP: TP rank t routes the contiguous rows ``[t*n/tp, (t+1)*n/tp)`` of its CP-local stream;
* router rows are s-major (``row = s*b + b_idx``), so with b = 1 row i is local token i.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


@dataclass
class PackedBatch:
    """One un-split packed micro-batch (what every rank gets before its CP split)."""

    seq_lens: list[int]  # true lengths
    padded_lens: list[int]  # lengths after alignment padding (last one maybe extended)
    input_ids: torch.Tensor  # [T] int64, T = sum(padded_lens); padding tokens are 0
    labels: torch.Tensor  # [T] int64, next token inside each sequence, 0 elsewhere
    loss_mask: torch.Tensor  # [T] float32, 1 where labels[i] is a real next token
    position_ids: torch.Tensor  # [T] int64, 0.. within each padded sequence
    cu_seqlens: torch.Tensor  # [n+1] int32, true lengths
    cu_seqlens_padded: torch.Tensor  # [n+1] int32, padded lengths

    @property
    def total(self) -> int:
        return int(self.cu_seqlens_padded[-1])


def align_for(tp: int, cp: int) -> int:
    """Per-sequence padding multiple used by verl/SkyRL packers (without FP8)."""
    return tp * cp * 2 if cp > 1 else tp


def make_packed_batch(
    seq_lens: Sequence[int],
    vocab: int,
    seed: int,
    *,
    align: int = 1,
    pad_to: Optional[int] = None,
) -> PackedBatch:
    """Random tokens (1..vocab-1; 0 is the pad id) for ``seq_lens``, packed and padded.

    ``pad_to`` extends the *last* sequence's padding so that the packed total equals
    ``pad_to`` (must keep the alignment). Needed with the allgather dispatcher under PP,
    where megatron 0.16.1 forbids variable sequence lengths across micro-batches.
    """
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError("seq_lens must be non-empty and positive")
    g = torch.Generator().manual_seed(seed)
    padded = [-(-n // align) * align for n in seq_lens]
    if pad_to is not None:
        extra = pad_to - sum(padded)
        if extra < 0 or extra % align:
            raise ValueError(f"pad_to={pad_to} < packed {sum(padded)} or breaks align={align}")
        padded[-1] += extra
    total = sum(padded)
    input_ids = torch.zeros(total, dtype=torch.int64)
    labels = torch.zeros(total, dtype=torch.int64)
    loss_mask = torch.zeros(total, dtype=torch.float32)
    position_ids = torch.zeros(total, dtype=torch.int64)
    off = 0
    for n, p in zip(seq_lens, padded):
        toks = torch.randint(1, vocab, (n,), generator=g)
        input_ids[off : off + n] = toks
        labels[off : off + n - 1] = toks[1:]
        loss_mask[off : off + n - 1] = 1.0
        position_ids[off : off + p] = torch.arange(p)
        off += p
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(seq_lens)), 0)
    cup = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cup[1:] = torch.cumsum(torch.tensor(padded), 0)
    return PackedBatch(list(seq_lens), padded, input_ids, labels, loss_mask, position_ids, cu, cup)


def cp_zigzag_index(padded_lens: Sequence[int], cp: int, cp_rank: int) -> torch.Tensor:
    """Packed-stream indices held by CP rank ``cp_rank``, in its local order."""
    if cp == 1:
        return torch.arange(sum(padded_lens))
    parts = []
    off = 0
    for p in padded_lens:
        if p % (2 * cp):
            raise ValueError(f"padded length {p} not divisible by 2*cp={2 * cp}")
        c = p // (2 * cp)
        for j in (cp_rank, 2 * cp - 1 - cp_rank):
            parts.append(torch.arange(off + j * c, off + (j + 1) * c))
        off += p
    return torch.cat(parts)


def router_row_index(
    batch: PackedBatch,
    *,
    tp: int,
    cp: int,
    tp_rank: int,
    cp_rank: int,
    sequence_parallel: bool,
) -> torch.Tensor:
    """For each router row on rank (tp_rank, cp_rank): its index in the packed stream."""
    idx = cp_zigzag_index(batch.padded_lens, cp, cp_rank)
    if sequence_parallel and tp > 1:
        n = idx.numel()
        if n % tp:
            raise ValueError(f"CP-local length {n} not divisible by tp={tp}")
        idx = idx[tp_rank * n // tp : (tp_rank + 1) * n // tp]
    return idx


def local_inputs(batch: PackedBatch, cp: int, cp_rank: int) -> dict[str, torch.Tensor]:
    """This CP rank's [1, n] input_ids / position_ids / labels / loss_mask."""
    idx = cp_zigzag_index(batch.padded_lens, cp, cp_rank)
    return {
        "input_ids": batch.input_ids[idx].unsqueeze(0),
        "position_ids": batch.position_ids[idx].unsqueeze(0),
        "labels": batch.labels[idx].unsqueeze(0),
        "loss_mask": batch.loss_mask[idx].unsqueeze(0),
    }


def packed_seq_params(batch: PackedBatch) -> Any:
    """THD ``PackedSeqParams`` over the *un-split* stream (megatron convention: cu_seqlens
    are global, each CP rank derives its share). True lengths in ``cu_seqlens_q``, padded
    ones in ``cu_seqlens_q_padded``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    max_len = int(max(batch.padded_lens))
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens,
        cu_seqlens_kv=batch.cu_seqlens,
        cu_seqlens_q_padded=batch.cu_seqlens_padded,
        cu_seqlens_kv_padded=batch.cu_seqlens_padded,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


def packed_causal_mask(batch: PackedBatch) -> torch.Tensor:
    """[1, 1, T, T] bool, True = masked (megatron convention), for local (BSHD) attention.

    Block-diagonal causal over the *padded* sequences, so feeding the packed stream as BSHD
    with b = 1 attends exactly like THD packing would: real tokens never see another
    sequence or padding, and results do not depend on the alignment padding.
    """
    lens = torch.tensor(batch.padded_lens)
    seq_id = torch.repeat_interleave(torch.arange(len(batch.padded_lens)), lens)
    t = int(lens.sum())
    allowed = (seq_id[:, None] == seq_id[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    return (~allowed).view(1, 1, t, t)


def real_token_positions(batch: PackedBatch) -> torch.Tensor:
    """[T] int64: for each packed position, ``seq_index * 2**20 + position`` if it holds a real
    token, -1 for padding. Layout-independent key for comparing rows across alignments."""
    key = torch.full((batch.total,), -1, dtype=torch.int64)
    for i, (n, off) in enumerate(zip(batch.seq_lens, batch.cu_seqlens_padded[:-1].tolist())):
        key[off : off + n] = i * 2**20 + torch.arange(n)
    return key


def batch_to(batch: PackedBatch, device: str) -> PackedBatch:
    """``batch`` with every tensor on ``device`` (the same object on the CPU)."""
    if device == "cpu":
        return batch
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device)
                                         for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})

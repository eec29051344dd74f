"""A :class:`~r3bridge.ReplayBatch` as one sequence-last field per batch: ``[B, L, K, S]``.

A framework that trims every per-sample field's *last* dimension to the sample's length (AReaL's
``split_and_unpad_tensor``) keeps routes exactly only when the sequence is the last axis. The
ids are in the narrowest dtype with an in-band "no route" sentinel
(:func:`r3bridge.batch.schema.sentinel_dtype`: 255 in ``uint8``, else -1) on every token the batch
does not route. Read back by :meth:`r3bridge.ingest.handed.HandedRoutes.from_sequence_last`
(:mod:`r3bridge.ingest.sequence_last`).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge.batch.dense import token_rows
from r3bridge.batch.schema import ReplayBatch, sentinel_dtype
from r3bridge.errors import CoverageError

__all__ = ["sequence_last_routes", "right_padded_lens", "right_padded_routes"]


def sequence_last_routes(batch: ReplayBatch, seq_lens: Sequence[int], width: Optional[int] = None) -> torch.Tensor:
    """``batch`` -> ``[n, L, K, width]`` (default width: the longest sequence), each sequence's
    ``seq_lens[i]`` tokens first, the sentinel where there is no route."""
    dtype, none = sentinel_dtype(batch.num_experts)
    lens = [int(x) for x in seq_lens]
    rows, _ = token_rows(batch, lens, fill=none, dtype=dtype)
    out = torch.full((batch.num_seqs, batch.num_layers, batch.topk, max(lens) if width is None else int(width)),
                     none, dtype=dtype, device=rows.device)
    tokens = torch.arange(out.shape[-1], device=rows.device)[None, :] < torch.tensor(lens, device=rows.device)[:, None]
    out.permute(0, 3, 1, 2)[tokens] = rows          # [n, S, L, K] view: each sequence's tokens in order
    return out


def right_padded_lens(attention_mask: Any, *, framework: str = "the framework's") -> list[int]:
    """Each row's token count of a right-padded ``[B, S]`` mask (``CoverageError`` otherwise: a
    sequence-last field holds each sample's tokens from column 0)."""
    attn = torch.as_tensor(attention_mask).bool().cpu()   # on the GPU in a GPU job: a host check
    lens = attn.sum(-1).long()
    pos = torch.arange(attn.shape[-1])[None, :]
    if not bool((attn == (pos < lens[:, None])).all()):
        raise CoverageError(f"{framework} batches are right-padded; this attention_mask is not")
    return lens.tolist()


def right_padded_routes(batch: ReplayBatch, attention_mask: torch.Tensor, *,
                        framework: str = "the framework's") -> torch.Tensor:
    """``batch`` (one sequence per row, batch order) -> ``[B, L, K, S]`` for a right-padded
    ``attention_mask``, on its device (an R2 write-back beside the batch's other fields)."""
    attn = torch.as_tensor(attention_mask)
    lens = right_padded_lens(attn, framework=framework)
    return sequence_last_routes(batch, lens, width=attn.shape[-1]).to(attn.device)

"""A :class:`~r3bridge.ReplayBatch` written back as a routes field over a padded ``[B, S]`` batch
plus that field's own "no route" mask (``[B, S]``, True: no route), the forms
:mod:`r3bridge.ingest.masked_fields` reads: *padded* ``[B, S, num_hidden_layers, K]`` and *packed*
(one row per real token, ``cu_seqlens``). Tokens without a route hold a filler row the framework
chooses (a real-looking top-K row is safe here: the mask says "no route"). SkyRL's R2 write-back
(0.3 padded, 0.4 packed) is cut from these.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from r3bridge.batch.dense import token_rows
from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.errors import RouteShapeError

__all__ = ["masked_padded_routes", "masked_packed_routes"]


def _token_mask(rb: ReplayBatch, attention_mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    attn = torch.as_tensor(attention_mask).bool().cpu()
    if rb.num_seqs != attn.shape[0]:
        raise RouteShapeError(f"{rb.num_seqs} sequences for a batch of {attn.shape[0]}")
    return attn, attn.sum(1).tolist()


def masked_padded_routes(rb: ReplayBatch, attention_mask: torch.Tensor, *, num_hidden_layers: int,
                         dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, S, num_hidden_layers, K]`` routes on the real tokens, dummy rows ``0..K-1``
    everywhere else; the ``[B, S]`` no-route mask)``."""
    attn, lens = _token_mask(rb, attention_mask)
    dtype = route_dtype(rb.num_experts) if dtype is None else dtype
    dummy = torch.arange(rb.topk, dtype=dtype)
    values, routed = token_rows(rb, lens, fill=dummy, dtype=dtype, num_hidden_layers=num_hidden_layers)
    out = dummy.expand(*attn.shape, num_hidden_layers, rb.topk).clone()
    out[attn] = values
    mask = torch.ones_like(attn)
    mask[attn] = ~routed
    return out, mask


def masked_packed_routes(rb: ReplayBatch, attention_mask: torch.Tensor, *, num_hidden_layers: int,
                         fill: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values [real tokens, num_hidden_layers, K], cu_seqlens int32 [B + 1], [B, S] no-route
    mask)``; ``fill(topk, dtype=)``: the row a token without a route holds."""
    attn, lens = _token_mask(rb, attention_mask)
    dtype = route_dtype(rb.num_experts)
    values, routed = token_rows(rb, lens, fill=torch.as_tensor(fill(rb.topk, dtype=dtype)), dtype=dtype,
                                num_hidden_layers=num_hidden_layers)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    mask = torch.ones_like(attn)
    mask[attn] = ~routed
    return values, cu, mask

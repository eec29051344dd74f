"""A :class:`~r3bridge.ReplayBatch` back in a framework's dense per-sample layout, with an explicit
"no route" value.

A ``ReplayBatch`` keeps rows no engine call routed (``valid = False``) as *filler* ids
``0..K-1``, so that every row has the same shape. Written into a framework field as they are,
those filler rows look like real routes (and ``0, 1`` is a real top-2 choice): a field where
zero means "no route" would even read them back as routed. These helpers write the ``no_route``
value into every row the batch does not route (invalid rows, rows before ``start_rows``, tokens
past the batch's rows), so the field says "no route" in-band and never by accident.

``no_route`` must be a value no expert id takes: the default :data:`NO_ROUTE` (-1) needs a
signed dtype; ``sentinel_dtype(num_experts)`` (:mod:`r3bridge.schema`) gives the narrowest dtype
with a sentinel (255 in ``uint8``). ``no_route=0`` is refused: expert 0 is a real route.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from r3bridge.errors import CoverageError, RouteValueError
from r3bridge.schema import ReplayBatch

__all__ = ["NO_ROUTE", "dense_routes", "padded_routes"]

NO_ROUTE = -1


def _check_no_route(batch: ReplayBatch, no_route: int, dtype: torch.dtype) -> None:
    if 0 <= no_route < batch.num_experts:
        raise RouteValueError(f"no_route={no_route} is a real expert id (num_experts={batch.num_experts}): "
                              f"use -1 or a value >= num_experts")
    info = torch.iinfo(dtype)
    if not info.min <= no_route <= info.max or batch.num_experts - 1 > info.max:
        raise RouteValueError(f"dtype {dtype} cannot hold both expert ids < {batch.num_experts} and "
                              f"no_route={no_route}")


def dense_routes(batch: ReplayBatch, seq_lens: Optional[Sequence[int]] = None, *, no_route: int = NO_ROUTE,
                 dtype: torch.dtype = torch.int32) -> list[torch.Tensor]:
    """Per sequence, its routes ``[seq_len, L, K]`` indexed by token, ``no_route`` where the
    batch has no route for a token.

    Args:
        batch: the routes (any ``source``); sequence ``i`` covers tokens
            ``[start_rows[i], start_rows[i] + rows_per_seq[i])``.
        seq_lens: tokens per sequence (rows past the batch's are "no route"); default: each
            sequence's last covered token + 1.
        no_route: the in-band "no route" value (never an expert id).
        dtype: of the returned tensors.

    Returns:
        One tensor per sequence, on the batch's device.

    Raises:
        RouteValueError: ``no_route`` is an expert id or does not fit ``dtype``.
        CoverageError: a sequence's rows run past its ``seq_lens`` entry.
    """
    _check_no_route(batch, no_route, dtype)
    ends = [s + n for s, n in zip(batch.start_rows, batch.rows_per_seq)]
    lens = ends if seq_lens is None else [int(n) for n in seq_lens]
    if len(lens) != batch.num_seqs:
        raise CoverageError(f"{len(lens)} seq_lens for {batch.num_seqs} sequences")
    out = []
    for i, (start, length) in enumerate(zip(batch.start_rows, lens)):
        routes, valid = batch.sequence(i)
        if ends[i] > length:
            raise CoverageError(f"sequence {i}: routes cover tokens up to {ends[i]}, past its {length} tokens")
        dense = torch.full((length, batch.num_layers, batch.topk), no_route, dtype=dtype, device=routes.device)
        rows = dense[start:start + routes.shape[0]]
        rows[valid] = routes[valid].to(dtype)
        out.append(dense)
    return out


def padded_routes(batch: ReplayBatch, token_mask: torch.Tensor, *, no_route: int = NO_ROUTE,
                  dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """The routes of a padded ``[B, S]`` batch: ``[B, S, L, K]``, sequence ``i``'s token ``t``
    at the ``t``-th True column of ``token_mask[i]`` (left, right or inner padding alike),
    ``no_route`` everywhere else.

    Raises:
        CoverageError: ``batch`` does not hold one sequence per row of ``token_mask``, or a
            sequence's routes run past its tokens.
    """
    mask = torch.as_tensor(token_mask).bool()
    if mask.dim() != 2 or mask.shape[0] != batch.num_seqs:
        raise CoverageError(f"token_mask {tuple(mask.shape)} for {batch.num_seqs} sequences: need [B, S] "
                            f"with one row per sequence")
    lens = mask.sum(-1).tolist()
    per = dense_routes(batch, lens, no_route=no_route, dtype=dtype)
    out = torch.full((mask.shape[0], mask.shape[1], batch.num_layers, batch.topk), no_route, dtype=dtype,
                     device=batch.routes.device)
    for i, routes in enumerate(per):
        cols = mask[i].nonzero().flatten().to(out.device)
        out[i, cols] = routes
    return out

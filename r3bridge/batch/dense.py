"""A :class:`~r3bridge.ReplayBatch` back in a framework's dense per-sample layout, with an explicit
"no route" value.

A ``ReplayBatch`` keeps rows no engine call routed (``valid = False``) as *filler* ids
``0..K-1``, so that every row has the same shape. Written into a framework field as they are,
those filler rows look like real routes (and ``0, 1`` is a real top-2 choice): a field where
zero means "no route" would even read them back as routed. These helpers write the ``no_route``
value into every row the batch does not route (invalid rows, rows before ``start_rows``, tokens
past the batch's rows), so the field says "no route" in-band and never by accident.

``no_route`` must be a value no expert id takes: the default :data:`NO_ROUTE` (-1) needs a
signed dtype; ``sentinel_dtype(num_experts)`` (:mod:`r3bridge.batch.schema`) gives the narrowest dtype
with a sentinel (255 in ``uint8``). ``no_route=0`` is refused: expert 0 is a real route.

:func:`token_rows` is the one scatter every write-back is cut from: the adapters' R2 write-backs
(padded and packed fields, a sequence-last tensor) and the two helpers here.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from r3bridge.batch.meta import check_coverage
from r3bridge.batch.schema import ReplayBatch
from r3bridge.errors import CoverageError, LayerMappingError, RouteValueError

__all__ = ["NO_ROUTE", "token_rows", "dense_routes", "padded_routes"]

NO_ROUTE = -1


def _check_no_route(batch: ReplayBatch, no_route: int, dtype: torch.dtype) -> None:
    if 0 <= no_route < batch.num_experts:
        raise RouteValueError(f"no_route={no_route} is a real expert id (num_experts={batch.num_experts}): "
                              f"use -1 or a value >= num_experts")
    info = torch.iinfo(dtype)
    if not info.min <= no_route <= info.max or batch.num_experts - 1 > info.max:
        raise RouteValueError(f"dtype {dtype} cannot hold both expert ids < {batch.num_experts} and "
                              f"no_route={no_route}")


def token_rows(batch: ReplayBatch, seq_lens: Optional[Sequence[int]] = None, *,
               fill: int | Sequence[int] | torch.Tensor = NO_ROUTE, dtype: torch.dtype = torch.int32,
               num_hidden_layers: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of every sequence, packed in sequence order: the one write-back every
    framework layout is cut from (padded ``[B, S, ...]``, packed, sequence-last).

    Args:
        batch: the routes; sequence ``i`` covers tokens ``[start_rows[i], start_rows[i] +
            rows_per_seq[i])``.
        seq_lens: tokens per sequence (default: each sequence's last covered token + 1).
        fill: what a token without a route holds: a scalar no expert id takes (checked like
            ``no_route``), or a whole row of ``K`` ids (e.g. ``0..K-1``) for a transport that
            says "no route" in a mask of its own (the returned flags are that mask).
        dtype: of the returned rows.
        num_hidden_layers: the layer axis is every decoder layer, the batch's at their ids and
            every other layer ``fill`` (engines' layout); ``None``: the batch's layers only.

    Returns:
        ``(rows [sum(seq_lens), L, K], routed bool [sum(seq_lens)])`` on the batch's device.

    Raises:
        RouteValueError: a scalar ``fill`` is an expert id or does not fit ``dtype``.
        CoverageError: a sequence's rows run past its ``seq_lens`` entry, or (with ``seq_lens``)
            end before its last token but one (rows = prompt + generated - 1 from the start
            row; only a sequence with 0 rows may end anywhere).
        LayerMappingError: a layer id past ``num_hidden_layers``.
    """
    ends = [s + n for s, n in zip(batch.start_rows, batch.rows_per_seq)]
    lens = ends if seq_lens is None else [int(n) for n in seq_lens]
    if len(lens) != batch.num_seqs:
        raise CoverageError(f"{len(lens)} seq_lens for {batch.num_seqs} sequences")
    over = next((i for i, (end, n) in enumerate(zip(ends, lens)) if end > n), None)
    if over is not None:
        raise CoverageError(f"sequence {over}: routes cover tokens up to {ends[over]}, past its {lens[over]} tokens")
    if seq_lens is not None:        # the row-count rule: a short sequence is refused, never written as a tail
        check_coverage(batch.start_rows, batch.rows_per_seq, lens)
    fill_value = torch.as_tensor(fill)
    if fill_value.dim() == 0:
        _check_no_route(batch, int(fill_value), dtype)
    elif tuple(fill_value.shape) != (batch.topk,):
        raise RouteValueError(f"fill must be a scalar or one row of top-k={batch.topk} ids, got {tuple(fill_value.shape)}")
    layers = batch.num_layers if num_hidden_layers is None else int(num_hidden_layers)
    if num_hidden_layers is not None and max(batch.layer_ids, default=-1) >= layers:
        raise LayerMappingError(f"layer ids {list(batch.layer_ids)} out of range for {layers} layers")
    device = batch.routes.device
    total = int(sum(lens))
    rows = fill_value.to(device=device, dtype=dtype).expand(total, layers, batch.topk).clone()
    # token of every packed row: the sequence's first token + its start row + the row's index in it
    per_seq = torch.tensor(batch.rows_per_seq, dtype=torch.long, device=device)
    first_token = torch.tensor([0, *lens[:-1]], dtype=torch.long, device=device).cumsum(0)
    first_token += torch.tensor(batch.start_rows, dtype=torch.long, device=device)
    seq = torch.arange(batch.num_seqs, device=device).repeat_interleave(per_seq)
    token = first_token[seq] + torch.arange(batch.total_rows, device=device) - batch.offsets[:-1].to(device)[seq]
    token = token[batch.valid.to(device)]
    routes = batch.routes[batch.valid.to(device)].to(dtype)
    if num_hidden_layers is None:
        rows[token] = routes
    else:
        rows[token[:, None], torch.tensor(batch.layer_ids, dtype=torch.long, device=device)[None, :]] = routes
    routed = torch.zeros(total, dtype=torch.bool, device=device)
    routed[token] = True
    return rows, routed


def dense_routes(batch: ReplayBatch, seq_lens: Optional[Sequence[int]] = None, *, no_route: int = NO_ROUTE,
                 dtype: torch.dtype = torch.int32) -> list[torch.Tensor]:
    """Per sequence, its routes ``[seq_len, L, K]`` indexed by token, ``no_route`` where the
    batch has no route for a token (:func:`token_rows`, cut per sequence).

    Args:
        batch: the routes (any route kind); sequence ``i`` covers tokens
            ``[start_rows[i], start_rows[i] + rows_per_seq[i])``.
        seq_lens: tokens per sequence (rows past the batch's are "no route"); default: each
            sequence's last covered token + 1.
        no_route: the in-band "no route" value (never an expert id).
        dtype: of the returned tensors.

    Returns:
        One tensor per sequence, on the batch's device.

    Raises:
        RouteValueError: ``no_route`` is an expert id or does not fit ``dtype``.
        CoverageError: a sequence's rows run past its ``seq_lens`` entry, or (with ``seq_lens``)
            end before its last token but one (rows = prompt + generated - 1 from the start
            row; only a sequence with 0 rows may end anywhere).
    """
    rows, _ = token_rows(batch, seq_lens, fill=no_route, dtype=dtype)
    lens = [s + n for s, n in zip(batch.start_rows, batch.rows_per_seq)] if seq_lens is None else seq_lens
    return list(rows.split([int(n) for n in lens]))


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
    rows, _ = token_rows(batch, mask.sum(-1).tolist(), fill=no_route, dtype=dtype)
    out = torch.full((mask.shape[0], mask.shape[1], batch.num_layers, batch.topk), no_route, dtype=dtype,
                     device=rows.device)
    out[mask.to(rows.device)] = rows        # row-major True positions: each sequence's tokens in order
    return out

"""Vectorised validation of packed routes; errors name sequence, row, token and layer."""
from __future__ import annotations

from typing import Sequence

import torch

from r3bridge.errors import RouteValueError


def locate(offsets: torch.Tensor, starts: Sequence[int], flat_row: int) -> tuple[int, int, int]:
    """Packed row index -> (sequence, row within sequence, token position)."""
    seq = int(torch.searchsorted(offsets, torch.tensor([flat_row]), right=True)[0]) - 1
    row = flat_row - int(offsets[seq])
    return seq, row, starts[seq] + row


def check_routes(routes: torch.Tensor, valid: torch.Tensor, num_experts: int,
                 layer_ids: Sequence[int], offsets: torch.Tensor, starts: Sequence[int]) -> None:
    """Ids in ``[0, num_experts)`` and distinct within each row, on valid rows only.

    Invalid rows may hold anything (engines send zero rows); they are overwritten with fillers.
    """
    if routes.numel() == 0:
        return
    lo, hi = int(routes.min()), int(routes.max())
    if lo < 0 or hi >= num_experts:
        bad = ((routes < 0) | (routes >= num_experts)).any(-1) & valid[:, None]
        hits = bad.nonzero()
        if hits.numel():
            r, l = int(hits[0, 0]), int(hits[0, 1])
            seq, row, tok = locate(offsets, starts, r)
            raise RouteValueError(
                f"sequence {seq}, row {row} (token {tok}), layer {layer_ids[l]}: expert ids "
                f"{routes[r, l].tolist()} out of range [0, {num_experts}) "
                f"({int(bad.sum())} bad (row, layer) pairs in total)")
    if routes.shape[2] > 1:
        s = routes.sort(dim=-1).values
        dup = (s[..., 1:] == s[..., :-1]).any(-1) & valid[:, None]
        hits = dup.nonzero()
        if hits.numel():
            r, l = int(hits[0, 0]), int(hits[0, 1])
            seq, row, tok = locate(offsets, starts, r)
            raise RouteValueError(
                f"sequence {seq}, row {row} (token {tok}), layer {layer_ids[l]}: duplicate expert ids "
                f"{routes[r, l].tolist()} (a zero/padding row? mark rows without a route invalid "
                f"instead; {int(dup.sum())} bad (row, layer) pairs in total)")

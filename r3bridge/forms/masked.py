"""The masked form: a routes field laid over a padded ``[B, S]`` batch with its own "no route"
mask, read (viewed for the one reader, :class:`r3bridge.parallel.handed.HandedRoutes`) and written
(a :class:`~r3bridge.ReplayBatch` back in the same form, e.g. an R2 write-back).

Two transports share the batch's ``attention_mask`` (one sample per row, any padding): *packed*,
``(values [real tokens, L, K], cu_seqlens)`` with one row per real token in row order, and
*padded*, ``[B, S, L, K]``. Either comes with a ``[B, S]`` mask, True where a token has no route;
without one, a padded field writes "no route" as zero rows (``no_route="zero"``), except recorded
top-1 routes, whose expert-0 rows are routes. A framework with such fields calls
:func:`masked_field_routes` with its own key names. Written back, tokens without a route hold a
filler row the framework chooses (a real-looking top-K row is safe here: the mask says "no route").
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from r3bridge.batch.dense import token_rows
from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.engines.layer_axis import axis_columns
from r3bridge.errors import RouteShapeError
from r3bridge.hf import check_topk
from r3bridge.parallel.handed import HandedRoutes, naming_samples, shown_names, zero_row_rule

__all__ = ["batch_field", "row_names", "masked_field_routes", "masked_padded_routes", "masked_packed_routes"]


def batch_field(batch: Any, key: str) -> Any:
    """``batch[key]`` of a mapping or a framework's batch object; ``None`` where it has none."""
    if isinstance(batch, Mapping):
        return batch.get(key)
    try:
        return batch[key]
    except KeyError:
        return None


def row_names(num_rows: int, sample_ids: Optional[Sequence[int]] = None) -> list[str]:
    """Samples named by their batch row, or row ``i`` by ``sample_ids[i]`` (a micro-batch's rows)."""
    return [f"batch row {int(i)}" for i in (range(num_rows) if sample_ids is None else sample_ids)]


def masked_field_routes(routes: Any, attention_mask: Any, no_route_mask: Any = None, *, field: str, mask_field: str,
                        num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: Optional[int] = None,
                        topk: Optional[int] = None, route_kind: str = "rollout", names: Optional[Sequence[str]] = None,
                        framework: Optional[str] = None) -> HandedRoutes:
    """``routes`` (a padded ``[B, S, L, K]`` tensor, or a packed ``(values, cu_seqlens)`` pair) over
    ``attention_mask`` ``[B, S]``, ``no_route_mask`` ``[B, S]`` (True: no route; required for a packed
    field), viewed, nothing copied. ``field`` / ``mask_field`` name the two in errors; the layer axis
    is every decoder layer with ``num_hidden_layers``, else the MoE layers'."""
    moe = [int(i) for i in moe_layer_ids]
    common = dict(num_experts=num_experts, layer_ids=moe, route_kind=route_kind, names=names, framework=framework)
    if isinstance(routes, tuple):
        values, cu = torch.as_tensor(routes[0]), torch.as_tensor(routes[1]).long()
        check_topk(field, int(values.shape[-1]), topk)
        if values.dim() != 3:
            raise RouteShapeError(f"{field} values must be [tokens, layers, topk], got {tuple(values.shape)}")
        # [B, S] masks: host arrays (small torch ops on CPU stall on the thread pool's barriers)
        attn_b = torch.as_tensor(attention_mask).bool().cpu().numpy()
        mask_b = torch.as_tensor(no_route_mask).bool().cpu().numpy()
        if mask_b.shape != attn_b.shape:
            raise RouteShapeError(f"{mask_field} is {tuple(mask_b.shape)}, attention_mask {tuple(attn_b.shape)}")
        lens = attn_b.sum(1).tolist()
        seg = (cu[1:] - cu[:-1]).tolist()
        if seg != lens:
            raise RouteShapeError(f"{field} segments {seg} do not match the real-token counts {lens} "
                                  f"({framework or 'the framework'} packs one route row per real token)")
        cols = axis_columns(int(values.shape[1]), layer_axis=None, moe_layer_ids=moe,
                            num_hidden_layers=num_hidden_layers, field=field)
        valid = torch.from_numpy(~mask_b[attn_b])       # real tokens in row order == packed row order
        return HandedRoutes.from_packed(values, lens, columns=cols, no_route="mask", valid=valid.to(values.device),
                                        **common)
    routes = torch.as_tensor(routes)
    if routes.dim() != 4:
        raise RouteShapeError(f"{field} must be [batch, seq, layers, topk], got {tuple(routes.shape)}")
    check_topk(field, int(routes.shape[-1]), topk)
    cols = axis_columns(int(routes.shape[2]), layer_axis=None, moe_layer_ids=moe, num_hidden_layers=num_hidden_layers,
                        field=field)
    attn_b = torch.as_tensor(attention_mask).bool()
    if no_route_mask is not None:
        valid = attn_b & ~torch.as_tensor(no_route_mask).bool().to(attn_b.device)
        return HandedRoutes.from_padded(routes, attn_b, columns=cols, no_route="mask", valid=valid, **common)
    # no mask: zero rows say "no route" (recorded top-1 routes excepted: zero_row_rule)
    return HandedRoutes.from_padded(routes, attn_b, columns=cols, no_route=zero_row_rule(route_kind, routes.shape[-1]),
                                    **common)



def _token_mask(rb: ReplayBatch, attention_mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    attn = torch.as_tensor(attention_mask).bool().cpu()
    if rb.num_seqs != attn.shape[0]:
        raise RouteShapeError(f"{rb.num_seqs} sequences for a batch of {attn.shape[0]}")
    return attn, attn.sum(1).tolist()


def masked_padded_routes(rb: ReplayBatch, attention_mask: torch.Tensor, *, num_hidden_layers: int,
                         dtype: Optional[torch.dtype] = None, names: Optional[Sequence[str]] = None,
                         framework: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, S, num_hidden_layers, K]`` routes on the real tokens, dummy rows ``0..K-1``
    everywhere else; the ``[B, S]`` no-route mask)``. Errors name ``names[i]`` (the framework's
    sample), else "sequence i"."""
    attn, lens = _token_mask(rb, attention_mask)
    dtype = route_dtype(rb.num_experts) if dtype is None else dtype
    dummy = torch.arange(rb.topk, dtype=dtype)
    with naming_samples(shown_names(names, framework)):
        values, routed = token_rows(rb, lens, fill=dummy, dtype=dtype, num_hidden_layers=num_hidden_layers)
    out = dummy.expand(*attn.shape, num_hidden_layers, rb.topk).clone()
    out[attn] = values
    mask = torch.ones_like(attn)
    mask[attn] = ~routed
    return out, mask


def masked_packed_routes(rb: ReplayBatch, attention_mask: torch.Tensor, *, num_hidden_layers: int,
                         fill: Any, names: Optional[Sequence[str]] = None,
                         framework: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values [real tokens, num_hidden_layers, K], cu_seqlens int32 [B + 1], [B, S] no-route
    mask)``; ``fill(topk, dtype=)``: the row a token without a route holds. Errors name
    ``names[i]`` (the framework's sample), else "sequence i"."""
    attn, lens = _token_mask(rb, attention_mask)
    dtype = route_dtype(rb.num_experts)
    with naming_samples(shown_names(names, framework)):
        values, routed = token_rows(rb, lens, fill=torch.as_tensor(fill(rb.topk, dtype=dtype)), dtype=dtype,
                                    num_hidden_layers=num_hidden_layers)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    mask = torch.ones_like(attn)
    mask[attn] = ~routed
    return values, cu, mask

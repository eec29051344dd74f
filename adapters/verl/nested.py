"""Routes handed over as a torch nested jagged tensor ``[batch, (rows_i), layers, topk]`` (one row
per token of each sample: e.g. verl's no-padding transport), read as :class:`HandedRoutes`, and written
back in that layout (R2's recorded routes, per-token fields for a loss).

A transport without a validity field writes "no route" as a zero row (docs/porting.md, "No route"):
:func:`~r3bridge.parallel.handed.zero_row_rule`. Layer axes: recorded routes (R2) hold the model's
MoE layers, rollout routes the engine's axis (:func:`layer_columns`). Field names are the caller's,
for the errors.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.layer_axis import axis_columns
from r3bridge.errors import LayerMappingError, RouteShapeError
from r3bridge.hf import check_topk
from r3bridge.parallel.handed import HandedRoutes, zero_row_rule

__all__ = ["jagged_parts", "layer_columns", "zero_row_rule", "handed_from_nested", "handed_from_batch",
           "nested_routes", "nested_like"]


def jagged_parts(x: Any, field: str) -> tuple[torch.Tensor, list[int]]:
    """(packed values ``[total, L, K]``, rows per sample) of a nested jagged tensor, viewed."""
    if not getattr(x, "is_nested", False):
        raise RouteShapeError(f"{field} must be a nested jagged tensor [batch, (tokens), layers, topk] (the "
                              f"no-padding layout: one row per token), got a dense {tuple(x.shape)} tensor")
    values = x.values()
    if values.dim() != 3:
        raise RouteShapeError(f"{field} must be [batch, (tokens), layers, topk], got values of "
                              f"shape {tuple(values.shape)}")
    return values, x.offsets().diff().tolist()


def layer_columns(num_layers: int, *, route_kind: str, moe_layer_ids: Sequence[int], field: str,
                  num_hidden_layers: Optional[int] = None, layer_axis: Optional[str] = None) -> Optional[list[int]]:
    """Which source column holds each MoE layer: recorded routes (R2) hold the MoE layers in order
    (``None``); rollout routes the engine's layer axis (every decoder layer, or the MoE ones only)."""
    moe = [int(i) for i in moe_layer_ids]
    if route_kind == "recorded":
        if num_layers != len(moe):
            raise LayerMappingError(f"recorded {field} have {num_layers} layers, the model has {len(moe)} MoE "
                                    f"layers {moe}")
        return None
    if num_hidden_layers is None and layer_axis != "moe_only":
        raise LayerMappingError("rollout routes need num_hidden_layers (their layer axis is every "
                                "decoder layer)")
    return axis_columns(num_layers, layer_axis=layer_axis, moe_layer_ids=moe, num_hidden_layers=num_hidden_layers,
                        field=f"rollout {field}")


def handed_from_nested(routes: Any, *, num_experts: int, moe_layer_ids: Sequence[int], route_kind: str,
                       field: str, names: Sequence[str], framework: str, weights: Any = None,
                       weights_field: str = "weights", num_hidden_layers: Optional[int] = None,
                       topk: Optional[int] = None, layer_axis: Optional[str] = None) -> HandedRoutes:
    """A nested ``[batch, (rows), L, K]`` routes field (and optional weights of its layout) as the one
    reader reads it: values viewed, nothing copied or checked yet. ``topk``: the model's; routes of
    another width are refused here, naming both. ``names``: the framework's name of each sample
    (a count that does not match falls back to micro-batch positions)."""
    values, rows = jagged_parts(routes, field)
    check_topk(field, int(values.shape[-1]), topk)
    if len(names) != len(rows):
        names = [f"micro-batch position {i}" for i in range(len(rows))]
    cols = layer_columns(int(values.shape[1]), route_kind=route_kind, moe_layer_ids=moe_layer_ids, field=field,
                         num_hidden_layers=num_hidden_layers, layer_axis=layer_axis)
    w_values = None
    if weights is not None and route_kind != "recorded":
        w_values, w_rows = jagged_parts(weights, weights_field)
        if w_rows != rows or tuple(w_values.shape[1:]) != tuple(values.shape[1:]):
            raise RouteShapeError(f"{weights_field} {tuple(w_values.shape)} rows {w_rows} do not match {field} "
                                  f"{tuple(values.shape)} rows {rows}")
    return HandedRoutes.from_packed(values, rows, num_experts=num_experts, layer_ids=[int(i) for i in moe_layer_ids],
                                    columns=cols, no_route=zero_row_rule(route_kind, values.shape[-1]),
                                    route_kind=route_kind, names=names, framework=framework, weights=w_values)


def handed_from_batch(batch: Any, *, field: str, weights_field: str, names: Callable[[Any], Sequence[str]],
                      **read: Any) -> HandedRoutes:
    """:func:`handed_from_nested` (``read``: its other arguments) of a batch's ``field``, with its
    ``weights_field`` when the batch has one and ``names(batch)``; or of the field itself when
    ``batch`` is no mapping (samples named by position). A batch without ``field`` is refused."""
    if not hasattr(batch, "get"):
        return handed_from_nested(batch, field=field, names=[], weights_field=weights_field, **read)
    routes = batch.get(field, None)
    if routes is None:
        raise RouteShapeError(f"the batch has no {field!r} field")
    return handed_from_nested(routes, field=field, names=names(batch), weights=batch.get(weights_field, None),
                              weights_field=weights_field, **read)


def nested_routes(rb: ReplayBatch, dtype: torch.dtype = torch.int16) -> torch.Tensor:
    """ReplayBatch (every row of each sample, start 0) -> nested jagged ``[batch, (rows_i), L, K]``,
    rows without a route written as zeros (the zero-row transport's "no route")."""
    if any(s != 0 for s in rb.start_rows):
        raise RouteShapeError("nested_routes needs routes starting at token 0 of every sample")
    values = rb.routes.to(dtype)
    if not bool(rb.valid.all()):
        values = values.clone()
        values[~rb.valid.to(values.device)] = 0
    return torch.nested.nested_tensor_from_jagged(values, offsets=rb.offsets.to(values.device))


def nested_like(per_seq: Optional[Sequence[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """Per-sequence per-token values nested like ``like`` (jagged, on its device); ``None``: zeros
    (e.g. a chunk that replayed nothing with weights hands the loss a zero router log-ratio)."""
    if per_seq is None:
        per_seq = [torch.zeros(int(n), dtype=torch.float32) for n in like.offsets().diff().tolist()]
    device = like.values().device
    return torch.nested.as_nested_tensor([t.to(device) for t in per_seq], layout=torch.jagged)

"""verl's ``routed_experts`` TensorDict field <-> :class:`r3bridge.ReplayBatch`.

verl's transport (after ``left_right_2_no_padding``) is a nested jagged ``[batch, (tokens_i), L, K]``
int16 tensor, one row per unmasked token: rollout routes (R3) with every decoder layer
(``L = num_hidden_layers``, dense ones zero), recorded routes (R2, verl's own R2 layout) with the
MoE layers only. "No route" is a zero row (the reader's ``no_route="zero"``); optional routing
weights (:data:`WEIGHTS_KEY`) share the routes' layout. docs/use-with-verl.md, "How it hooks into verl".
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge.batch.provenance import (
    LOGPROB_PROVENANCE_KEY,
    ROUTE_PROVENANCE_KEY,
    ProvenancePairing,
    pairing_from_fields,
)
from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.layer_axis import axis_columns
from r3bridge.errors import LayerMappingError, RouteShapeError
from r3bridge.hf import check_topk
from r3bridge.ingest.codec_base import HandedCodec
from r3bridge.ingest.handed import HandedRoutes

__all__ = ["ROUTES_KEY", "WEIGHTS_KEY", "LOG_RATIO_KEY", "SAMPLE_KEY", "ROUTE_PROVENANCE_KEY", "LOGPROB_PROVENANCE_KEY",
           "handed_routes", "routes_to_nested", "sample_names", "provenance_pairing", "VerlCodec"]

ROUTES_KEY = "routed_experts"
WEIGHTS_KEY = "routed_experts_weights"   # optional rollout routing weights, ROUTES_KEY's layout
LOG_RATIO_KEY = "router_log_ratio"       # per-token router log-ratio the adapter hands the loss
SAMPLE_KEY = "r3bridge_sample_index"     # per-sample int64 the engine adds: R2 records by it, errors name it
# ROUTE_PROVENANCE_KEY / LOGPROB_PROVENANCE_KEY: per-sample RouteProvenance (or None) the agent loop
# writes into extra_fields, which verl carries as non-tensor fields


def _jagged(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(packed values ``[total, L, K]``, rows per sample) of a nested jagged tensor."""
    if not getattr(x, "is_nested", False):
        raise RouteShapeError(f"{ROUTES_KEY} must be a nested jagged tensor [batch, (tokens), layers, "
                              f"topk] (verl's no-padding layout), got a dense {tuple(x.shape)} tensor")
    offsets = x.offsets()
    values = x.values()
    if values.dim() != 3:
        raise RouteShapeError(f"{ROUTES_KEY} must be [batch, (tokens), layers, topk], got values of "
                              f"shape {tuple(values.shape)}")
    return values, offsets.diff().tolist()


def sample_names(td: Any) -> list[str]:
    """How verl knows each sample: its index in the engine's batch (:data:`SAMPLE_KEY`) and
    verl's ``uid`` (the prompt group) where the batch has them, else its micro-batch position."""
    n = len(td) if hasattr(td, "__len__") else 0
    idx = td.get(SAMPLE_KEY, None) if hasattr(td, "get") else None
    names = [f"batch index {int(i)}" for i in idx.tolist()] if idx is not None else \
        [f"micro-batch position {i}" for i in range(n)]
    uid = td.get("uid", None) if hasattr(td, "get") else None
    try:
        uids = list(uid) if uid is not None and not isinstance(uid, torch.Tensor) else None
    except TypeError:
        uids = None
    if uids is not None and len(uids) == len(names):
        names = [f"{n} (uid {u})" for n, u in zip(names, uids)]
    return names


def _field(td: Any, key: str) -> Any:
    """``key`` of each sample: a batch field (verl's DataProto path flattens ``extra_fields``) or
    in each sample's ``extra_fields`` dict (verl 0.9.1's V1 trainer: ``agent_loop_tq.py:193``)."""
    value = td.get(key, None) if hasattr(td, "get") else None
    if value is not None:
        return value
    nested = td.get("extra_fields", None) if hasattr(td, "get") else None
    rows = None if nested is None else nested.tolist() if hasattr(nested, "tolist") else list(nested)
    if not rows or not all(isinstance(r, dict) for r in rows) or not any(key in r for r in rows):
        return None
    return [r.get(key) for r in rows]


def provenance_pairing(td: Any) -> ProvenancePairing:
    """The batch's route and log-prob provenance (a missing field: unknown, counted unchecked)."""
    return pairing_from_fields(lambda key: _field(td, key), samples=len(td), names=sample_names(td),
                               engine="verl", framework="verl")


def handed_routes(td, *, moe_layer_ids: Sequence[int], num_experts: int, route_kind: str,
                  num_hidden_layers: int | None = None, topk: int | None = None,
                  layer_axis: str | None = None) -> HandedRoutes:
    """``td[ROUTES_KEY]`` of a (micro-)batch as the one reader reads it: verl's nested values
    viewed, nothing copied or checked yet. Recorded routes (R2) hold the MoE layers; rollout routes
    the engine's layer axis (``layer_axis``: every decoder layer, or the MoE ones only, TensorRT-LLM).
    ``topk``: the model's; routes of another width are refused here, naming both."""
    routes = td.get(ROUTES_KEY, None) if hasattr(td, "get") else td
    if routes is None:
        raise RouteShapeError(f"the batch has no {ROUTES_KEY!r} field")
    values, rows = _jagged(routes)
    check_topk(ROUTES_KEY, int(values.shape[-1]), topk)
    names = sample_names(td) if hasattr(td, "get") else []
    if len(names) != len(rows):
        names = [f"micro-batch position {i}" for i in range(len(rows))]
    moe = [int(i) for i in moe_layer_ids]
    nl = int(values.shape[1])
    if route_kind == "recorded":
        if nl != len(moe):
            raise LayerMappingError(f"recorded {ROUTES_KEY} have {nl} layers, the model has {len(moe)} MoE "
                                    f"layers {moe}")
        cols = None
    else:
        if num_hidden_layers is None and layer_axis != "moe_only":
            raise LayerMappingError("rollout routes need num_hidden_layers (their layer axis is every "
                                    "decoder layer)")
        cols = axis_columns(nl, layer_axis=layer_axis, moe_layer_ids=moe, num_hidden_layers=num_hidden_layers,
                            field=f"rollout {ROUTES_KEY}")
    weights = None
    raw_weights = td.get(WEIGHTS_KEY, None) if hasattr(td, "get") and route_kind != "recorded" else None
    if raw_weights is not None:
        w_values, w_rows = _jagged(raw_weights)
        if w_rows != rows or tuple(w_values.shape[1:]) != tuple(values.shape[1:]):
            raise RouteShapeError(f"{WEIGHTS_KEY} {tuple(w_values.shape)} rows {w_rows} do not match {ROUTES_KEY} "
                                  f"{tuple(values.shape)} rows {rows}")
        weights = w_values
    # recorded routes hold a real route on every token: at top-1 an expert-0 row is a route
    no_route = "none" if route_kind == "recorded" and int(values.shape[-1]) == 1 else "zero"
    return HandedRoutes.from_packed(values, rows, num_experts=num_experts, layer_ids=moe, columns=cols,
                                    no_route=no_route, route_kind=route_kind, names=names, framework="verl", weights=weights)


def routes_to_nested(rb: ReplayBatch, dtype: torch.dtype = torch.int16) -> torch.Tensor:
    """ReplayBatch (every row of each sample, start 0) -> verl's nested jagged ``[batch, (rows_i),
    L, K]``, rows without a route written as zeros (verl's "no route")."""
    if any(s != 0 for s in rb.start_rows):
        raise RouteShapeError("routes_to_nested needs routes starting at token 0 of every sample")
    values = rb.routes.to(dtype)
    if not bool(rb.valid.all()):
        values = values.clone()
        values[~rb.valid.to(values.device)] = 0
    offsets = rb.offsets.to(values.device)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


class VerlCodec(HandedCodec):
    """The :class:`r3bridge.protocols.BatchCodec` of verl's no-padding ``TensorDict`` batch."""

    def handed_routes(self, native: Any, *, route_kind: str = "rollout") -> HandedRoutes:
        return handed_routes(native, moe_layer_ids=self.moe_layer_ids, num_experts=self.num_experts, route_kind=route_kind,
                             num_hidden_layers=self.num_hidden_layers, topk=self.topk)

    def write_recorded(self, native: Any, recorded: ReplayBatch) -> Any:
        native[ROUTES_KEY] = routes_to_nested(recorded)
        return native

    def seq_lens(self, native: Any) -> list[int]:
        return native["input_ids"].offsets().diff().tolist()

    def split(self, native: Any, num_parts: int, order: Optional[list[int]] = None) -> list[tuple[Any, list[int]]]:
        """verl's own dynamic micro-batching (``prepare_micro_batches``: token-balanced, reorders)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.engine.utils import prepare_micro_batches

        idx = list(range(len(native))) if order is None else [int(i) for i in order]
        td = tu.index_select_tensor_dict(native, torch.tensor(idx))
        td[SAMPLE_KEY] = torch.tensor(idx, dtype=torch.int64)
        lens = self.seq_lens(td)
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=max(max(lens), -(-sum(lens) // num_parts)))
        micro, _ = prepare_micro_batches(td, dp_group=None, same_micro_num_in_dp=False, min_num_micro_batch=num_parts)
        return [(mb, mb[SAMPLE_KEY].tolist()) for mb in micro]

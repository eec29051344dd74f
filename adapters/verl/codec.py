"""verl's ``routed_experts`` TensorDict field <-> :class:`r3bridge.ReplayBatch`.

verl's transport (after ``left_right_2_no_padding``) is a nested jagged ``[batch, (tokens_i), L, K]``
int16 tensor, one row per unmasked token (:mod:`r3bridge.adapters.verl.nested`): rollout routes (R3) with
every decoder layer, recorded routes (R2) with the MoE layers only; "no route" is a zero row.
docs/use-with-verl.md, "How it hooks into verl".
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from r3bridge.adapters.verl.nested import handed_from_batch, nested_routes
from r3bridge.adapters.verl.sample_fields import indexed_names, sample_field
from r3bridge.batch.provenance import ProvenancePairing, pairing_from_fields
from r3bridge.batch.schema import ReplayBatch
from r3bridge.forms.codec import HandedCodec
from r3bridge.parallel.handed import HandedRoutes

__all__ = ["ROUTES_KEY", "WEIGHTS_KEY", "LOG_RATIO_KEY", "SAMPLE_KEY", "handed_routes", "sample_names",
           "provenance_pairing", "VerlCodec"]

ROUTES_KEY = "routed_experts"
WEIGHTS_KEY = "routed_experts_weights"   # optional rollout routing weights, ROUTES_KEY's layout
LOG_RATIO_KEY = "router_log_ratio"       # per-token router log-ratio the adapter hands the loss
SAMPLE_KEY = "r3bridge_sample_index"     # per-sample int64 the engine adds: R2 records by it, errors name it


def sample_names(td: Any) -> list[str]:
    """How verl knows each sample: its index in the engine's batch (:data:`SAMPLE_KEY`) and
    verl's ``uid`` (the prompt group) where the batch has them, else its micro-batch position."""
    get = td.get if hasattr(td, "get") else lambda key, default=None: default
    return indexed_names(len(td) if hasattr(td, "__len__") else 0, get(SAMPLE_KEY, None), get("uid", None))


def provenance_pairing(td: Any) -> ProvenancePairing:
    """The batch's route and log-prob provenance (a missing field: unknown, counted unchecked); a
    batch field, or in each sample's ``extra_fields`` (verl 0.9.1's V1 trainer: ``agent_loop_tq.py:193``)."""
    return pairing_from_fields(lambda key: sample_field(td, key, nested="extra_fields"), samples=len(td),
                               names=sample_names(td), engine="verl", framework="verl")


def handed_routes(td, *, moe_layer_ids, num_experts: int, route_kind: str, num_hidden_layers: int | None = None,
                  topk: int | None = None, layer_axis: str | None = None) -> HandedRoutes:
    """``td[ROUTES_KEY]`` of a (micro-)batch (or the field itself) as the one reader reads it
    (:func:`r3bridge.adapters.verl.nested.handed_from_batch`: ``layer_axis``, ``topk``)."""
    return handed_from_batch(td, field=ROUTES_KEY, weights_field=WEIGHTS_KEY, names=sample_names, framework="verl",
                             num_experts=num_experts, moe_layer_ids=moe_layer_ids, route_kind=route_kind,
                             num_hidden_layers=num_hidden_layers, topk=topk, layer_axis=layer_axis)


class VerlCodec(HandedCodec):
    """The :class:`r3bridge.protocols.BatchCodec` of verl's no-padding ``TensorDict`` batch."""

    def handed_routes(self, native: Any, *, route_kind: str = "rollout") -> HandedRoutes:
        return handed_routes(native, moe_layer_ids=self.moe_layer_ids, num_experts=self.num_experts,
                             route_kind=route_kind, num_hidden_layers=self.num_hidden_layers, topk=self.topk)

    def write_recorded(self, native: Any, recorded: ReplayBatch) -> Any:
        native[ROUTES_KEY] = nested_routes(recorded)    # R2's routes in verl's transport ("no route": zero rows)
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

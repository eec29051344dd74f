"""AReaL's training batch <-> r3bridge (pure torch: no areal import).

Routes travel as one sequence-last tensor per trajectory, ``[g, L_moe, K, S]``
(:mod:`r3bridge.adapters.areal.sequence_last`: what AReaL's concat / split / unpad keep exactly); the engine
slices them per micro-batch by sample id. docs/use-with-areal.md, "What happens where".
"""
from __future__ import annotations

import functools
from typing import Optional

from r3bridge.adapters.areal.sequence_last import (
    right_padded_handed,
    right_padded_routes,
    sequence_last_handed,
    split_carrying,
)
from r3bridge.batch.provenance import (
    LOGPROB_PROVENANCE_KEY,
    ROUTE_PROVENANCE_KEY,
)
from r3bridge.forms.codec import HandedCodec
from r3bridge.hf import ModelInfo
from r3bridge.parallel.handed import HandedRoutes

__all__ = ["ROUTES_KEY", "RECORDED_KEY", "SAMPLE_KEY", "REPREFILL_KEY", "ROUTE_PROVENANCE_KEY", "LOGPROB_PROVENANCE_KEY", "ENGINE",
           "ArealCodec", "handed_routes", "batch_handed_routes", "batch_tensor"]

ROUTES_KEY = "r3bridge_routes"        # rollout routes (R3), one [g, L_moe, K, S] tensor per trajectory
RECORDED_KEY = "r3bridge_recorded"    # R2: routes recorded in compute_logp, same layout
SAMPLE_KEY = "r3bridge_sample"        # [B, S] int64 batch-level sample id (transient, added by the actor)
# per trajectory [1, 2] int64 (batched [B, 2]): (rows a later turn returned again, of those the rows
# that differed from the first-seen ones): the counts verl's agent loop keeps as extra fields
REPREFILL_KEY = "r3bridge_reprefill_rows"
# ROUTE_PROVENANCE_KEY / LOGPROB_PROVENANCE_KEY (r3bridge.batch.provenance): per trajectory [1, 3] int64
# (batched [B, 3]): (weight version, re-prefill epoch, attempt), -1 unknown; AReaL's R3 engine is
# SGLang, no request id travels
ENGINE = "sglang"
PROVENANCE_KEYS = (ROUTE_PROVENANCE_KEY, LOGPROB_PROVENANCE_KEY)


# rows ``rows`` of a [B, L_moe, K, S] routes tensor, tokens [0, lens[i]) of each, viewed (nothing copied or checked)
handed_routes = functools.partial(sequence_last_handed, framework="AReaL")
batch_handed_routes = functools.partial(right_padded_handed, framework="AReaL")   # a batched dict, batch order
batch_tensor = functools.partial(right_padded_routes, framework="AReaL")    # R2 write-back, on the mask's device


class ArealCodec(HandedCodec):
    """The :class:`r3bridge.protocols.BatchCodec` of AReaL's batched trajectory dicts."""

    def __init__(self, model: ModelInfo) -> None:
        super().__init__(num_experts=model.num_experts, moe_layer_ids=model.moe_layer_ids, topk=model.topk)
        self.model = model

    def handed_routes(self, native: dict, *, route_kind: str = "rollout") -> HandedRoutes:
        key = RECORDED_KEY if route_kind == "recorded" else ROUTES_KEY
        return batch_handed_routes(native, key=key, route_kind=route_kind, num_experts=self.num_experts,
                                   moe_layer_ids=self.moe_layer_ids, topk=self.topk)

    def write_recorded(self, native: dict, recorded) -> dict:
        native[RECORDED_KEY] = batch_tensor(recorded, native["attention_mask"])
        return native

    def split(self, native: dict, num_parts: int, order: Optional[list] = None):
        """AReaL's own ``split_padded_tensor_dict_into_mb_list`` (token-balanced, reorders samples),
        the routes carried as the engine carries them (:func:`split_carrying`)."""
        from r3bridge.adapters.areal._compat import import_areal
        data_mod = import_areal("areal.utils.data")
        spec = import_areal("areal.api.cli_args").MicroBatchSpec(n_mbs=num_parts)
        return split_carrying(native, lambda fields: data_mod.split_padded_tensor_dict_into_mb_list(fields, spec).mbs,
                              carried=(ROUTES_KEY, RECORDED_KEY), sample_key=SAMPLE_KEY)


"""SkyRL's training batch <-> :class:`r3bridge.ReplayBatch` (reading needs no skyrl import): 0.4's
packed, 0.3's padded ``rollout_expert_indices``. docs/use-with-skyrl.md, "Releases and transports"."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge.adapters.skyrl._compat import import_skyrl, skyrl_release
from r3bridge.batch.provenance import ProvenancePairing, pairing_from_fields
from r3bridge.batch.schema import ReplayBatch
from r3bridge.errors import ConfigError, RouteShapeError
from r3bridge.forms.codec import HandedCodec
from r3bridge.forms.masked import (
    batch_field,
    masked_field_routes,
    masked_packed_routes,
    masked_padded_routes,
    row_names,
)
from r3bridge.parallel.handed import HandedRoutes

__all__ = ["ROUTES_KEY", "MASK_KEY", "ROUTES_MARK", "ENGINE", "SkyRLCodec", "handed_routes", "training_batch_fields",
           "provenance_pairing"]

ROUTES_KEY = "rollout_expert_indices"
MASK_KEY = "router_padding_mask"
ROUTES_MARK = "r3bridge_routes"        # TrainingInputBatch.metadata: which routes the batch carries
ENGINE = "skyrl"     # the provenance fields (per-sample int64 [B, 3]) hold no engine name nor request id


def handed_routes(batch: Any, *, num_experts: int, moe_layer_ids: Sequence[int],
                  num_hidden_layers: Optional[int] = None, route_kind: str = "rollout", routes_key: str = ROUTES_KEY,
                  topk: Optional[int] = None, sample_ids: Optional[Sequence[int]] = None) -> HandedRoutes:
    """The routes of a ``TrainingInputBatch`` (or worker micro-batch dict), viewed for the one reader
    (:mod:`r3bridge.forms.masked`); samples named by their row (or ``sample_ids[i]``)."""
    routes = batch_field(batch, routes_key)
    if routes is None:
        raise ConfigError(f"the batch has no {routes_key!r}: enable generator.inference_engine."
                          f"enable_return_routed_experts (R3), or R2's recorded routes were not written back")
    attn = batch_field(batch, "attention_mask")
    if attn is None:
        raise RouteShapeError("the batch has no 'attention_mask'")
    if batch_field(batch, "sub_seq_lengths") is not None:
        raise ConfigError("SkyRL sub-sequence packing (sub_seq_lengths) carries several samples per row; "
                          "r3bridge needs one sample per row")
    mask = batch_field(batch, MASK_KEY)
    # SkyRL 0.4's PackedTensor, duck-typed (reading needs no skyrl import)
    if hasattr(routes, "values") and hasattr(routes, "cu_seqlens") and not isinstance(routes, torch.Tensor):
        if mask is None:
            raise ConfigError(f"SkyRL 0.4 {routes_key} comes with {MASK_KEY!r} (True = no captured route); the "
                              f"batch has none")
        routes = (routes.values, routes.cu_seqlens)
    # SkyRL 0.3.0 marks "no route" with zero rows (its own padding micro-batches of token-based
    # micro-batching too, whose first token is "real"), and its worker does not carry
    # router_padding_mask into micro-batches
    return masked_field_routes(routes, attn, mask, field=routes_key, mask_field=MASK_KEY, num_experts=num_experts,
                               moe_layer_ids=moe_layer_ids, num_hidden_layers=num_hidden_layers, topk=topk,
                               route_kind=route_kind, names=row_names(int(torch.as_tensor(attn).shape[0]), sample_ids),
                               framework="SkyRL")


def training_batch_fields(rb: ReplayBatch, attention_mask: torch.Tensor, *, num_hidden_layers: int,
                          dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """R2 write-back, SkyRL 0.3: ``rollout_expert_indices`` ``[B, S, num_hidden_layers, K]`` (dummy
    rows ``0..K-1`` where there is no route) and ``router_padding_mask``."""
    routes, mask = masked_padded_routes(rb, attention_mask, num_hidden_layers=num_hidden_layers, dtype=dtype,
                                        names=row_names(rb.num_seqs), framework="SkyRL")
    return {ROUTES_KEY: routes, MASK_KEY: mask}


class SkyRLCodec(HandedCodec):
    """The :class:`r3bridge.protocols.BatchCodec` of SkyRL's ``TrainingInputBatch``; ``release``: the
    layout recorded routes are written back in (default: the installed release's; reading takes both)."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: int,
                 release: Optional[str] = None, topk: Optional[int] = None) -> None:
        super().__init__(num_experts=num_experts, moe_layer_ids=moe_layer_ids, num_hidden_layers=num_hidden_layers,
                         topk=topk)
        self.release = skyrl_release(release + ".0" if release else None) or "0.3"

    def handed_routes(self, native: Any, *, route_kind: str = "rollout") -> HandedRoutes:
        layers = None if route_kind == "recorded" else self.num_hidden_layers
        return handed_routes(native, num_experts=self.num_experts, moe_layer_ids=self.moe_layer_ids,
                             route_kind=route_kind, num_hidden_layers=layers, topk=self.topk)

    def write_recorded(self, native: Any, recorded: ReplayBatch) -> Any:
        if self.release == "0.4":      # SkyRL's own PackedTensor and padding row, so its batch ops accept them
            values, cu, mask = masked_packed_routes(
                recorded, native["attention_mask"], num_hidden_layers=self.num_hidden_layers,
                fill=import_skyrl("skyrl.backends.skyrl_train.utils.replay_utils").replay_padding_row,
                names=row_names(recorded.num_seqs), framework="SkyRL")
            packed = import_skyrl("skyrl.backends.skyrl_train.utils.packed_tensor").PackedTensor
            fields = {ROUTES_KEY: packed(values, cu), MASK_KEY: mask}
        else:
            fields = training_batch_fields(recorded, native["attention_mask"], num_hidden_layers=self.num_hidden_layers)
        for k, v in fields.items():
            native[k] = v
        if getattr(native, "metadata", None) is None:
            native.metadata = {}
        native.metadata[ROUTES_MARK] = "recorded"
        return native

    def split(self, native: Any, num_parts: int, order: Optional[list[int]] = None) -> list[tuple[Any, list[int]]]:
        """SkyRL's ``TensorBatch.chunk`` (its micro-batching), after an optional sample permutation."""
        b = native.batch_size
        idx = list(range(b)) if order is None else [int(i) for i in order]
        src = native
        if order is not None:
            t = torch.tensor(idx)
            src = type(native)({k: (None if v is None else v[t]) for k, v in native.items()})
            src.metadata = native.metadata
        size = -(-b // num_parts)
        parts = src.chunk(size)
        return [(p, idx[i * size:(i + 1) * size]) for i, p in enumerate(parts)]


def provenance_pairing(batch: Any) -> ProvenancePairing:
    """A ``TrainingInputBatch``'s route and log-prob provenance (a missing field: counted unchecked)."""
    n = int(batch_field(batch, "attention_mask").shape[0])
    return pairing_from_fields(lambda key: batch_field(batch, key), samples=n, names=row_names(n), engine=ENGINE,
                               framework="SkyRL")

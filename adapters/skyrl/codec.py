"""SkyRL's training batch <-> :class:`r3bridge.ReplayBatch` (reading needs no skyrl import).

``rollout_expert_indices`` holds every decoder layer's routes: SkyRL 0.4 as a ``PackedTensor`` (one
row per real token, ``router_padding_mask`` required), SkyRL 0.3 as ``[B, S, L_all, K]`` left-padded
like ``sequences`` (``router_padding_mask`` in SkyRL main; 0.3.0 writes "no route" as zero rows).
docs/use-with-skyrl.md, "Releases and transports".
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from r3bridge.batch.dense import token_rows
from r3bridge.batch.provenance import (
    LOGPROB_PROVENANCE_KEY,
    ROUTE_PROVENANCE_KEY,
    ProvenancePairing,
    pairing_from_fields,
    provenance_fields,
)
from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.engines.layer_axis import axis_columns
from r3bridge.errors import ConfigError, RouteShapeError
from r3bridge.hf import check_topk
from r3bridge.ingest.codec_base import HandedCodec
from r3bridge.ingest.handed import HandedRoutes

__all__ = ["ROUTES_KEY", "MASK_KEY", "ROUTES_MARK", "ROUTE_PROVENANCE_KEY", "LOGPROB_PROVENANCE_KEY", "ENGINE",
           "SkyRLCodec", "handed_routes", "training_batch_fields",
           "packed_training_batch_fields", "provenance_fields", "provenance_pairing"]

ROUTES_KEY = "rollout_expert_indices"
MASK_KEY = "router_padding_mask"
ROUTES_MARK = "r3bridge_routes"        # TrainingInputBatch.metadata: which routes the batch carries
# ROUTE_PROVENANCE_KEY / LOGPROB_PROVENANCE_KEY: per-sample int64 [B, 3] (provenance_fields); the batch
# holds no engine name or request id, so provenance names the engine ENGINE and no request
ENGINE = "skyrl"


def _get(batch: Any, key: str) -> Any:
    if isinstance(batch, Mapping):
        return batch.get(key)
    try:
        return batch[key]
    except KeyError:
        return None


def _row_names(batch: Any, sample_ids: Optional[Sequence[int]]) -> list[str]:
    if sample_ids is not None:
        return [f"batch row {int(i)}" for i in sample_ids]
    attn = _get(batch, "attention_mask")
    n = int(torch.as_tensor(attn).shape[0]) if attn is not None else 0
    return [f"batch row {i}" for i in range(n)]


def handed_routes(batch: Any, *, num_experts: int, moe_layer_ids: Sequence[int],
                  num_hidden_layers: Optional[int] = None, route_kind: str = "rollout", routes_key: str = ROUTES_KEY,
                  topk: Optional[int] = None, sample_ids: Optional[Sequence[int]] = None) -> HandedRoutes:
    """The routes of a ``TrainingInputBatch`` (or worker micro-batch dict) as the one reader reads
    them: SkyRL's own buffer viewed, nothing copied or checked yet. "No route":
    ``router_padding_mask`` where the batch has it, else (SkyRL 0.3.0) zero rows. Samples are named
    by their row of ``batch`` (``sample_ids[i]``: e.g. a micro-batch row's mini-batch row)."""
    routes = _get(batch, routes_key)
    if routes is None:
        raise ConfigError(f"the batch has no {routes_key!r}: enable generator.inference_engine."
                          f"enable_return_routed_experts (R3), or R2's recorded routes were not written back")
    attn = _get(batch, "attention_mask")
    if attn is None:
        raise RouteShapeError("the batch has no 'attention_mask'")
    if _get(batch, "sub_seq_lengths") is not None:
        raise ConfigError("SkyRL sub-sequence packing (sub_seq_lengths) carries several samples per row; "
                          "r3bridge needs one sample per row")
    names = _row_names(batch, sample_ids)
    moe = [int(i) for i in moe_layer_ids]
    mask = _get(batch, MASK_KEY)
    if _is_packed(routes):
        values, cu = torch.as_tensor(routes.values), torch.as_tensor(routes.cu_seqlens).long()
        check_topk(routes_key, int(values.shape[-1]), topk)
        if values.dim() != 3:
            raise RouteShapeError(f"{routes_key} values must be [tokens, layers, topk], got {tuple(values.shape)}")
        if mask is None:
            raise ConfigError(f"SkyRL 0.4 {routes_key} comes with {MASK_KEY!r} (True = no captured route); the "
                              f"batch has none")
        # [B, S] masks: host arrays (small torch ops on CPU stall on the thread pool's barriers)
        attn_b = torch.as_tensor(attn).bool().cpu().numpy()
        mask_b = torch.as_tensor(mask).bool().cpu().numpy()
        if mask_b.shape != attn_b.shape:
            raise RouteShapeError(f"{MASK_KEY} is {tuple(mask_b.shape)}, attention_mask {tuple(attn_b.shape)}")
        lens = attn_b.sum(1).tolist()
        seg = (cu[1:] - cu[:-1]).tolist()
        if seg != lens:
            raise RouteShapeError(f"{routes_key} segments {seg} do not match the real-token counts {lens} "
                                  f"(SkyRL 0.4 packs one route row per real token)")
        cols = _columns(int(values.shape[1]), moe, num_hidden_layers, routes_key)
        valid = torch.from_numpy(~mask_b[attn_b])       # real tokens in row order == packed row order
        return HandedRoutes.from_packed(values, lens, num_experts=num_experts, layer_ids=moe, columns=cols,
                                        no_route="mask", valid=valid.to(values.device), route_kind=route_kind, names=names,
                                        framework="SkyRL")
    routes = torch.as_tensor(routes)
    if routes.dim() != 4:
        raise RouteShapeError(f"{routes_key} must be [batch, seq, layers, topk], got {tuple(routes.shape)}")
    check_topk(routes_key, int(routes.shape[-1]), topk)
    cols = _columns(int(routes.shape[2]), moe, num_hidden_layers, routes_key)
    attn_b = torch.as_tensor(attn).bool()
    if mask is not None:
        valid = attn_b & ~torch.as_tensor(mask).bool().to(attn_b.device)
        return HandedRoutes.from_padded(routes, attn_b, num_experts=num_experts, layer_ids=moe, columns=cols,
                                        no_route="mask", valid=valid, route_kind=route_kind, names=names, framework="SkyRL")
    # SkyRL 0.3.0 marks "no route" with zero rows (its own padding micro-batches of token-based
    # micro-batching too, whose first token is "real"), and its worker does not carry
    # router_padding_mask into micro-batches; recorded routes hold a route on every token (at
    # top-1 an expert-0 row is one)
    no_route = "none" if route_kind == "recorded" and int(routes.shape[-1]) == 1 else "zero"
    return HandedRoutes.from_padded(routes, attn_b, num_experts=num_experts, layer_ids=moe, columns=cols,
                                    no_route=no_route, route_kind=route_kind, names=names, framework="SkyRL")


def _columns(reported: int, moe: list[int], num_hidden_layers: Optional[int], field: str) -> Optional[list[int]]:
    return axis_columns(reported, layer_axis=None, moe_layer_ids=moe, num_hidden_layers=num_hidden_layers, field=field)


def _is_packed(field: Any) -> bool:
    """SkyRL 0.4's ``PackedTensor`` (duck-typed: reading needs no skyrl import)."""
    return hasattr(field, "values") and hasattr(field, "cu_seqlens") and not isinstance(field, torch.Tensor)


def packed_training_batch_fields(rb: ReplayBatch, attention_mask: torch.Tensor, *, num_hidden_layers: int,
                                 packed_tensor: type, padding_row: Any) -> dict[str, Any]:
    """R2 write-back, SkyRL 0.4: ``rollout_expert_indices`` as SkyRL's own ``packed_tensor`` (one row
    per real token, every decoder layer, SkyRL's ``padding_row`` where there is no route) and
    ``router_padding_mask``, for a ReplayBatch of one sequence per row of ``attention_mask``."""
    attn, lens = _token_mask(rb, attention_mask)
    dtype = route_dtype(rb.num_experts)
    values, routed = token_rows(rb, lens, fill=torch.as_tensor(padding_row(rb.topk, dtype=dtype)), dtype=dtype,
                                num_hidden_layers=num_hidden_layers)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    mask = torch.ones_like(attn)
    mask[attn] = ~routed
    return {ROUTES_KEY: packed_tensor(values, cu), MASK_KEY: mask}


def _token_mask(rb: ReplayBatch, attention_mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    attn = torch.as_tensor(attention_mask).bool().cpu()
    if rb.num_seqs != attn.shape[0]:
        raise RouteShapeError(f"{rb.num_seqs} sequences for a batch of {attn.shape[0]}")
    return attn, attn.sum(1).tolist()


def training_batch_fields(rb: ReplayBatch, attention_mask: torch.Tensor, *, num_hidden_layers: int,
                          dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """R2 write-back, SkyRL 0.3: ``rollout_expert_indices`` ``[B, S, num_hidden_layers, K]`` on the
    real tokens, dummy rows ``0..K-1`` everywhere else, and ``router_padding_mask``."""
    attn, lens = _token_mask(rb, attention_mask)
    dtype = route_dtype(rb.num_experts) if dtype is None else dtype
    dummy = torch.arange(rb.topk, dtype=dtype)
    values, routed = token_rows(rb, lens, fill=dummy, dtype=dtype, num_hidden_layers=num_hidden_layers)
    out = dummy.expand(*attn.shape, num_hidden_layers, rb.topk).clone()
    out[attn] = values
    mask = torch.ones_like(attn)
    mask[attn] = ~routed
    return {ROUTES_KEY: out, MASK_KEY: mask}


class SkyRLCodec(HandedCodec):
    """The :class:`r3bridge.protocols.BatchCodec` of SkyRL's ``TrainingInputBatch``; ``release``: the
    layout recorded routes are written back in (default: the installed release's; reading takes both)."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: int,
                 release: Optional[str] = None, topk: Optional[int] = None) -> None:
        from r3bridge.adapters.skyrl._compat import skyrl_release
        super().__init__(num_experts=num_experts, moe_layer_ids=moe_layer_ids, num_hidden_layers=num_hidden_layers,
                         topk=topk)
        self.release = skyrl_release(release + ".0" if release else None) or "0.3"

    def handed_routes(self, native: Any, *, route_kind: str = "rollout") -> HandedRoutes:
        return handed_routes(native, num_experts=self.num_experts, moe_layer_ids=self.moe_layer_ids, route_kind=route_kind,
                             num_hidden_layers=None if route_kind == "recorded" else self.num_hidden_layers, topk=self.topk)

    def write_recorded(self, native: Any, recorded: ReplayBatch) -> Any:
        if self.release == "0.4":      # SkyRL's own PackedTensor and padding row, so its batch ops accept them
            from r3bridge.adapters.skyrl._compat import import_skyrl
            fields = packed_training_batch_fields(
                recorded, native["attention_mask"], num_hidden_layers=self.num_hidden_layers,
                packed_tensor=import_skyrl("skyrl.backends.skyrl_train.utils.packed_tensor").PackedTensor,
                padding_row=import_skyrl("skyrl.backends.skyrl_train.utils.replay_utils").replay_padding_row)
        else:
            fields = training_batch_fields(recorded, native["attention_mask"], num_hidden_layers=self.num_hidden_layers)
        for k, v in fields.items():
            native[k] = v
        if getattr(native, "metadata", None) is None:
            native.metadata = {}
        native.metadata[ROUTES_MARK] = "recorded"
        return native

    def seq_lens(self, native: Any) -> list[int]:
        return native["attention_mask"].sum(-1).long().tolist()

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
    n = int(_get(batch, "attention_mask").shape[0])
    return pairing_from_fields(lambda key: _get(batch, key), samples=n, names=_row_names(batch, None), engine=ENGINE,
                               framework="SkyRL")

"""AReaL's training batch <-> :class:`r3bridge.ReplayBatch` (pure torch: no areal import).

AReaL's batches are dicts of ``[B, S, ...]`` tensors that its own utilities concat,
split (``split_padded_tensor_dict_into_mb_list`` moves only tensors with ``B*S`` elements), unpad
(``split_and_unpad_tensor`` trims the *last* dim to the sequence length) and deep-copy non-tensor
values into every trajectory. Routes therefore travel as one tensor per trajectory,
``[g, L_moe, K, S]`` (sequence last, so trimming is exact), ids in the narrowest dtype and a
sentinel where a token has no route (``r3bridge.batch.schema.sentinel_dtype``); the engine slices them per micro-batch explicitly
by sample id.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from r3bridge.batch.dense import token_rows
from r3bridge.batch.provenance import (
    LOGPROB_PROVENANCE_KEY,
    ROUTE_PROVENANCE_KEY,
    ProvenancePairing,
    pairing_from_fields,
    provenance_fields,
)
from r3bridge.batch.schema import ReplayBatch, sentinel_dtype
from r3bridge.errors import CoverageError, LayerMappingError, RouteShapeError
from r3bridge.hf import check_topk
from r3bridge.ingest.codec_base import HandedCodec
from r3bridge.ingest.handed import HandedRoutes

if TYPE_CHECKING:  # pragma: no cover
    from r3bridge.adapters.areal.config import ModelInfo

__all__ = ["ROUTES_KEY", "RECORDED_KEY", "SAMPLE_KEY", "ROUTE_PROVENANCE_KEY", "LOGPROB_PROVENANCE_KEY", "ENGINE",
           "ArealCodec", "trajectory_tensor", "handed_routes", "batch_handed_routes", "batch_tensor",
           "provenance_fields", "provenance_pairing"]

ROUTES_KEY = "r3bridge_routes"        # rollout routes (R3), one [g, L_moe, K, S] tensor per trajectory
RECORDED_KEY = "r3bridge_recorded"    # R2: routes recorded in compute_logp, same layout
SAMPLE_KEY = "r3bridge_sample"        # [B, S] int64 batch-level sample id (transient, added by the actor)
# ROUTE_PROVENANCE_KEY / LOGPROB_PROVENANCE_KEY (r3bridge.batch.provenance): per trajectory [1, 3] int64
# (batched [B, 3]): (weight version, re-prefill epoch, attempt), -1 unknown; AReaL's R3 engine is
# SGLang, no request id travels
ENGINE = "sglang"
PROVENANCE_KEYS = (ROUTE_PROVENANCE_KEY, LOGPROB_PROVENANCE_KEY)


def trajectory_tensor(rb: ReplayBatch, seq_lens: Sequence[int], width: Optional[int] = None) -> torch.Tensor:
    """ReplayBatch -> ``[n, L_moe, K, width]`` (sequence last), the sentinel where there is no route."""
    dtype, none = sentinel_dtype(rb.num_experts)
    lens = [int(x) for x in seq_lens]
    rows, _ = token_rows(rb, lens, fill=none, dtype=dtype)
    out = torch.full((rb.num_seqs, rb.num_layers, rb.topk, max(lens) if width is None else int(width)), none,
                     dtype=dtype, device=rows.device)
    tokens = torch.arange(out.shape[-1], device=rows.device)[None, :] < torch.tensor(lens, device=rows.device)[:, None]
    out.permute(0, 3, 1, 2)[tokens] = rows          # [n, S, L, K] view: each sequence's tokens in order
    return out


def handed_routes(t: torch.Tensor, rows: Sequence[int], lens: Sequence[int], *, num_experts: int,
                  moe_layer_ids: Sequence[int], route_kind: str = "rollout", topk: Optional[int] = None) -> HandedRoutes:
    """Rows ``rows`` of a ``[B, L_moe, K, S]`` routes tensor, tokens ``[0, lens[i])`` of each (AReaL
    batches are right-padded), as the one reader reads them (:mod:`r3bridge.ingest.handed`): AReaL's own
    tensor viewed where it lies (the trainer's GPU in a GPU job), nothing copied or checked yet;
    the sentinel marks tokens without a route. Samples are named by their row of ``t``."""
    t = torch.as_tensor(t)
    if t.dim() != 4:
        raise RouteShapeError(f"routes must be [batch, layers, topk, seq], got {tuple(t.shape)}")
    check_topk("routes", int(t.shape[2]), topk)
    if t.shape[1] != len(moe_layer_ids):
        raise LayerMappingError(f"routes have {t.shape[1]} layers, the model has MoE layers {list(moe_layer_ids)}")
    _, none = sentinel_dtype(num_experts)
    return HandedRoutes.from_sequence_last(t, rows, lens, num_experts=num_experts, layer_ids=list(moe_layer_ids),
                                           sentinel=none, route_kind=route_kind, names=[f"batch row {int(r)}" for r in rows],
                                           framework="AReaL")


def _right_padded_lens(attention_mask: torch.Tensor) -> list[int]:
    attn = torch.as_tensor(attention_mask).bool().cpu()   # on the GPU in a GPU job: a host check
    lens = attn.sum(-1).long()
    pos = torch.arange(attn.shape[-1])[None, :]
    if not bool((attn == (pos < lens[:, None])).all()):
        raise CoverageError("AReaL batches are right-padded; this attention_mask is not")
    return lens.tolist()


def batch_handed_routes(data: dict, *, key: str, num_experts: int, moe_layer_ids: Sequence[int],
                        route_kind: str = "rollout", topk: Optional[int] = None) -> HandedRoutes:
    """A batched AReaL dict (``attention_mask`` ``[B, S]``, ``key`` ``[B, L_moe, K, S]``) as
    :func:`handed_routes` of all its samples, in batch order."""
    t = data.get(key)
    if t is None:
        raise CoverageError(f"the batch has no {key!r}")
    lens = _right_padded_lens(data["attention_mask"])
    return handed_routes(t, range(len(lens)), lens, num_experts=num_experts, moe_layer_ids=moe_layer_ids,
                         route_kind=route_kind, topk=topk)


def batch_tensor(rb: ReplayBatch, attention_mask: torch.Tensor) -> torch.Tensor:
    """R2 write-back: recorded ReplayBatch (batch order) -> ``[B, L_moe, K, S]`` for a right-padded
    ``attention_mask``, on its device (the batch's other fields are on the trainer's GPU)."""
    attn = torch.as_tensor(attention_mask)
    return trajectory_tensor(rb, _right_padded_lens(attn), width=attn.shape[-1]).to(attn.device)


class ArealCodec(HandedCodec):
    """The :class:`r3bridge.protocols.BatchCodec` of AReaL's batched trajectory dicts."""

    def __init__(self, model: "ModelInfo") -> None:
        super().__init__(num_experts=model.num_experts, moe_layer_ids=model.moe_layer_ids, topk=model.topk)
        self.model = model

    def handed_routes(self, native: dict, *, route_kind: str = "rollout") -> HandedRoutes:
        return batch_handed_routes(native, key=RECORDED_KEY if route_kind == "recorded" else ROUTES_KEY, route_kind=route_kind,
                                   num_experts=self.num_experts, moe_layer_ids=self.moe_layer_ids, topk=self.topk)

    def write_recorded(self, native: dict, recorded) -> dict:
        native[RECORDED_KEY] = batch_tensor(recorded, native["attention_mask"])
        return native

    def seq_lens(self, native: dict) -> list[int]:
        return native["attention_mask"].sum(-1).long().tolist()

    def split(self, native: dict, num_parts: int, order: Optional[list] = None):
        """AReaL's own ``split_padded_tensor_dict_into_mb_list`` (token-balanced, reorders samples),
        with the routes tensor carried whole and sliced by the per-token sample ids, as the engine
        does."""
        from r3bridge.adapters.areal._compat import import_areal
        data_mod = import_areal("areal.utils.data")
        spec_mod = import_areal("areal.api.cli_args")
        d = dict(native)
        attn = d["attention_mask"]
        d[SAMPLE_KEY] = torch.arange(attn.shape[0])[:, None].expand(attn.shape).contiguous()
        carried = {k: d.pop(k) for k in (ROUTES_KEY, RECORDED_KEY) if k in d}
        mbl = data_mod.split_padded_tensor_dict_into_mb_list(d, spec_mod.MicroBatchSpec(n_mbs=num_parts))
        out = []
        for mb in mbl.mbs:
            ids = mb[SAMPLE_KEY][:, 0].tolist()
            part = {k: v for k, v in mb.items() if k != SAMPLE_KEY}
            part.update({k: v[torch.tensor(ids)] for k, v in carried.items()})
            out.append((part, ids))
        return out


def provenance_pairing(data: dict) -> ProvenancePairing:
    """A batched AReaL dict's route and log-prob provenance, one per trajectory (a missing field:
    unknown, its samples counted unchecked), named by batch row."""
    n = int(data["attention_mask"].shape[0])
    return pairing_from_fields(data.get, samples=n, names=[f"batch row {i}" for i in range(n)], engine=ENGINE,
                               framework="AReaL")

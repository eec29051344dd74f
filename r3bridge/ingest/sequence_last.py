"""A sequence-last routes field (``[B, L_moe, K, S]``, :mod:`r3bridge.batch.sequence_last`) as the
one reader reads it: :class:`~r3bridge.ingest.handed.HandedRoutes`, the framework's own tensor
viewed where it lies (the trainer's GPU in a GPU job), nothing copied, no id read yet."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge.batch.schema import sentinel_dtype
from r3bridge.batch.sequence_last import right_padded_lens
from r3bridge.errors import CoverageError, LayerMappingError, RouteShapeError
from r3bridge.hf import check_topk
from r3bridge.ingest.handed import HandedRoutes

__all__ = ["sequence_last_handed", "right_padded_handed"]


def sequence_last_handed(t: Any, rows: Sequence[int], lens: Sequence[int], *, num_experts: int,
                         moe_layer_ids: Sequence[int], route_kind: str = "rollout", topk: Optional[int] = None,
                         framework: Optional[str] = None) -> HandedRoutes:
    """Rows ``rows`` of ``t``, tokens ``[0, lens[i])`` of each (right-padded), the model's MoE
    layers and top-k checked first; the sentinel of ``num_experts`` marks tokens without a route.
    Samples are named by their row of ``t``."""
    t = torch.as_tensor(t)
    if t.dim() != 4:
        raise RouteShapeError(f"routes must be [batch, layers, topk, seq], got {tuple(t.shape)}")
    check_topk("routes", int(t.shape[2]), topk)
    if t.shape[1] != len(moe_layer_ids):
        raise LayerMappingError(f"routes have {t.shape[1]} layers, the model has MoE layers {list(moe_layer_ids)}")
    _, none = sentinel_dtype(num_experts)
    return HandedRoutes.from_sequence_last(t, rows, lens, num_experts=num_experts, layer_ids=list(moe_layer_ids),
                                           sentinel=none, route_kind=route_kind,
                                           names=[f"batch row {int(r)}" for r in rows], framework=framework)


def right_padded_handed(data: Any, *, key: str, num_experts: int, moe_layer_ids: Sequence[int],
                        route_kind: str = "rollout", topk: Optional[int] = None,
                        framework: Optional[str] = None) -> HandedRoutes:
    """A batch mapping (``attention_mask`` ``[B, S]`` right-padded, ``key`` ``[B, L_moe, K, S]``) as
    :func:`sequence_last_handed` of all its samples, in batch order."""
    t = data.get(key)
    if t is None:
        raise CoverageError(f"the batch has no {key!r}")
    lens = right_padded_lens(data["attention_mask"], framework=framework or "the framework's")
    return sequence_last_handed(t, range(len(lens)), lens, num_experts=num_experts, moe_layer_ids=moe_layer_ids,
                                route_kind=route_kind, topk=topk, framework=framework)

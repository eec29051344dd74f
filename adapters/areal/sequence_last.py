"""AReaL's sequence-last routes form, ``[B, L_moe, K, S]``: written (a
:class:`~r3bridge.ReplayBatch` as one field per batch) and read (the one reader's
:class:`~r3bridge.parallel.handed.HandedRoutes`, the tensor viewed where it lies, nothing copied).

AReaL trims every per-sample field's *last* dimension to the sample's length
(``split_and_unpad_tensor``), so routes stay exact only when the sequence is the last axis. The
ids are in the narrowest dtype with an in-band "no route" sentinel
(:func:`r3bridge.batch.schema.sentinel_dtype`: 255 in ``uint8``, else -1) on every token the batch
does not route.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from r3bridge.batch.dense import token_rows
from r3bridge.batch.recorded import split_sizes
from r3bridge.batch.schema import ReplayBatch, sentinel_dtype
from r3bridge.errors import CoverageError, LayerMappingError, RouteShapeError
from r3bridge.hf import check_topk
from r3bridge.parallel.handed import HandedRoutes

__all__ = ["sequence_last_routes", "right_padded_lens", "right_padded_routes", "per_token_sample_ids", "split_carrying",
           "write_right_padded", "sequence_last_handed", "right_padded_handed"]


def sequence_last_routes(batch: ReplayBatch, seq_lens: Sequence[int], width: Optional[int] = None) -> torch.Tensor:
    """``batch`` -> ``[n, L, K, width]`` (default width: the longest sequence), each sequence's
    ``seq_lens[i]`` tokens first, the sentinel where there is no route."""
    dtype, none = sentinel_dtype(batch.num_experts)
    lens = [int(x) for x in seq_lens]
    rows, _ = token_rows(batch, lens, fill=none, dtype=dtype)
    out = torch.full((batch.num_seqs, batch.num_layers, batch.topk, max(lens) if width is None else int(width)),
                     none, dtype=dtype, device=rows.device)
    tokens = torch.arange(out.shape[-1], device=rows.device)[None, :] < torch.tensor(lens, device=rows.device)[:, None]
    out.permute(0, 3, 1, 2)[tokens] = rows          # [n, S, L, K] view: each sequence's tokens in order
    return out


def right_padded_lens(attention_mask: Any, *, framework: str = "the framework's") -> list[int]:
    """Each row's token count of a right-padded ``[B, S]`` mask (``CoverageError`` otherwise: a
    sequence-last field holds each sample's tokens from column 0)."""
    attn = torch.as_tensor(attention_mask).bool().cpu()   # on the GPU in a GPU job: a host check
    lens = attn.sum(-1).long()
    pos = torch.arange(attn.shape[-1])[None, :]
    if not bool((attn == (pos < lens[:, None])).all()):
        raise CoverageError(f"{framework} batches are right-padded; this attention_mask is not")
    return lens.tolist()


def right_padded_routes(batch: ReplayBatch, attention_mask: torch.Tensor, *,
                        framework: str = "the framework's") -> torch.Tensor:
    """``batch`` (one sequence per row, batch order) -> ``[B, L, K, S]`` for a right-padded
    ``attention_mask``, on its device (an R2 write-back beside the batch's other fields)."""
    attn = torch.as_tensor(attention_mask)
    lens = right_padded_lens(attn, framework=framework)
    return sequence_last_routes(batch, lens, width=attn.shape[-1]).to(attn.device)


def per_token_sample_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` int64: each token's batch row, on the mask's device (a per-token field that a
    framework's own splitter and packer move with its sample, wherever they put it)."""
    rows = torch.arange(attention_mask.shape[0], dtype=torch.int64, device=attention_mask.device)
    return rows[:, None].expand(attention_mask.shape).contiguous()


def split_carrying(native: dict, split: Callable[[dict], Iterable[dict]], *, carried: Sequence[str],
                   sample_key: str) -> list[tuple[dict, list[int]]]:
    """A right-padded batch dict split by the framework's own splitter ``split`` (which may reorder
    samples and cut per-token fields, a ``[B, L, K, S]`` one included, along its last axes): the
    sequence-last fields ``carried`` are carried whole and sliced by the per-token sample ids
    (:func:`per_token_sample_ids`, under ``sample_key``) the splitter moves with each sample.
    Returns each part and its samples' batch rows."""
    fields = dict(native)
    fields[sample_key] = per_token_sample_ids(fields["attention_mask"])
    whole = {k: fields.pop(k) for k in carried if k in fields}
    out = []
    for part in split(fields):
        ids = part[sample_key][:, 0].tolist()
        kept = {k: v for k, v in part.items() if k != sample_key}
        kept.update({k: v[torch.tensor(ids)] for k, v in whole.items()})
        out.append((kept, ids))
    return out


def write_right_padded(recorded_for: Callable[[int], ReplayBatch], batches: Sequence[dict], key: str, *,
                       framework: str = "the framework's") -> None:
    """R2's write-back into a framework's right-padded batch dicts (each with its ``attention_mask``),
    in place: ``recorded_for(n)`` (e.g. ``AdapterSession.recorded_for``) is the recording of their
    ``n`` samples in order; each dict gets its samples' ``[B, L, K, S]`` under ``key``, on its
    mask's device (:func:`right_padded_routes`)."""
    sizes = [int(batch["attention_mask"].shape[0]) for batch in batches]
    for batch, part in zip(batches, split_sizes(recorded_for(sum(sizes)), sizes)):
        batch[key] = right_padded_routes(part, batch["attention_mask"], framework=framework)



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

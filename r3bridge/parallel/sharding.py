"""The one reader's two public entries: one rank's R3 replay targets (:class:`ShardedTargets`) of
a micro-batch's routes, rows in the order that rank's routers see them.

* :func:`shard`: a validated :class:`r3bridge.ReplayBatch` (its ids are not checked again);
* :func:`rank_targets`: vLLM's engine arrays, no batch (only this rank's rows and layers are read,
  and checked).

Both are the same three steps as the driver's install (:class:`r3bridge.parallel.handed.HandedRoutes`
-> :class:`r3bridge.parallel.rank_rows.RankRows` -> :func:`r3bridge.parallel.read.read_targets`): the
pack plan and this rank's row map, the stage's layer columns gathered narrow and widened to int64
last. Everything is vectorised: no Python loop over tokens, rows or sequences.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge._validate import as_index, as_index_list
from r3bridge.batch.schema import ReplayBatch
from r3bridge.errors import CoverageError, LayerMappingError, LayoutError
from r3bridge.parallel.handed import HandedRoutes
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.packing import int64_tensor
from r3bridge.parallel.rank_rows import RankRows
from r3bridge.parallel.read import read_targets
from r3bridge.parallel.targets import ShardedTargets

__all__ = ["shard", "rank_targets", "checked_rank_args"]


def shard(batch: ReplayBatch, layout: ParallelLayout, seq_lens: Sequence[int], *, tp_rank: int = 0,
          cp_rank: int = 0, pp_rank: int = 0, vp_stage: int = 0, format: str = "thd",
          cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
          seq_length: int | None = None, device: torch.device | str | None = None,
          layer_ids: Sequence[int] | None = None) -> ShardedTargets:
    """Targets of rank (tp_rank, cp_rank, pp_rank, vp_stage) for the micro-batch ``batch``.

    Only this stage's layers are selected from the compact batch, then widened to int64 (on
    ``device``). ``layer_ids`` overrides the stage's MoE layers (the driver passes the layers of
    the routers it actually found).
    """
    routes = HandedRoutes.from_batch(batch)
    lens = int64_tensor(seq_lens, "seq_lens", CoverageError)
    tp_rank, cp_rank, pp_rank, vp_stage, layer_ids, dev = checked_rank_args(
        tp_rank, cp_rank, pp_rank, vp_stage, layer_ids, device, what="shard")
    # RankRows.cover checks the batch's rows against seq_lens (once)
    rows = RankRows.build(layout, lens, tp_rank=tp_rank, cp_rank=cp_rank, format=format,
                          cu_seqlens_padded=cu_seqlens_padded, seq_length=seq_length).cover(routes)
    want = list(layout.moe_layers(pp_rank, vp_stage) if layer_ids is None else layer_ids)
    return read_targets(routes, rows, want, device=dev or batch.routes.device,
                        where=f"rank (pp={pp_rank}, vp={vp_stage})", model_layers=layout.moe_layer_ids)


def rank_targets(items: Sequence[Any], layout: ParallelLayout, seq_lens: Sequence[int], *, num_experts: int,
                 moe_layer_ids: Sequence[int] | None = None, start_rows: Sequence[int] | None = None,
                 tp_rank: int = 0, cp_rank: int = 0, pp_rank: int = 0, vp_stage: int = 0, format: str = "thd",
                 cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None, seq_length: int | None = None,
                 device: torch.device | str | None = None, layer_ids: Sequence[int] | None = None,
                 weights: Sequence[Any] | None = None, degenerate: str = "refuse") -> ShardedTargets:
    """Targets of rank (tp_rank, cp_rank, pp_rank, vp_stage) straight from the micro-batch's vLLM
    routes ``items`` (:meth:`HandedRoutes.from_engine`): equals ``shard(ReplayBatch.from_vllm(items,
    ...), ...)`` but reads only this rank's stage layers and CP / SP rows (~1/30 of the ids at
    TP4 x CP2 x PP4), and checks what it reads (a bad id elsewhere raises on the rank that reads
    it, with the same message)."""
    tp_rank, cp_rank, pp_rank, vp_stage, layer_ids, dev = checked_rank_args(
        tp_rank, cp_rank, pp_rank, vp_stage, layer_ids, device, what="rank_targets")
    routes = HandedRoutes.from_engine(items, num_experts=num_experts, moe_layer_ids=moe_layer_ids,
                                      start_rows=start_rows, weights=weights)
    lens = as_index_list(seq_lens, what="seq_lens", error=CoverageError)
    rows = RankRows.build(layout, lens, tp_rank=tp_rank, cp_rank=cp_rank, format=format,
                          cu_seqlens_padded=cu_seqlens_padded, seq_length=seq_length).cover(routes)
    want = list(layout.moe_layers(pp_rank, vp_stage) if layer_ids is None else layer_ids)
    return read_targets(routes, rows, want, device=dev or torch.device("cpu"), degenerate=degenerate,
                        where=f"rank (pp={pp_rank}, vp={vp_stage})", model_layers=layout.moe_layer_ids)


def checked_rank_args(tp_rank: Any, cp_rank: Any, pp_rank: Any, vp_stage: Any, layer_ids: Any,
                      device: Any, *, what: str) -> tuple[int, int, int, int, Optional[list[int]], Optional[torch.device]]:
    """The rank, layer and device arguments every entry (``shard``, ``rank_targets``, the driver)
    takes, converted once."""
    tp_rank, cp_rank, pp_rank, vp_stage = (as_index(v, what=name, error=LayoutError) for v, name in (
        (tp_rank, "tp_rank"), (cp_rank, "cp_rank"), (pp_rank, "pp_rank"), (vp_stage, "vp_stage")))
    if layer_ids is not None:
        layer_ids = as_index_list(layer_ids, what="layer_ids", error=LayerMappingError)
    dev = None if device is None else torch.device(device)
    if dev is not None and dev.type == "meta":
        raise LayoutError(f"{what}: device='meta' would hold no values (targets must be readable)")
    return tp_rank, cp_rank, pp_rank, vp_stage, layer_ids, dev

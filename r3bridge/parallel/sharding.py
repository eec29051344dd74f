"""``shard``: one rank's R3 replay targets (:class:`ShardedTargets`) of a micro-batch's routes,
rows in the order that rank's routers see them.

A validated :class:`r3bridge.ReplayBatch` read by the one reader (:mod:`r3bridge.ingest.reader`): the
pack plan and this rank's row map (``packing.py``), the stage's layer columns gathered narrow and
widened to int64 last. Everything is vectorised: no Python loop over tokens, rows or sequences.
"""
from __future__ import annotations

from typing import Sequence

import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.errors import CoverageError
from r3bridge.ingest.reader import HandedRoutes, RankRows, ShardedTargets, checked_rank_args, read_targets
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.packing import int64_tensor

__all__ = ["ShardedTargets", "shard"]


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
    batch.check_seq_lens(lens)
    rows = RankRows.build(layout, lens, tp_rank=tp_rank, cp_rank=cp_rank, format=format,
                          cu_seqlens_padded=cu_seqlens_padded, seq_length=seq_length).cover(routes)
    want = list(layout.moe_layers(pp_rank, vp_stage) if layer_ids is None else layer_ids)
    return read_targets(routes, rows, want, device=dev or batch.routes.device,
                        where=f"rank (pp={pp_rank}, vp={vp_stage})", model_layers=layout.moe_layer_ids)

"""Trainer side: madeup_framework's training batch <-> ReplayBatch, in the canonical form
(:mod:`r3bridge.batch.canonical`).

madeup_framework's batch: ``tokens`` / ``mask`` ``[B, S]`` left-padded, ``routes`` a per-sample list
of ``{layer_number: [rows, K]}`` (MoE layers only, 1-based numbers, rows from the first token;
``None`` for a sample whose engine calls were all aborted), and, after R2's compute_log_prob, the
recorded routes ``RECORDED_KEY`` ``[B, S, L_moe, K]`` with :data:`r3bridge.NO_ROUTE` where a token has
none. r3bridge's layer ids are 0-based: the framework's numbers minus :data:`LAYER_BASE`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge.batch.canonical import drop_final_invalid_rows
from r3bridge.batch.dense import NO_ROUTE, padded_routes
from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.engines.layer_ids import layers_from_mapping
from r3bridge.errors import CoverageError

__all__ = ["ROUTES_KEY", "RECORDED_KEY", "SAMPLE_KEY", "MadeupfwCodec"]

ROUTES_KEY = "routes"                        # madeup_framework's rollout routes, per sample
RECORDED_KEY = "r3bridge_recorded"           # R2: the trainer's own routes, MoE layers only, NO_ROUTE elsewhere
SAMPLE_KEY = "r3bridge_sample"               # [B] batch-level sample index (R2 record pass)


class MadeupfwCodec:
    """The :class:`r3bridge.protocols.BatchCodec` of madeup_framework."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: int, topk: int) -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]
        self.num_hidden_layers = int(num_hidden_layers)
        self.topk = int(topk)

    def to_replay_batch(self, native: dict, *, route_kind: str = "rollout") -> ReplayBatch:
        """The routes the batch carries, one sequence per sample, in batch order."""
        mask = torch.as_tensor(native["mask"]).bool()
        if route_kind == "recorded":
            recorded = native.get(RECORDED_KEY)
            if recorded is None:
                raise CoverageError(f"the batch has no {RECORDED_KEY!r}: R2 routes were not written back")
            valid = (recorded != NO_ROUTE).flatten(-2).any(-1)
            return ReplayBatch.from_padded(recorded, mask, num_experts=self.num_experts, layer_ids=self.moe_layer_ids,
                                           valid=valid, route_kind="recorded")
        per_sample = native.get(ROUTES_KEY)
        if per_sample is None:
            raise CoverageError(f"the batch has no {ROUTES_KEY!r}: did the engine return routes?")
        from madeup_framework import LAYER_BASE  # the framework, imported lazily

        b, s = mask.shape
        dense = torch.zeros(b, s, len(self.moe_layer_ids), self.topk, dtype=route_dtype(self.num_experts))
        valid = torch.zeros(b, s, dtype=torch.bool)
        lens = mask.sum(-1).tolist()
        for i, routes in enumerate(per_sample):
            if routes is None:                  # every call aborted: no row, the model's top-k
                continue
            rows = layers_from_mapping({int(k) - LAYER_BASE: v for k, v in routes.items()}, self.moe_layer_ids,
                                       field=f"sample {i}", topk=self.topk)
            start = s - int(lens[i])            # left padding: the sample's first token
            dense[i, start:start + rows.shape[0]] = torch.from_numpy(rows.astype("int64")).to(dense.dtype)
            valid[i, start:start + rows.shape[0]] = True
        batch = ReplayBatch.from_padded(dense, mask, num_experts=self.num_experts, layer_ids=self.moe_layer_ids,
                                        valid=valid, route_kind="rollout")
        return drop_final_invalid_rows(batch)

    def write_recorded(self, native: dict, recorded: ReplayBatch) -> dict:
        """R2: the recorded routes placed on each sample's tokens, :data:`r3bridge.NO_ROUTE` elsewhere."""
        mask = torch.as_tensor(native["mask"]).bool().cpu()
        if recorded.num_seqs != mask.shape[0] or any(x != 0 for x in recorded.start_rows):
            raise CoverageError(f"{recorded.num_seqs} recorded sequences for a batch of {mask.shape[0]} "
                                f"(start 0 expected)")
        native[RECORDED_KEY] = padded_routes(recorded, mask, no_route=NO_ROUTE, dtype=torch.int16)
        return native

    def seq_lens(self, native: dict) -> list[int]:
        return torch.as_tensor(native["mask"]).sum(-1).long().tolist()

    def split(self, native: dict, num_parts: int, order: Optional[list[int]] = None) -> list[tuple[Any, list[int]]]:
        """madeup_framework's own mini-batching."""
        from madeup_framework import split

        return split(native, num_parts, order)

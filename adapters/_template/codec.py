"""Trainer side: the training batch <-> ReplayBatch, in the canonical form (:mod:`r3bridge.canonical`).

The toy framework's batch (your framework: its own batch object): a dict of right- or
left-padded tensors, ``attention_mask`` ``[B, S]``, rollout routes ``ROUTES_KEY``
``[B, S, num_hidden_layers, K]`` with ``VALID_KEY`` ``[B, S]`` (False where the engine returned
no route: never infer it from zeros or lengths) and, after R2's compute_log_prob, the recorded
routes ``RECORDED_KEY`` ``[B, S, L_moe, K]`` + ``RECORDED_VALID_KEY``. Routes must travel *per
sample*, in fields the framework moves with its samples through every split (check which of its
utilities move which fields).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge.canonical import drop_final_invalid_rows, moe_layers_of
from r3bridge.errors import CoverageError
from r3bridge.schema import ReplayBatch, route_dtype

__all__ = ["ROUTES_KEY", "VALID_KEY", "RECORDED_KEY", "RECORDED_VALID_KEY", "SAMPLE_KEY", "TemplateCodec"]

ROUTES_KEY = "routed_experts"            # rollout routes, every decoder layer
VALID_KEY = "routed_valid"
RECORDED_KEY = "r3bridge_recorded"       # R2: the trainer's own routes, MoE layers only
RECORDED_VALID_KEY = "r3bridge_recorded_valid"
SAMPLE_KEY = "r3bridge_sample"           # [B] batch-level sample index (R2 record pass)


class TemplateCodec:
    """The :class:`r3bridge.protocols.BatchCodec`; the conformance suite calls exactly these four."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: int) -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]
        self.num_hidden_layers = int(num_hidden_layers)

    def to_replay_batch(self, native: dict, *, source: str = "rollout") -> ReplayBatch:
        """The routes the batch carries, one sequence per sample, in batch order."""
        attn = native["attention_mask"]
        if source == "recorded":
            if native.get(RECORDED_KEY) is None:
                raise CoverageError(f"the batch has no {RECORDED_KEY!r}: R2 routes were not written back")
            return ReplayBatch.from_padded(native[RECORDED_KEY], attn, num_experts=self.num_experts,
                               layer_ids=self.moe_layer_ids, valid=native[RECORDED_VALID_KEY], source="recorded")
        routes = native.get(ROUTES_KEY)
        if routes is None:
            raise CoverageError(f"the batch has no {ROUTES_KEY!r}: did the engine return routes?")
        # the engine reports every decoder layer: keep the MoE ones, by id
        sel = moe_layers_of(torch.as_tensor(routes), self.moe_layer_ids, layer_dim=2,
                            num_hidden_layers=self.num_hidden_layers, field=ROUTES_KEY)
        rb = ReplayBatch.from_padded(sel, attn, num_experts=self.num_experts, layer_ids=self.moe_layer_ids,
                         valid=native[VALID_KEY], source="rollout")
        return drop_final_invalid_rows(rb)

    def write_recorded(self, native: dict, recorded: ReplayBatch) -> dict:
        """R2: the recorded routes (batch order, start 0) placed on each sample's real tokens."""
        attn = torch.as_tensor(native["attention_mask"]).bool().cpu()
        b, s = attn.shape
        if recorded.num_seqs != b or any(x != 0 for x in recorded.start_rows):
            raise CoverageError(f"{recorded.num_seqs} recorded sequences for a batch of {b} (start 0 expected)")
        out = torch.zeros(b, s, recorded.num_layers, recorded.topk, dtype=route_dtype(self.num_experts))
        valid = torch.zeros(b, s, dtype=torch.bool)
        for i in range(b):
            cols = attn[i].nonzero().flatten()
            r, v = recorded.sequence(i)
            if r.shape[0] > cols.numel():
                raise CoverageError(f"sample {i}: {r.shape[0]} recorded rows for {cols.numel()} tokens")
            out[i, cols[: r.shape[0]]] = r.cpu().to(out.dtype)
            valid[i, cols[: r.shape[0]]] = v.cpu()
        native[RECORDED_KEY], native[RECORDED_VALID_KEY] = out, valid
        return native

    def seq_lens(self, native: dict) -> list[int]:
        return torch.as_tensor(native["attention_mask"]).sum(-1).long().tolist()

    def split(self, native: dict, num_parts: int, order: Optional[list[int]] = None) -> list[tuple[Any, list[int]]]:
        """Your framework's own partitioning function (never a re-implementation), reporting the
        samples of each part. The toy framework: ``order`` applied, then contiguous chunks."""
        b = int(native["attention_mask"].shape[0])
        idx = list(range(b)) if order is None else [int(i) for i in order]
        size = -(-b // num_parts)
        parts = []
        for lo in range(0, b, size):
            ids = idx[lo:lo + size]
            t = torch.tensor(ids)
            parts.append(({k: (v[t] if isinstance(v, torch.Tensor) else v) for k, v in native.items()}, ids))
        return parts

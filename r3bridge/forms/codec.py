"""A :class:`~r3bridge.protocols.BatchCodec`'s shared half: the model's shape, and the whole batch
read by the same rules as each micro-batch.

An adapter's codec views its framework's batch as :class:`r3bridge.parallel.handed.HandedRoutes` (what the
hook installs, micro-batch by micro-batch); :class:`HandedCodec` turns that into
``to_replay_batch`` (the reader's whole-batch form: R2 write-backs, the conformance checks), so
there is one path from a framework's field to routes. A subclass writes ``handed_routes``,
``write_recorded`` and ``split`` (the framework's own partitioning), and ``seq_lens`` where its
batch has no ``[B, S]`` ``attention_mask``.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from r3bridge.batch.schema import ReplayBatch
from r3bridge.parallel.handed import HandedRoutes

__all__ = ["HandedCodec"]


class HandedCodec:
    """``num_experts``, ``moe_layer_ids`` (0-based global), ``num_hidden_layers`` (the engine's
    layer axis), ``topk`` (the model's: routes of another width are refused); ``invalid_rows``:
    ``"error"`` refuses a row without a route in the whole batch (``HandedRoutes.to_batch``)."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: Optional[int] = None,
                 topk: Optional[int] = None, invalid_rows: str = "native") -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]
        self.num_hidden_layers = None if num_hidden_layers is None else int(num_hidden_layers)
        self.topk = None if topk is None else int(topk)
        self.invalid_rows = invalid_rows

    def handed_routes(self, native: Any, *, route_kind: str = "rollout") -> HandedRoutes:
        """The routes ``native`` carries, as the one reader reads them (nothing copied or checked)."""
        raise NotImplementedError

    def seq_lens(self, native: Any) -> list[int]:
        """Tokens per sample: the ones of the batch's padded ``[B, S]`` ``attention_mask`` (its
        padding on either side)."""
        return native["attention_mask"].sum(-1).long().tolist()

    def to_replay_batch(self, native: Any, *, route_kind: str = "rollout") -> ReplayBatch:
        """The routes ``native`` carries, one sequence per sample, in batch order (canonical form)."""
        return self.handed_routes(native, route_kind=route_kind).to_batch(invalid_rows=self.invalid_rows)

"""Trainer side: the training batch <-> ReplayBatch, in the canonical form (:mod:`r3bridge.batch.canonical`).

The toy framework's batch (your framework: its own batch object): a dict of padded tensors (left,
right or both), ``attention_mask`` ``[B, S]``, rollout routes ``ROUTES_KEY``
``[B, S, num_hidden_layers, K]`` and, after R2's compute_log_prob, the recorded routes
``RECORDED_KEY`` ``[B, S, L_moe, K]``. Routes must travel *per sample*, in fields the framework
moves with its samples through every split (check which of its utilities move which fields).

**Layer ids are 0-based global** (HF config index, Megatron ``layer_number - 1``): the layer axis
of ``ROUTES_KEY`` is the engine's, every decoder layer, and ``moe_layer_ids`` picks the MoE ones
by id. A framework that keys routes by layer (a dict) uses :func:`r3bridge.engines.layer_ids.layers_from_mapping`,
which says so when its keys are 1-based.

**Aborted samples.** An engine call that was aborted returns no routes (vLLM: ``routed_experts``
is ``None``); its sample still trains, every row invalid (routed natively, counted in coverage).
Top-k comes from the model (``topk``, the HF config's ``num_experts_per_tok``), never from the
samples: a micro-batch whose samples were all aborted has no route to read it from.

**"No route" is said explicitly.** One rule, the same in docs/porting.md and the reader
(docs/architecture.md, "One reader"): a row the engine did not route is marked by a validity field
(``VALID_KEY``) or by an in-band value no expert id takes (``RECORDED_KEY`` holds
:data:`r3bridge.NO_ROUTE` there: :func:`r3bridge.padded_routes` writes it); never inferred from
lengths. Only a transport with neither (it writes "no route" as an all-zero row: verl's,
SkyRL 0.3's) is read with ``no_route="zero"``: rows past a sample's last non-zero row have no
route, a zero row before it is a degenerate route (vLLM #54730), refused: set ``VALID_KEY = None``. Never write ``ReplayBatch.sequence(i)`` into a field as it is: its
invalid rows hold filler ids ``0..K-1`` that look like routes (``padded_routes`` /
:func:`r3bridge.dense_routes` write ``no_route`` there instead).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge.batch.dense import NO_ROUTE, padded_routes
from r3bridge.batch.schema import ReplayBatch
from r3bridge.engines.layer_axis import axis_columns
from r3bridge.errors import CoverageError, RouteShapeError
from r3bridge.hf import ModelInfo
from r3bridge.parallel.handed import HandedRoutes

__all__ = ["ROUTES_KEY", "VALID_KEY", "RECORDED_KEY", "SAMPLE_KEY", "TemplateCodec"]

ROUTES_KEY = "routed_experts"                # rollout routes, every decoder layer (your framework's field)
VALID_KEY: Optional[str] = "routed_valid"    # [B, S] bool; None: the transport writes "no route" as zero rows
RECORDED_KEY = "r3bridge_recorded"           # R2: the trainer's own routes, MoE layers only, NO_ROUTE elsewhere
SAMPLE_KEY = "r3bridge_sample"               # [B] batch-level sample index (R2 record pass)


class TemplateCodec:
    """The :class:`r3bridge.protocols.BatchCodec`; the conformance suite calls exactly these four."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: int, topk: int) -> None:
        """The model's shape (``r3bridge.hf.ModelInfo.from_hf_config``): expert count, MoE layers
        (0-based global ids), decoder layer count, top-k."""
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]
        self.num_hidden_layers = int(num_hidden_layers)
        self.topk = int(topk)

    def model_info(self) -> ModelInfo:
        """The model the routes are read for (your adapter: ``ModelInfo.from_hf_config(hf_config)``)."""
        return ModelInfo(num_experts=self.num_experts, moe_layer_ids=self.moe_layer_ids,
                         num_layers=self.num_hidden_layers, topk=self.topk)

    def handed_routes(self, native: dict, *, route_kind: str = "rollout") -> HandedRoutes:
        """The routes the batch carries, as the one reader reads them (docs/architecture.md, "One reader"): the
        framework's own tensors viewed, nothing copied or checked here. The hook installs these."""
        attn = native["attention_mask"]
        if route_kind == "recorded":
            recorded = native.get(RECORDED_KEY)
            if recorded is None:
                raise CoverageError(f"the batch has no {RECORDED_KEY!r}: R2 routes were not written back")
            valid = (torch.as_tensor(recorded) != NO_ROUTE).flatten(-2).any(-1)
            return HandedRoutes.from_padded(recorded, attn, num_experts=self.num_experts, layer_ids=self.moe_layer_ids,
                                            no_route="mask", valid=valid, route_kind="recorded")
        routes = native.get(ROUTES_KEY)
        if routes is None:
            raise CoverageError(f"the batch has no {ROUTES_KEY!r}: did the engine return routes?")
        if int(routes.shape[-1]) != self.topk:      # the model's top-k, whatever the samples hold
            raise RouteShapeError(f"{ROUTES_KEY} carries {int(routes.shape[-1])} expert ids per token and layer, "
                                  f"the model routes top-{self.topk}")
        # the engine reports every decoder layer: keep the MoE ones, by id
        cols = axis_columns(int(torch.as_tensor(routes).shape[2]), layer_axis=None, moe_layer_ids=self.moe_layer_ids,
                            num_hidden_layers=self.num_hidden_layers, field=ROUTES_KEY)
        if VALID_KEY is None:       # "no route" written as zero rows: the reader's captured-range rule
            return HandedRoutes.from_padded(routes, attn, num_experts=self.num_experts, layer_ids=self.moe_layer_ids,
                                            columns=cols, no_route="zero", route_kind="rollout")
        return HandedRoutes.from_padded(routes, attn, num_experts=self.num_experts, layer_ids=self.moe_layer_ids,
                                        columns=cols, no_route="mask", valid=native[VALID_KEY], route_kind="rollout")

    def to_replay_batch(self, native: dict, *, route_kind: str = "rollout") -> ReplayBatch:
        """The routes the batch carries, one sequence per sample, in batch order (the reader's
        whole-batch form of :meth:`handed_routes`)."""
        return self.handed_routes(native, route_kind=route_kind).to_batch(drop_final_invalid=route_kind != "recorded")

    def write_recorded(self, native: dict, recorded: ReplayBatch) -> dict:
        """R2: the recorded routes (batch order, start 0) placed on each sample's tokens,
        :data:`r3bridge.NO_ROUTE` on tokens without a route and on padding."""
        attn = torch.as_tensor(native["attention_mask"]).bool().cpu()
        if recorded.num_seqs != attn.shape[0] or any(x != 0 for x in recorded.start_rows):
            raise CoverageError(f"{recorded.num_seqs} recorded sequences for a batch of {attn.shape[0]} "
                                f"(start 0 expected)")
        native[RECORDED_KEY] = padded_routes(recorded, attn, no_route=NO_ROUTE, dtype=torch.int16)
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

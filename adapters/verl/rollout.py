"""verl's rollout side: the engine's per-call routes of each sample -> what verl's agent loop
carries.

verl 0.9's agent loop takes each sample's ``routed_experts`` array (``[rows, num_hidden_layers,
K]``, every decoder layer) from its vLLM / SGLang server and places it from the prompt start in
the padded batch; its multi-turn tool loop keeps only the last call's
(``experimental/agent_loop/tool_agent_loop.py:286``), whose rows for earlier turns' tokens are
the re-prefill's routes, not the ones that sampled them. r3bridge stitches the calls first-seen
instead (the rows that sampled each token): :class:`VerlRollout` does that for a batch
(:func:`r3bridge.ingest.stitching.rollout_routes`) and for one agent-loop sample
(:meth:`VerlRollout.agent_loop_routes`, used by
:class:`r3bridge.adapters.verl.agent_loop.FirstSeenToolAgentLoop`).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from r3bridge.batch.provenance import RouteProvenance, reported_int
from r3bridge.batch.schema import ReplayBatch
from r3bridge.errors import ProvenanceError, RouteShapeError
from r3bridge.ingest.stitching import StitchReport, first_seen_rows, rollout_routes

__all__ = ["VerlRollout", "call_provenance"]


class VerlRollout:
    """The :class:`r3bridge.protocols.RolloutIngest` of verl's agent loop."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: int,
                 topk: int | None = None) -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]
        self.num_hidden_layers = int(num_hidden_layers)
        self.topk = None if topk is None else int(topk)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "VerlRollout":
        from r3bridge.hf import ModelInfo

        info = ModelInfo.from_hf_config(hf_config)
        return cls(num_experts=info.num_experts, moe_layer_ids=info.moe_layer_ids, num_hidden_layers=info.num_layers,
                   topk=info.topk)

    def routes_from_rollout(self, engine_outputs: Sequence[Sequence[Any]]) -> ReplayBatch:
        """``engine_outputs[i]``: sample ``i``'s engine calls (vLLM arrays, ``.npy`` base64, nested
        lists), each from row 0 -> one first-seen sequence per sample, MoE layers."""
        return rollout_routes(engine_outputs, num_experts=self.num_experts, moe_layer_ids=self.moe_layer_ids)

    def agent_loop_routes(self, calls: Sequence[Any], *, sample: str = "") -> tuple[np.ndarray, StitchReport]:
        """One agent-loop sample's server calls (each ``TokenOutput.routed_experts``: ``[rows,
        num_hidden_layers, K]`` from row 0 of that call's prompt) -> the first-seen rows in verl's
        own transport (same shape and dtype, every decoder layer) and the stitch report (rows a
        later call re-prefilled, and how many of those routed differently)."""
        where = f"sample {sample}: " if sample else ""
        for t, c in enumerate(calls):
            shape = np.shape(c)
            if len(shape) != 3 or shape[1] != self.num_hidden_layers:
                raise RouteShapeError(f"{where}server call {t} returned routed_experts of shape {list(shape)}; "
                                      f"expected [rows, num_hidden_layers={self.num_hidden_layers}, topk]")
            if self.topk is not None and shape[2] != self.topk:
                raise RouteShapeError(f"{where}server call {t} returned routed_experts with top-k {shape[2]}, "
                                      f"the model routes top-{self.topk} (num_experts_per_tok)")
        return first_seen_rows(calls)


def call_provenance(outputs: Sequence[Any], *, engine: str, request_id: str = "",
                    attempts: Sequence[int] | None = None) -> tuple[RouteProvenance, RouteProvenance]:
    """One sample's server calls (verl ``TokenOutput``s, in call order) -> (where its routes came
    from, where its log-probs came from).

    First-seen stitching keeps the first call's rows for the earliest tokens, so the routes are the
    first call's pass: weight version its ``extra_fields["global_steps"]`` (the server's when the
    call returned: the weights of its last prefill), epoch its ``num_preempted`` (each vLLM
    preemption re-prefills the request and returns the re-prefill's routes; vLLM #39917; ``None``
    or -1: not reported). The first tokens' log-probs were sampled in the first pass: epoch 0,
    weight version ``min_global_steps`` (verl's resuming client: the first attempt's), else the
    call's ``global_steps``. ``attempts`` (one per call, the capture's numbering): the routes are
    the first call's attempt, the log-probs (and tokens) the last call's; ``None``: unknown."""
    if not outputs:
        raise ProvenanceError(f"sample {request_id or '?'}: no server call to take provenance from")
    if attempts is not None and len(attempts) != len(outputs):
        raise ProvenanceError(f"sample {request_id or '?'}: {len(attempts)} attempts for {len(outputs)} server calls")
    first = outputs[0]
    extra = getattr(first, "extra_fields", None) or {}
    version = reported_int(extra.get("global_steps"))
    sampled = reported_int(extra.get("min_global_steps"))
    routes = RouteProvenance(engine, str(request_id), version, reported_int(getattr(first, "num_preempted", None)),
                             None if attempts is None else attempts[0])
    logprobs = RouteProvenance(engine, str(request_id), version if sampled is None else sampled, 0,
                               None if attempts is None else attempts[-1])
    return routes, logprobs


"""Template: r3bridge for <YourFramework>. Copy this folder to ``adapters/<yourframework>/``.

Porting a framework = this one file (a few hundred lines at most) + passing
``r3bridge.testing.conformance`` (see docs/porting.md). Rules:

* import ``r3bridge`` only, never another adapter, and import the framework lazily;
* subclass or wrap the framework's classes; never monkey-patch a class or module attribute;
* never infer anything from a length: layer ids, coverage and validity are explicit fields;
* every problem raises a ``r3bridge.ReplayError`` subclass (ConfigError for set-up problems);
* the reference model never replays; R2 updates replay only routes with ``source="recorded"``.

The three parts of :mod:`r3bridge.protocols`, in the order data flows:
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge.config import Action, Phase, ReplayConfig, ReplayMode   # noqa: F401
from r3bridge.errors import ConfigError                               # noqa: F401
from r3bridge.ingest import stitch                                   # noqa: F401
from r3bridge.protocols import MicroBatchTargets, canonical_form, install_before_forward  # noqa: F401
from r3bridge.schema import ReplayBatch

ROUTES_KEY = "routed_experts"   # the field your framework's batch carries routes in (or a new one)


# ----------------------------------------------------------------------------- 1. RolloutIngest
def routes_from_rollout(calls_per_sample: Sequence[Sequence[Any]], *, num_experts: int,
                        moe_layer_ids: Sequence[int]) -> ReplayBatch:
    """Engine outputs of each sample -> ReplayBatch (source "rollout").

    * vLLM arrays: ``ReplayBatch.from_vllm([arr], num_experts=..., moe_layer_ids=..., start_rows=[s])``;
      SGLang meta_info: ``ReplayBatch.from_sglang([mi], num_experts=..., num_layers=..., topk=...,
      moe_layer_ids=...)`` (engines report every layer; ``moe_layer_ids`` drops the dense ones);
    * one piece per engine call (multi-turn turns, resubmitted attempts), each with its start row;
      ``r3bridge.stitch(pieces)`` keeps first-seen rows and raises on gaps. Never concatenate.
    """
    raise NotImplementedError("build one piece per call, stitch, ReplayBatch.concat over samples")


# ----------------------------------------------------------------------------- 2. BatchCodec
class TemplateCodec:
    """Your training batch <-> ReplayBatch. The conformance suite calls exactly these four."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_hidden_layers: int) -> None:
        self.num_experts, self.moe_layer_ids, self.num_hidden_layers = num_experts, list(moe_layer_ids), num_hidden_layers

    def to_replay_batch(self, native: Any, *, source: str = "rollout") -> ReplayBatch:
        # Padded [B, S, L, K] + mask: ReplayBatch.from_padded(routes[:, :, moe], mask, valid=...) then
        # r3bridge.protocols.drop_final_invalid_rows (rollout only). Per-sample arrays shorter than
        # the trajectory: canonical_form(rb, seq_lens). Result: canonical form (protocols docstring).
        raise NotImplementedError

    def write_recorded(self, native: Any, recorded: ReplayBatch) -> Any:
        # R2: store per sample, in a field the framework splits *with its samples* (check which of
        # its utilities move which fields: AReaL only splits tensors of B*S elements, SkyRL copies
        # only known keys into micro-batches). Mark the batch so updates know the routes are recorded.
        raise NotImplementedError

    def seq_lens(self, native: Any) -> list[int]:
        raise NotImplementedError

    def split(self, native: Any, num_parts: int) -> list[tuple[Any, list[int]]]:
        # The framework's own partitioning function (not a re-implementation), reporting sample ids.
        raise NotImplementedError


# ----------------------------------------------------------------------------- 3. MicroBatchHook
class TemplateEngineMixin:
    """``class MyEngine(TemplateEngineMixin, FrameworkMegatronEngine)``.

    Where to hook: the framework method that calls megatron's ``forward_backward_func`` once per
    mini-batch (or log-prob pass). Around it: ``with replayer.step(plan.action, forward_only=...,
    source=plan.source) as step:``. Per (chunk, micro-batch), right before the chunk's forward:
    ``step.install(model, routes, seq_lens, cu_seqlens_padded=..., sample_ids=...)``:

    * if the framework's ``forward_step`` is an overridable method (verl): override it, install,
      then call the original with the same micro-batch;
    * if it is a closure (SkyRL, AReaL): ``with install_before_forward(step, chunks, targets, M):``
      around the framework call; ``targets(chunk, k, args, kwargs)`` returns micro-batch ``k``'s
      ``MicroBatchTargets`` (read the real packing from ``kwargs["packed_seq_params"]``).
    """

    r3_config: Optional[ReplayConfig] = None
    r3_phase: Optional[Phase] = None          # set by your actor around compute_log_prob / update

    def attach_replay(self, chunks: list[torch.nn.Module]) -> None:
        from r3bridge.megatron import Replayer
        self.r3_chunks = list(chunks)
        self.r3_replayer = Replayer.from_config(self.r3_chunks, ReplayConfig.resolve(self.r3_config))  # finds routers per chunk, runs the guards, attaches hooks

    def run_mini_batch(self, micro_batches: list, call) -> Any:
        plan = self.r3_config.plan(self.r3_phase) if self.r3_phase is not None else None
        if plan is None or plan.action is Action.NATIVE:
            return call(micro_batches)                      # reference model, replay off
        routes = [self.codec.to_replay_batch(mb, source=plan.source) if plan.action is Action.REPLAY else None
                  for mb in micro_batches]

        def targets(c: int, k: int, args: tuple, kwargs: dict) -> MicroBatchTargets:
            psp = kwargs.get("packed_seq_params")
            return MicroBatchTargets(routes=routes[k], seq_lens=self.codec.seq_lens(micro_batches[k]),
                                     cu_seqlens_padded=None if psp is None else psp.cu_seqlens_q_padded,
                                     sample_ids=None)      # RECORD: the batch-level sample index per sequence
        forward_only = self.r3_phase is not Phase.UPDATE
        with self.r3_replayer.step(plan.action, forward_only=forward_only, source=plan.source) as step:
            with install_before_forward(step, self.r3_chunks, targets, len(micro_batches)):
                out = call(micro_batches)
        # step.metrics -> your logger; RECORD: step.recorded (sorted by sample_ids) -> write_recorded
        return out

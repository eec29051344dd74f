"""The per-micro-batch hook: your framework's engine, subclassed (never patched).

Where to hook: the framework method that calls Megatron's ``forward_backward_func`` once per
mini-batch (or log-prob pass); here ``forward_backward(micro_batches, forward_only)``. Run it
inside :meth:`r3bridge.session.PhaseRunner.run`, which owns the phase: plan (replay off and the
reference model run untouched), the driver step, the install of every (chunk, micro-batch) right
before the chunk's forward, padding sequences, metrics and R2's recorded routes. The adapter
supplies one :class:`r3bridge.megatron.MicroBatch` per micro-batch:

* ``forward_step`` is an overridable method (verl): override it and call
  ``PhaseStep.install(model, MicroBatch(...))`` before the original;
* ``forward_step`` is a closure (SkyRL, AReaL, this toy): pass ``targets`` to ``run``; a callable
  ``(chunk, k, args, kwargs) -> MicroBatch`` reads the trainer's real packing from
  ``kwargs["packed_seq_params"]`` (never re-derive it).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.config import Action, Phase, ReplayConfig
from r3bridge.errors import ConfigError
from r3bridge.megatron import MicroBatch
from r3bridge.session import PhaseResult, PhaseRunner

from .codec import RECORDED_KEY, ROUTES_KEY, SAMPLE_KEY, MadeupfwCodec
from .config import replay_config

__all__ = ["MadeupfwEngineMixin"]

# your framework's setting that supplies the routes of each route kind (named in the error)
_PROVIDE = {"rollout": "madeup_framework's engine reports routes per call (Completion.routes)",
            "recorded": "R2 routes are written back after compute_log_prob (MadeupfwCodec.write_recorded)"}


class MadeupfwEngineMixin:
    """``class MyEngine(MadeupfwEngineMixin, FrameworkMegatronEngine)``. The framework engine
    provides ``forward_backward(micro_batches, forward_only)``; its micro-batches are dicts in the
    codec's format. Your actor sets ``r3_phase`` around compute_log_prob / update."""

    r3_config: Optional[ReplayConfig] = None
    r3_phase: Optional[Phase] = None
    r3_runner: Optional[PhaseRunner] = None
    r3_result: Optional[PhaseResult] = None     # the last phase's metrics and recorded routes

    def r3_attach(self, chunks: Sequence[torch.nn.Module], codec: MadeupfwCodec, layout: Any = None) -> None:
        """After the framework built its model chunks: find the routers, run the guards, attach."""
        from r3bridge.megatron import Replayer

        self.r3_config = replay_config(self.r3_config)
        self.r3_codec = codec
        self.r3_chunks = list(chunks)
        # expect_moe_layer_ids: routes indexed by the HF config's MoE layers must be the model's
        replayer = None if self.r3_config.plan(Phase.UPDATE).action is Action.NATIVE else \
            Replayer.from_config(self.r3_chunks, self.r3_config, layout, expect_moe_layer_ids=codec.moe_layer_ids)
        self.r3_runner = PhaseRunner(replayer, self.r3_config, framework="madeupfw")

    def forward_backward(self, micro_batches: list[dict], forward_only: bool = False) -> Any:
        plan = None if self.r3_runner is None or self.r3_phase is None else self.r3_runner.plan(self.r3_phase)
        if plan is None:
            return super().forward_backward(micro_batches, forward_only)
        mbs = [self._r3_micro_batch(k, mb, plan) for k, mb in enumerate(micro_batches)]

        def targets(c: int, k: int, args: tuple, kwargs: dict) -> MicroBatch:
            psp = kwargs.get("packed_seq_params")
            if psp is None:
                raise ConfigError("r3bridge + madeupfw: only packed (THD) micro-batches are wired")
            return dataclasses.replace(mbs[k], cu_seqlens_padded=psp.cu_seqlens_q_padded)

        with self.r3_runner.run(self.r3_phase, forward_only=forward_only, targets=targets, chunks=self.r3_chunks,
                                num_micro_batches=len(mbs)) as ps:
            out = super().forward_backward(micro_batches, forward_only)
        self.r3_result = ps.result      # metrics -> your framework's logger (ps.result.tagged)
        return out

    def _r3_micro_batch(self, k: int, mb: dict, plan) -> MicroBatch:
        seq_lens = self.r3_codec.seq_lens(mb)
        if plan.action is Action.REPLAY:
            key = RECORDED_KEY if plan.route_kind == "recorded" else ROUTES_KEY
            self.r3_runner.check_routes(plan, key in mb, field=key, where=f"micro-batch {k}", provide=_PROVIDE)
            routes: Optional[ReplayBatch] = self.r3_codec.to_replay_batch(mb, route_kind=plan.route_kind)
            return MicroBatch(seq_lens, routes)
        if SAMPLE_KEY not in mb:
            raise ConfigError(f"R2 recording needs {SAMPLE_KEY!r} (the batch-level sample index) in every "
                              f"micro-batch")
        return MicroBatch(seq_lens, sample_ids=mb[SAMPLE_KEY].tolist())

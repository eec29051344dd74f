"""The per-micro-batch hook: your framework's engine, subclassed (never patched).

The driver owns the set-up (:class:`r3bridge.session.AdapterSession`: config resolved and
announced, the Replayer, the role guard, the phase's plan, the driver pass, the per-(chunk,
micro-batch) install, padding sequences, metrics with ``r3bridge/replay_mode``, R2's recorded
routes). The adapter only translates: one :class:`r3bridge.megatron.MicroBatch` per micro-batch.

Where to hook: the framework's phase methods (here ``compute_log_prob`` and ``update``: which
phase a pass is, the batch-level sample index, R2's write-back) and the method that calls
Megatron's ``forward_backward_func`` once per mini-batch (or log-prob pass; here
``forward_backward(micro_batches, forward_only)``). Checks 4-5 run the phase methods, overrides
included (``conformance_tests.py``), never the schedule call directly.

* ``forward_step`` is a closure (SkyRL, AReaL, this toy): pass ``targets`` to ``session.run``
  with ``packing_from_forward=True``: each micro-batch's packing is read from the chunk's forward
  arguments (``packed_seq_params``), never re-derived;
* ``forward_step`` is an overridable method (verl): override it and call
  ``phase_pass.install(model, MicroBatch(...))`` on the pass ``session.run`` yields.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from r3bridge.config import Action, Phase, ReplayConfig
from r3bridge.errors import ConfigError
from r3bridge.megatron import MicroBatch
from r3bridge.parallel.handed import HandedRoutes
from r3bridge.session import AdapterSession

from .codec import RECORDED_KEY, ROUTES_KEY, SAMPLE_KEY, TemplateCodec

__all__ = ["TemplateEngineMixin"]

# your framework's setting that supplies the routes of each kind (named in the error)
_PROVIDE = {"rollout": "<your framework's option that makes the engine return routes>",
            "recorded": "R2 routes are written back after compute_log_prob (TemplateCodec.write_recorded)"}


class TemplateEngineMixin:
    """``class MyEngine(TemplateEngineMixin, FrameworkMegatronEngine)``. The framework engine
    provides its phase methods ``compute_log_prob(batch, groups)`` / ``update(batch, groups)``
    (``groups``: the samples of each micro-batch) that cut ``batch`` into micro-batch dicts in the
    codec's format and call ``forward_backward(micro_batches, forward_only)``."""

    r3_config: Optional[ReplayConfig] = None    # the r3bridge section (None: R3BRIDGE_CONFIG, else off)
    r3: Optional[AdapterSession] = None
    r3_phase: Optional[Phase] = None
    # how this engine's micro-batches carry their routes: the bytes ("inline"); an engine whose
    # micro-batch read resolves route handles (docs/route-handles.md) adds "handles"
    r3_route_transports: tuple[str, ...] = ("inline",)

    def r3_attach(self, chunks: Sequence[torch.nn.Module], codec: TemplateCodec, layout: Any = None) -> None:
        """After the framework built its model chunks: find the routers, run the guards, attach."""
        self.r3 = AdapterSession("template", self.r3_config, where="<YourFramework> engine", provide=_PROVIDE,
                                 route_transports=self.r3_route_transports)
        self.r3_codec = codec
        # routes indexed by the HF config's MoE layers (yours: the model's HF config) must be the model's
        self.r3.attach(chunks, codec.model_info(), layout=layout)

    def compute_log_prob(self, batch: dict, groups: Sequence[Sequence[int]]) -> Any:
        """The compute_log_prob pass: each sample carries its batch-level index through the
        framework's micro-batching (R2 records by it); under R2 the recording is written back into
        ``batch``, in the framework's own transport, for the update to replay."""
        self.r3_phase = Phase.OLD_LOG_PROB
        n = len(batch["input_ids"])
        batch[SAMPLE_KEY] = torch.arange(n)
        try:
            out = super().compute_log_prob(batch, groups)
        finally:
            batch.pop(SAMPLE_KEY, None)
        if self.r3 is not None and self.r3.result is not None and self.r3.result.action is Action.RECORD:
            self.r3_codec.write_recorded(batch, self.r3.recorded_for(n))
        return out

    def update(self, batch: dict, groups: Sequence[Sequence[int]]) -> Any:
        """An update pass: it replays the rollout's routes (R3) or the recording (R2)."""
        self.r3_phase = Phase.UPDATE
        return super().update(batch, groups)

    def forward_backward(self, micro_batches: list[dict], forward_only: bool = False) -> Any:
        plan = None if self.r3 is None or self.r3_phase is None else self.r3.plan(self.r3_phase)
        if plan is None:
            return super().forward_backward(micro_batches, forward_only)
        targets = [self._r3_micro_batch(k, mb, plan) for k, mb in enumerate(micro_batches)]
        with self.r3.run(self.r3_phase, forward_only=forward_only, targets=targets, packing_from_forward=True):
            out = super().forward_backward(micro_batches, forward_only)
        # your framework's logger: self.r3.metrics_to_log(self.r3.result); R2: self.r3.recorded_for(n)
        return out

    def _r3_micro_batch(self, k: int, mb: dict, plan) -> MicroBatch:
        seq_lens = self.r3_codec.seq_lens(mb)
        if plan.action is Action.REPLAY:
            key = RECORDED_KEY if plan.route_kind == "recorded" else ROUTES_KEY
            self.r3.check_routes(plan, key in mb, field=key, where=f"micro-batch {k}")
            # the micro-batch's own tensors viewed: the driver's reader reads this rank's rows once
            routes: Optional[HandedRoutes] = self.r3_codec.handed_routes(mb, route_kind=plan.route_kind)
            return MicroBatch(seq_lens, routes)
        if SAMPLE_KEY not in mb:
            raise ConfigError(f"R2 recording needs {SAMPLE_KEY!r} (the batch-level sample index) in every "
                              f"micro-batch")
        return MicroBatch(seq_lens, sample_ids=mb[SAMPLE_KEY].tolist())

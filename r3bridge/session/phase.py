"""One replay phase of a framework's Megatron pass, owned here so every adapter runs it alike.

A framework adapter calls :meth:`PhaseRunner.run` around its own schedule call (one mini-batch
update or one log-prob pass) and supplies only what is framework-specific: the targets of each
micro-batch (:class:`~r3bridge.megatron.MicroBatch`), where the metrics go, where recorded routes
are written. The runner owns the rest, in this order (the pass itself is one object, the driver's
:class:`~r3bridge.megatron.ReplayPass`):

1. the plan of the phase (:meth:`r3bridge.ReplayConfig.plan`); replay off, the reference model
   and NATIVE phases run the framework's call untouched;
2. one driver pass (:meth:`r3bridge.megatron.Replayer.open_pass`) around the call;
3. the install of every (chunk, micro-batch) right before the chunk's forward, either from a
   prepended forward pre-hook (:func:`install_before_forward`: frameworks whose ``forward_step``
   is a closure) or by the adapter's own ``forward_step`` override (the pass's
   ``install(model, MicroBatch)``);
4. padding sequences the trainer packs but that are no sample (``sample_ids`` entry ``None``):
   they get no routes and are left out of the recording, without any reserved id value;
4b. R3: each sample's route provenance compared with its log-probs' (``ReplayConfig.provenance_check``,
   :mod:`r3bridge.batch.provenance`) *before* the driver pass opens, so a refusal installs nothing;
5. the driver's metrics summarised (:func:`r3bridge.metrics.summarize_layers`: per-layer keys only
   with ``per_layer_metrics``) and tagged by phase (:func:`r3bridge.metrics.tag_phase`), and compute_log_prob
   metrics carried to the next update for frameworks that log only the update's
   (:meth:`PhaseRunner.metrics_to_log`);
6. R2: the recorded routes of the real samples, in sample-id order (:attr:`PhaseResult.recorded`).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

from r3bridge.batch.provenance import ProvenanceCount, ProvenancePairing
from r3bridge.batch.schema import ReplayBatch
from r3bridge.config import Action, Phase, PhasePlan, ReplayConfig, ReplayMode
from r3bridge.errors import ConfigError, ReplayStateError
from r3bridge.megatron.replay_pass import MicroBatch, ReplayPass
from r3bridge.metrics import summarize_layers, tag_phase
from r3bridge.trace.writing import RunTracer

__all__ = ["PhaseResult", "PhaseRunner", "install_before_forward", "forward_packing", "phase_tag", "Targets"]


Targets = Union[Sequence[MicroBatch], Callable[[int, int, tuple, dict], MicroBatch]]


def phase_tag(phase: Phase) -> str:
    """The metrics tag of a phase: ``update``, ``old_log_prob`` or ``ref_log_prob``."""
    return {Phase.UPDATE: "update", Phase.REF_LOG_PROB: "ref_log_prob"}.get(Phase(phase), "old_log_prob")


@dataclass
class PhaseResult:
    """What one phase produced (``metrics``: driver names; ``tagged``: as adapters log them)."""

    phase: Phase
    action: Action
    metrics: dict[str, float] = field(default_factory=dict)
    tagged: dict[str, float] = field(default_factory=dict)
    recorded: Optional[ReplayBatch] = None      # a recording pass: the real samples, in sample-id order

    def recorded_for(self, num_samples: int) -> ReplayBatch:
        """The R2 recording of a batch of ``num_samples`` samples; ``ReplayStateError`` unless it
        holds exactly one sequence per sample (a sample the schedule skipped, or one seen twice)."""
        rec = self.recorded
        if rec is None or rec.num_seqs != int(num_samples):
            raise ReplayStateError(f"R2 recorded {None if rec is None else rec.num_seqs} sequences for a batch "
                                   f"of {int(num_samples)} samples")
        return rec


class PhaseRunner:
    """Runs the phases of one policy model (one :class:`r3bridge.megatron.Replayer`).

    ``replayer`` ``None`` (replay off, or a model that never replays) makes every phase native.
    ``carry_log_prob_metrics``: the framework logs only the update's metrics, so compute_log_prob's
    are held and reported with the next update (:meth:`metrics_to_log`)."""

    def __init__(self, replayer: Any, config: ReplayConfig, *, carry_log_prob_metrics: bool = False,
                 framework: str = "unknown") -> None:
        self.replayer = replayer
        self.config = config
        self.carry = carry_log_prob_metrics
        self._held: dict[str, list[float]] = {}
        # route traces (the trace_dir option), written by r3bridge.trace.writing for every adapter
        self.tracer = None if config.trace_dir is None else RunTracer(config, framework)

    @property
    def active(self) -> bool:
        return self.replayer is not None and self.config.replay_mode is not ReplayMode.OFF

    def plan(self, phase: Phase) -> Optional[PhasePlan]:
        """The phase's plan, ``None`` when it routes natively (nothing to install)."""
        if not self.active:
            return None
        plan = self.config.plan(phase)
        return None if plan.action is Action.NATIVE else plan

    def check_routes(self, plan: PhasePlan, present: bool, *, field: str, where: str = "the batch",
                     provide: Mapping[str, str]) -> None:
        """``ConfigError`` when ``field`` does not match the plan: a replay without routes, or an
        R2 recording pass whose batch already carries routes (rollout routes would collide with
        the recording). ``provide``: the framework setting that supplies routes of each kind
        (``"rollout"``, ``"recorded"``) and the one that turns rollout routes off (``"off"``)."""
        mode = self.config.replay_mode.value
        if plan.action is Action.REPLAY and not present:
            raise ConfigError(f"replay_mode={mode}: {where} carries no {field!r} to replay "
                              f"({provide[plan.route_kind]})")
        if plan.action is Action.RECORD and present:
            raise ConfigError(f"replay_mode={mode} records routes in compute_log_prob, but {where} already "
                              f"carries {field!r} (rollout routes?): {provide['off']}")

    @contextlib.contextmanager
    def run(self, phase: Phase, *, forward_only: bool, targets: Optional[Targets] = None,
            chunks: Optional[Sequence[torch.nn.Module]] = None,
            num_micro_batches: Optional[int] = None,
            provenance: Optional[ProvenancePairing] = None,
            packing_from_forward: bool = False) -> Iterator[Optional[ReplayPass]]:
        """Context around the framework's schedule call. Yields ``None`` for a native phase,
        else the pass (:class:`~r3bridge.megatron.ReplayPass`), whose ``result`` is set on a clean exit.

        ``targets`` (a list indexed by micro-batch, or ``(chunk, k, args, kwargs) -> MicroBatch``)
        installs from forward pre-hooks on ``chunks`` (default: the replayer's); without it the
        adapter calls the pass's ``install(model, MicroBatch)`` itself. ``packing_from_forward``: each target's
        packing is the one the chunk's forward gets (:func:`forward_packing`).

        ``provenance``: the pass's samples' route and log-prob provenance; under R3 they are
        compared per ``provenance_check`` before anything is installed (``"refuse"`` raises
        :class:`r3bridge.errors.ProvenanceError` here), and the counts join the pass's metrics."""
        phase = Phase(phase)
        plan = self.plan(phase)
        if plan is None:
            yield None
            return
        checked = self._check_provenance(plan, provenance)
        with self.replayer.open_pass(plan, forward_only=forward_only) as ps:
            ps.serve(self, phase, plan, checked)
            ps.trace = None if self.tracer is None else self.tracer.begin(self.replayer, phase, plan.action)
            if targets is None:
                yield ps
            else:
                mods = list(chunks) if chunks is not None else [f.chunk for f in self.replayer.chunks]
                get = targets if callable(targets) else (lambda c, k, a, kw: targets[k])
                n = num_micro_batches if num_micro_batches is not None or callable(targets) else len(targets)

                def hook(c: int, k: int, args: tuple, kwargs: dict) -> Callable[[torch.nn.Module], None]:
                    mb = get(c, k, args, kwargs)
                    if packing_from_forward:
                        mb = forward_packing(mb, args, kwargs)
                    return lambda module: ps.install(module, mb, index=k)
                with install_before_forward(mods, hook, n):
                    yield ps
        ps.result = self._result(ps)
        if self.tracer is not None:
            self.tracer.finish(ps, ps.trace, phase_tag(phase))

    def _result(self, ps: ReplayPass) -> PhaseResult:
        """The pass's result: the driver's metrics summarised (per-layer agreement keys opt-in,
        ``ReplayConfig.per_layer_metrics``), with the provenance counts, tagged by phase; R2's
        recording of the real samples."""
        cfg = self.config
        metrics = summarize_layers(ps.metrics, cfg.metrics_prefix, per_layer=cfg.per_layer_metrics)
        if ps.provenance is not None:
            metrics.update(ps.provenance.as_metrics(cfg.metrics_prefix))
        res = PhaseResult(ps.phase, ps.action, metrics, tag_phase(metrics, cfg.metrics_prefix, phase_tag(ps.phase)))
        if ps.records:      # R2's recording, or R3w's (ids and their combine weights)
            res.recorded = ps.recorded_samples()
        return res

    def _check_provenance(self, plan: PhasePlan, pairing: Optional[ProvenancePairing]) -> Optional[ProvenanceCount]:
        """R3's check of rollout routes against the log-probs they are paired with. R2 replays
        the routes the trainer recorded in the same pass as its log-probs: nothing to compare."""
        mode = self.config.provenance_check
        if pairing is None or mode == "off" or plan.action is not Action.REPLAY or plan.route_kind != "rollout":
            return None
        return pairing.check(mode)

    def metrics_to_log(self, result: Optional[PhaseResult], extra: Optional[dict[str, float]] = None
                       ) -> dict[str, list[float]]:
        """The tagged metrics (plus ``extra``) the framework should log now. With carrying on, a
        compute_log_prob pass's are held (returns ``{}``) and come out with the next update's."""
        now = {**({} if result is None else result.tagged), **(extra or {})}
        if not self.carry:
            return {k: [v] for k, v in now.items()}
        if result is not None and result.phase is not Phase.UPDATE:
            for k, v in now.items():
                self._held.setdefault(k, []).append(v)
            return {}
        out, self._held = self._held, {}
        for k, v in now.items():
            out.setdefault(k, []).append(v)
        return out


def forward_packing(mb: MicroBatch, args: tuple, kwargs: dict) -> MicroBatch:
    """``mb`` with the packing a chunk's forward really gets, read from its arguments as
    megatron-core's ``GPTModel.forward(input_ids, position_ids, attention_mask, ...,
    packed_seq_params=)`` takes them: THD with ``packed_seq_params.cu_seqlens_q_padded`` (the
    trainer's own alignment and CP padding), else BSHD ``[B, S]`` with ``S`` from ``position_ids``."""
    psp = kwargs.get("packed_seq_params")
    if psp is not None:
        return dataclasses.replace(mb, format="thd", cu_seqlens_padded=psp.cu_seqlens_q_padded)
    positions = args[1] if len(args) > 1 else kwargs.get("position_ids")
    if positions is None:
        raise ReplayStateError("a chunk's forward got neither packed_seq_params (THD) nor position_ids (BSHD): "
                               "its packing cannot be read")
    return dataclasses.replace(mb, format="bshd", seq_length=int(positions.shape[1]))


@contextlib.contextmanager
def install_before_forward(chunks: Sequence[torch.nn.Module],
                           hook: Callable[[int, int, tuple, dict], Callable[[torch.nn.Module], None]],
                           num_micro_batches: Optional[int] = None) -> Iterator[list[int]]:
    """Run an install right before every forward of every chunk, for frameworks whose
    ``forward_step`` is a closure the adapter cannot override.

    Megatron's schedules (no pipelining, 1F1B, interleaved VPP) run each chunk's forwards in
    micro-batch order 0..M-1, once each, so the k-th forward of chunk c is micro-batch k.
    ``hook(c, k, args, kwargs)`` returns the install to run for it (``args`` / ``kwargs``: the
    chunk's forward arguments; ``packed_seq_params`` lives in ``kwargs``). The pre-hook is
    *prepended* (public torch API, nothing is patched), so it runs before the driver's own, which
    then refuses a forward without an install. Yields the per-chunk forward counts; raises
    ``ReplayStateError`` on more forwards than ``num_micro_batches``."""
    counts = [0] * len(chunks)
    handles = []

    def make(c: int):
        def pre(module, args, kwargs):
            k = counts[c]
            if num_micro_batches is not None and k >= num_micro_batches:
                raise ReplayStateError(f"chunk {c}: forward #{k + 1} but the schedule has only "
                                       f"{num_micro_batches} micro-batches")
            hook(c, k, args, kwargs)(module)
            counts[c] = k + 1
            return None
        return pre

    try:
        for c, chunk in enumerate(chunks):
            handles.append(chunk.register_forward_pre_hook(make(c), prepend=True, with_kwargs=True))
        yield counts
    finally:
        for h in handles:
            h.remove()

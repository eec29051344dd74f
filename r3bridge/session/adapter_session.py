"""`AdapterSession`: an adapter's whole set-up with the driver, written once.

An installed adapter translates its framework's batches and calls the driver, nothing more. What
every adapter used to set up by hand lives here, in this order:

1. **config**: the ``r3bridge`` section resolved (explicit, else ``R3BRIDGE_CONFIG`` /
   ``R3BRIDGE_REPLAY_MODE``, else off: :meth:`r3bridge.ReplayConfig.resolve_with_origin`) and
   announced (:func:`r3bridge.announce.announce`: one line naming the framework's process, the
   mode in force and where it came from);
2. **attach** (:meth:`AdapterSession.attach`, after the framework built its model): the actor
   with replay on gets a :class:`~r3bridge.megatron.Replayer` with every option of the section
   (:meth:`Replayer.from_config`), its MoE layers checked against the HF config's; any other role
   (reference, critic, teacher) is declared (:mod:`r3bridge.megatron.roles`), so no replay
   object can reach it, whatever the mode;
3. **per pass** (one ``forward_backward_func`` call of a phase): :meth:`~AdapterSession.plan`
   (``None``: route natively; a non-actor model is re-checked first),
   :meth:`~AdapterSession.check_routes` / :meth:`~AdapterSession.check_topk` (the batch carries
   the routes the plan needs, of the model's top-k), :meth:`~AdapterSession.run` around the
   framework's schedule call (:class:`~r3bridge.session.PhaseRunner`: the driver pass, the
   per-(chunk, micro-batch) install of the adapter's :class:`~r3bridge.megatron.MicroBatch`
   records, provenance, traces);
4. **after the pass**: :meth:`~AdapterSession.metrics_to_log` (the driver's metrics tagged by
   phase, ``r3bridge/replay_mode`` always, compute_log_prob's carried to the update where the
   framework drops them) and, under R2, :meth:`~AdapterSession.recorded_for` (the recorded
   routes, one sequence per sample, for the adapter's write-back).

The adapter keeps only what is its framework's: where the section is read, which keys supply
routes (``provide``), how a micro-batch becomes a ``MicroBatch``, where metrics and recorded
routes go. See docs/driver-api.md, "Adapter sessions".
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import torch

from r3bridge.announce import announce, replay_mode_metric
from r3bridge.batch.provenance import ProvenancePairing
from r3bridge.batch.schema import ReplayBatch
from r3bridge.config import Action, Phase, PhasePlan, ReplayConfig, ReplayMode, check_replay_weights
from r3bridge.errors import ConfigError, ReplayStateError, RoleError
from r3bridge.hf import ModelInfo, check_topk
from r3bridge.megatron.replay_pass import ReplayPass
from r3bridge.megatron.roles import Role, check_declared, declare_role
from r3bridge.session.phase import PhaseResult, PhaseRunner, Targets

__all__ = ["AdapterSession", "averaged", "declared_session"]

logger = logging.getLogger("r3bridge")


class AdapterSession:
    """Replay for one model of a framework's job, in one process.

    Args:
        framework: the framework's name (the adapter's), written into route traces.
        config: the ``r3bridge`` section (a :class:`~r3bridge.ReplayConfig` or a mapping), or
            ``None`` for ``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE`` / off.
        where: the process and model for the startup line (e.g. ``"policy worker"``); ``None``
            logs nothing (a model that never replays).
        config_origin: where ``config`` came from when the framework knows better than
            "config" (the startup line says it).
        role: the role the framework built this model for; only the actor replays.
        provide: the framework setting that supplies the routes of each kind (``"rollout"``,
            ``"recorded"``) and the one that keeps rollout routes out (``"off"``), named in
            :meth:`check_routes`' errors.
        carry_log_prob_metrics: the framework logs only the update's metrics:
            compute_log_prob's are held and logged with the next update.
        route_transports: the ``route_transport`` settings this adapter reads; any other is refused.
        routing_weights: the ``replay_weights`` settings this adapter carries (``recorded``: it
            hands compute_log_prob's recording, weights included, to every update); any other
            is refused here, before a pass runs.
    """

    def __init__(self, framework: str, config: ReplayConfig | Mapping[str, Any] | None = None, *,
                 where: Optional[str], config_origin: Optional[str] = None, role: Role | str = Role.ACTOR,
                 provide: Optional[Mapping[str, str]] = None, carry_log_prob_metrics: bool = False,
                 route_transports: Sequence[str] = ("inline",), routing_weights: Sequence[str] = ("off",)) -> None:
        resolved, origin = ReplayConfig.resolve_with_origin(config)
        if resolved.route_transport not in route_transports:
            # a setting no code of this adapter reads would leave the job on the inline routes, silently
            raise ConfigError(f"r3bridge.route_transport={resolved.route_transport!r}: the {framework} adapter reads "
                              f"routes as {' / '.join(route_transports)} only (routes by reference: docs/route-handles.md "
                              f"says what an adapter needs to read them)")
        check_replay_weights(resolved.replay_mode, resolved.replay_weights)     # replay on, in the options in force
        if Role.of(role) is Role.ACTOR and resolved.replay_weights not in routing_weights:
            # refused here, at the worker's set-up, not after a compute_log_prob pass: an adapter
            # that does not move the recorded weights to its updates would fail there (a model of
            # another role never replays: the setting is not its)
            raise ConfigError(f"r3bridge.replay_weights={resolved.replay_weights!r}: the {framework} adapter carries "
                              f"routing weights as {' / '.join(routing_weights)} only (docs/architecture.md, "
                              f"\"Routing weights\": `recorded` needs compute_log_prob's recording, weights "
                              f"included, handed to every update)")
        self.framework = framework
        self.config = resolved
        self.config_origin = config_origin or origin
        self.role = Role.of(role)
        self.provide = dict(provide or {})
        self.model: Optional[ModelInfo] = None
        self.chunks: list[torch.nn.Module] = []
        self.runner = PhaseRunner(None, resolved, carry_log_prob_metrics=carry_log_prob_metrics, framework=framework)
        self.result: Optional[PhaseResult] = None       # the last pass's (None: routed natively)
        if where is not None:
            announce(resolved, self.config_origin, where)

    # ------------------------------------------------------------------------------ state
    @property
    def mode(self) -> ReplayMode:
        return self.config.replay_mode

    @property
    def replays(self) -> bool:
        """This model replays (or records): the actor, with replay on."""
        return self.role is Role.ACTOR and self.mode is not ReplayMode.OFF

    @property
    def replayer(self) -> Any:
        """The :class:`~r3bridge.megatron.Replayer` (``None``: not attached, or a model that never replays)."""
        return self.runner.replayer

    @property
    def replay_mode_metric(self) -> dict[str, float]:
        """``{prefix}replay_mode``: 0 (off), 2 (R2), 3 (R3): logged with every pass, also off."""
        return replay_mode_metric(self.config)

    # ------------------------------------------------------------------------------ set-up
    def attach(self, model_chunks: Sequence[torch.nn.Module] | torch.nn.Module, model: ModelInfo | Any = None, *,
               layout: Any = None, **replayer_options: Any) -> Any:
        """After the framework built the model (its chunks, one per virtual pipeline stage).

        ``model``: a :class:`~r3bridge.hf.ModelInfo` or the model's HF config (routes are indexed
        by its MoE layers; the Replayer refuses a Megatron model whose MoE layers differ).
        ``replayer_options``: passed to :meth:`Replayer.from_config` (``role=`` makes it refuse a
        model the framework built for another role). Returns the Replayer, ``None`` when this
        model does not replay (replay off, or not the actor: then it is declared its role)."""
        self.chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if self.role is not Role.ACTOR:
            declare_role(self.chunks, self.role)
            return None
        if self.mode is ReplayMode.OFF:
            return None
        if model is not None:       # read only when replaying (a dense model's config has no experts)
            self.model = model if isinstance(model, ModelInfo) else ModelInfo.from_hf_config(model)
        from r3bridge.megatron.replayer import Replayer

        moe = None if self.model is None else self.model.moe_layer_ids
        replayer = Replayer.from_config(self.chunks, self.config, layout, expect_moe_layer_ids=moe, **replayer_options)
        if self.config.router_log_ratio and replayer.layout.pp > 1:
            replayer.detach()
            raise ConfigError(f"r3bridge.router_log_ratio=true needs pipeline_model_parallel_size=1 (got "
                              f"{replayer.layout.pp}): the loss runs while other stages compute other micro-batches, "
                              f"so their layers' share cannot be summed in")
        self.runner.replayer = replayer
        logger.info("r3bridge: replay_mode=%s attached to %d %s model chunk(s), MoE layers %s", self.mode.value,
                    len(self.chunks), self.framework, replayer.layer_ids)
        return replayer

    def detach(self) -> None:
        if self.replayer is not None:
            self.replayer.detach()
            self.runner.replayer = None

    # ------------------------------------------------------------------------------ per pass
    def plan(self, phase: Phase | str) -> Optional[PhasePlan]:
        """What the pass of ``phase`` does; ``None``: it routes natively (replay off, the
        reference pass, a model that never replays: that one is re-checked first, so nothing
        gave it a replay object since it was declared)."""
        if self.role is not Role.ACTOR:
            self.check_role()
            return None
        return self.runner.plan(Phase(phase))

    def check_role(self) -> None:
        """A model that never replays, before each of its passes: nothing (another role's build,
        a framework's global replay set-up) gave it a replay object since it was declared."""
        if self.role is not Role.ACTOR and self.chunks:
            check_declared(self.chunks, self.role)

    def check_routes(self, plan: PhasePlan, present: bool, *, field: str, where: str = "the batch") -> None:
        """``ConfigError`` unless the batch carries routes exactly when the plan replays (an R2
        recording pass whose batch already carries ``field`` would collide), naming the framework
        setting (``provide``) that fixes it."""
        provide = {"off": "turn the rollout engine's routes off", **self.provide}
        self.runner.check_routes(plan, present, field=field, where=where, provide=provide)

    def check_topk(self, field: str, width: int, *, where: str = "") -> None:
        """Refuse routes of ``width`` ids per (token, layer) for a model of another top-k, before
        the schedule starts (not at the first router, mid-forward), naming the field and both."""
        check_topk(field, width, None if self.model is None else self.model.topk, where=where)

    @contextlib.contextmanager
    def run(self, phase: Phase | str, *, forward_only: bool, targets: Optional[Targets] = None,
            num_micro_batches: Optional[int] = None, provenance: Optional[ProvenancePairing] = None,
            packing_from_forward: bool = False) -> Iterator[Optional[ReplayPass]]:
        """:meth:`PhaseRunner.run` around the framework's schedule call (``targets`` install from
        forward pre-hooks on the attached chunks, with ``packing_from_forward`` each one's packing
        read from the chunk's forward arguments; without them the adapter calls
        the pass's ``install(model, MicroBatch)`` from its ``forward_step``). :attr:`result` is the pass's on a clean
        exit (``None``: routed natively)."""
        self.result = None
        with self.runner.run(Phase(phase), forward_only=forward_only, targets=targets, chunks=self.chunks or None,
                             num_micro_batches=num_micro_batches, provenance=provenance,
                             packing_from_forward=packing_from_forward) as phase_pass:
            yield phase_pass
        self.result = None if phase_pass is None else phase_pass.result

    def sample_uids(self, token_lists: Iterable[Any]) -> Optional[list[str]]:
        """Each sample's name from its tokens (:func:`r3bridge.trace.token_uid`) when the pass is
        traced, for ``MicroBatch.uids``: ``r3bridge diff`` pairs samples by it across passes whose
        order the framework shuffles; ``None`` when untraced (nothing computed)."""
        if self.runner.tracer is None:
            return None
        from r3bridge.trace import token_uid
        return [token_uid(t) for t in token_lists]

    # ------------------------------------------------------------------------------ after the pass
    def metrics_to_log(self, result: Optional[PhaseResult] = None,
                       extra: Optional[Mapping[str, float]] = None) -> dict[str, list[float]]:
        """What the framework should log now: the pass's tagged metrics, ``extra`` and
        ``r3bridge/replay_mode`` (also for a native pass, ``result=None``); with
        ``carry_log_prob_metrics`` a compute_log_prob pass's are held ({}) and come out with the
        next update's, several values per key."""
        return self.runner.metrics_to_log(result, {**self.replay_mode_metric, **(extra or {})})

    def recorded_for(self, num_samples: int) -> ReplayBatch:
        """R2: the last pass's recorded routes, one sequence per sample of the batch, in sample
        order (``ReplayStateError`` when that pass recorded nothing, or other samples)."""
        if self.result is None or self.result.action is not Action.RECORD:
            raise ReplayStateError(f"replay_mode={self.mode.value} but the compute_log_prob pass ran without "
                                   f"recording (no R2 routes to write back)")
        return self.result.recorded_for(num_samples)


def averaged(metrics: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """:meth:`AdapterSession.metrics_to_log`'s lists as one value per key (their mean), for
    frameworks that log scalars and average them over passes and ranks themselves."""
    return {k: sum(v) / len(v) for k, v in metrics.items() if len(v)}


def declared_session(framework: str, model_chunks: Sequence[torch.nn.Module] | torch.nn.Module, role: Role | str, *,
                     actor_refused: str = "the actor replays through the adapter's actor engine") -> Any:
    """The role guard of a model a framework built for another role than the actor (reference,
    teacher, critic): an :class:`~r3bridge.session.AdapterSession` of that role, the model declared
    now (:func:`declare_role`: no replay object may reach it). Call the session's ``check_role()``
    before each of the model's passes (or ``plan()``, which does): it re-checks that nothing gave the
    model a replay object since. ``actor_refused``: the :class:`RoleError` when ``role`` is the actor,
    which replays through the adapter's own actor engine instead."""
    declared = Role.of(role)
    if declared is Role.ACTOR:
        raise RoleError(actor_refused)
    session = AdapterSession(framework, where=None, role=declared)
    session.attach(model_chunks)
    return session

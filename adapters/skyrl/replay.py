"""`SkyRLReplay`: one SkyRL policy model's :class:`~r3bridge.session.AdapterSession` and what the
adapter carries to its passes between SkyRL's calls.

SkyRL hands over what a pass needs at different calls: which routes the batch carries (the
worker's batch metadata, :meth:`PolicyWorkerMixin.forward_backward`), the pass's provenance (from
the whole batch, before SkyRL cuts it into micro-batch dicts that carry only routes), and it logs
metrics only where it collects them (each update micro-batch's metrics dict). Its schedule takes a
list of micro-batch dicts and copies only the routes fields into them, so each pass runs through
:meth:`SkyRLReplay.run_micro_batches` (R2's recording pass carries its sample ids in the routes
field: :meth:`SkyRLReplay.sample_ids_in`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, MutableMapping, Optional, Sequence

import torch

from r3bridge.adapters.skyrl import codec
from r3bridge.adapters.skyrl.handles import HANDLES_KEY, BatchHandles, micro_batch_routes
from r3bridge.adapters.skyrl.id_field import is_sample_id_field, sample_id_field, sample_ids_from_field
from r3bridge.batch.provenance import ProvenancePairing
from r3bridge.batch.recorded import per_sample_payloads
from r3bridge.batch.schema import ReplayBatch
from r3bridge.config import Action, Phase, PhasePlan, ReplayConfig
from r3bridge.errors import ConfigError
from r3bridge.hf import ModelInfo
from r3bridge.megatron.replay_pass import MicroBatch
from r3bridge.parallel.handed import HandedRoutes
from r3bridge.session.adapter_session import AdapterSession, averaged

__all__ = ["SkyRLReplay"]

# the SkyRL setting that supplies the routes of each kind, and the one that keeps rollout routes out
_PROVIDE = {"rollout": "generator.inference_engine.enable_return_routed_experts=True",
            "recorded": "R2 routes are written back by r3bridge's TrainerMixin / PolicyWorkerMixin",
            "off": "set generator.inference_engine.enable_return_routed_experts=False"}


class SkyRLReplay:
    """One policy model's session; ``route_kind``, ``provenance`` and ``log_metrics`` carried
    between SkyRL's calls, and SkyRL's micro-batch dicts read for the driver."""

    # SkyRL's own replay never runs; its route keys stay, as None: SkyRL 0.4's forward reads
    # batch["rollout_expert_indices"] of every micro-batch (megatron_model_wrapper.py:560). The
    # routes field first: R2's recording pass carries its sample ids there.
    route_keys = (codec.ROUTES_KEY, codec.MASK_KEY)
    tokens_key = "sequences"                # each [B, S] row's tokens
    attention_key = "attention_mask"        # and its real-token mask
    # SkyRL packs THD (remove_microbatch_padding) or runs [B, S] with left padding removed (BSHD):
    # each micro-batch's packing is read from the chunk's forward
    packing_from_forward = True

    def __init__(self, actor_module: Sequence[torch.nn.Module], cfg: ReplayConfig | None, model: ModelInfo,
                 layout=None, *, where: Optional[str] = None) -> None:
        # SkyRL logs no compute_log_prob metrics: the session reports them with the update
        self.session = AdapterSession("skyrl", cfg, where=where, provide=_PROVIDE, carry_log_prob_metrics=True,
                                      route_transports=("inline", "handles"))
        self.session.attach(actor_module, model, layout=layout)
        self.route_kind: Optional[str] = None   # which routes the batch carries (None: not told)
        # the next pass's route / log-prob provenance: used once (take_provenance)
        self.provenance: Optional[ProvenancePairing] = None
        # the last update's + its compute_log_prob's, tagged; r3bridge/replay_mode always (also off)
        self.log_metrics: dict[str, float] = self.session.replay_mode_metric
        # route_transport=handles: the batch's route handles, for the SkyRL call that runs the pass
        # (handles_from), and the resolvers that read them (one per store, kept for the worker's life)
        self.route_handles: Optional[BatchHandles] = None
        self._resolvers: dict[tuple, dict] = {}

    @property
    def replayer(self) -> Any:
        return self.session.replayer

    @property
    def metrics(self) -> dict[str, float]:
        """The last pass's metrics, as the driver names them."""
        return {} if self.session.result is None else dict(self.session.result.metrics)

    @property
    def recorded(self) -> Optional[ReplayBatch]:
        """The last pass's R2 recording (real samples, sample-id order)."""
        return None if self.session.result is None else self.session.result.recorded

    def take_provenance(self) -> Optional[ProvenancePairing]:
        """The provenance set for the next pass, once: never a later pass's."""
        pairing, self.provenance = self.provenance, None
        return pairing

    @contextlib.contextmanager
    def providing(self, pairing: Optional[ProvenancePairing]) -> Iterator[None]:
        """``pairing`` is the provenance of the pass inside this block only (a SkyRL call that
        runs it), never a later pass's."""
        self.provenance = pairing
        try:
            yield
        finally:
            self.provenance = None

    @contextlib.contextmanager
    def handles_from(self, metadata: Optional[Mapping[str, Any]]) -> Iterator[None]:
        """The route handles a batch's ``metadata`` carries are the pass's inside this block only;
        ``ConfigError`` when they contradict ``r3bridge.route_transport`` (never read inline routes
        for handles, nor the reverse, in silence)."""
        handles = (metadata or {}).get(HANDLES_KEY)
        wants = self.session.config.route_transport
        if handles is not None and wants != "handles":
            raise ConfigError(f"the batch carries route handles, this worker's r3bridge.route_transport is {wants!r}: "
                              f"set the same route_transport for the trainer and its workers")
        self.route_handles = handles
        try:
            yield
        finally:
            self.route_handles = None

    def record_into(self, outputs: Callable[[], Sequence[dict]], key: str) -> None:
        """R2: the last pass's recording, one payload per sample (:mod:`r3bridge.batch.recorded`),
        into ``outputs()[i][key]`` (SkyRL's per-sample output dicts); nothing on a pipeline stage
        other than the last, whose outputs are placeholders SkyRL never reads."""
        from megatron.core import parallel_state as mpu

        if not mpu.is_pipeline_last_stage(ignore_virtual=True):
            return
        samples = outputs()
        for out, payload in zip(samples, per_sample_payloads(self.session.recorded_for(len(samples)))):
            out[key] = payload

    def check_route_kind(self, plan: PhasePlan) -> None:
        """``ConfigError`` when the batch carries other routes than the replay pass replays."""
        if self.route_kind is not None and self.route_kind != plan.route_kind:
            raise ConfigError(f"replay_mode={self.session.mode.value} replays {plan.route_kind} routes, the batch "
                              f"carries {self.route_kind} routes")

    def log_pass(self, phase: Phase) -> None:
        """After a pass: an update's metrics (with the compute_log_prob's the session held for it),
        one value per key, become :attr:`log_metrics`."""
        logged = self.session.metrics_to_log(self.session.result)
        if phase is Phase.UPDATE:
            self.log_metrics = averaged(logged)

    def add_metrics(self, metrics_list: Any) -> Any:
        """:attr:`log_metrics` into each dict of ``metrics_list`` (SkyRL's per-micro-batch metrics,
        which it averages over micro-batches and ranks and logs)."""
        if isinstance(metrics_list, list):
            for m in metrics_list:
                if isinstance(m, dict):
                    m.update(self.log_metrics)
        return metrics_list

    def read_routes(self, fields: dict, plan: PhasePlan) -> HandedRoutes:
        """REPLAY: SkyRL's own micro-batch field (``fields`` with the ``route_keys`` back in)
        viewed: the driver's reader reads this rank's rows once."""
        m = self.session.model
        if self.session.config.route_transport == "handles":
            return self._handle_routes(fields, plan)
        return codec.handed_routes(fields, num_experts=m.num_experts, moe_layer_ids=m.moe_layer_ids,
                                   route_kind=plan.route_kind,
                                   num_hidden_layers=None if plan.route_kind == "recorded" else m.num_layers)

    def _handle_routes(self, fields: dict, plan: PhasePlan) -> HandedRoutes:
        handles = self.route_handles
        if handles is None:
            raise ConfigError(f"r3bridge.route_transport=handles: the batch carries no route handles (metadata "
                              f"{HANDLES_KEY!r}): write the routes with r3bridge's TrainerMixin under the same "
                              f"route_transport")
        key = (handles.store, handles.directory)
        if key not in self._resolvers:
            self._resolvers[key] = handles.resolvers()
        seq_lens = fields[self.attention_key].sum(-1).long().tolist()
        return micro_batch_routes(fields[codec.ROUTES_KEY], handles, seq_lens, self._resolvers[key],
                                  route_kind=plan.route_kind)

    def run_micro_batches(self, phase: Phase, micro_batches: Sequence[Mapping[str, Any]], *, forward_only: bool,
                          call: Callable[[list[dict]], Any]) -> Any:
        """SkyRL's schedule ``call(micro_batches)`` under the plan of ``phase``, one target per
        micro-batch dict. The ``route_keys`` are taken out of every dict and stay as ``None``, so
        SkyRL's own replay never runs; REPLAY reads them (:meth:`read_routes`), RECORD takes the
        sample ids the routes field may carry (:meth:`sample_ids_in`), else micro-batch order. An
        update's metrics become :attr:`log_metrics`."""
        session = self.session
        plan = session.plan(phase)
        pairing = self.take_provenance()
        carried = [{k: m.get(k) for k in self.route_keys} for m in micro_batches]
        mbs = [{k: None if k in self.route_keys else v for k, v in m.items()} for m in micro_batches]
        session.result = None
        if plan is None:
            return call(mbs)
        targets = [self._micro_batch(plan, k, m, r) for k, (m, r) in enumerate(zip(mbs, carried))]
        with session.run(phase, forward_only=forward_only, targets=targets, provenance=pairing,
                         packing_from_forward=self.packing_from_forward):
            out = call(mbs)
        self.log_pass(phase)
        return out

    def _micro_batch(self, plan: PhasePlan, k: int, mb: dict, carried: dict) -> MicroBatch:
        attn = mb[self.attention_key]
        seq_lens = attn.sum(-1).long().tolist()
        uids = self.session.sample_uids(s[a.bool()] for s, a in zip(mb[self.tokens_key], attn))
        field, routes = next(iter(carried.items()))
        where = f"micro-batch {k}"
        if plan.action is Action.REPLAY:
            self.check_route_kind(plan)
            self.session.check_routes(plan, routes is not None, field=field, where=where)
            return MicroBatch(seq_lens, self.read_routes({**mb, **carried}, plan), uids=uids)
        if routes is None:          # RECORD without sample ids: micro-batch order
            return MicroBatch(seq_lens, uids=uids)
        # sample ids (sample_ids_in); anything else in the routes field is rollout routes
        self.session.check_routes(plan, not is_sample_id_field(routes), field=field, where=where)
        return MicroBatch(seq_lens, sample_ids=sample_ids_from_field(routes, len(seq_lens)), uids=uids)

    @contextlib.contextmanager
    def sample_ids_in(self, batch: MutableMapping[str, Any], field: str, rows: int, seq_len: int) -> Iterator[None]:
        """R2's recording pass over ``batch``, whose routes ``field`` is the one per-sample field
        SkyRL copies into its micro-batches: inside this block it carries each row's sample id
        (:func:`r3bridge.batch.id_field.sample_id_field`), ``None`` after. ``ConfigError`` when the
        batch already carries routes there (they would collide)."""
        session = self.session
        session.check_routes(session.config.plan(Phase.OLD_LOG_PROB), batch.get(field) is not None, field=field)
        batch[field] = sample_id_field(range(rows), seq_len)
        try:
            yield
        finally:
            batch[field] = None

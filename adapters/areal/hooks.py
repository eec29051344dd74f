"""AReaL hooks: mixins for AReaL's own classes (subclass, never patch) around the driver's
:class:`r3bridge.session.AdapterSession`. docs/use-with-areal.md, "What happens where".
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from r3bridge.adapters.areal import codec
from r3bridge.adapters.areal._compat import import_areal
from r3bridge.adapters.areal.attempts import attempt_provenance, generate_first_seen
from r3bridge.adapters.areal.rollout import routes_from_responses, sample_name
from r3bridge.adapters.areal.sequence_last import per_token_sample_ids, sequence_last_routes, write_right_padded
from r3bridge.batch.provenance import ProvenancePairing, pairing_from_fields, provenance_fields
from r3bridge.config import Action, Phase, ReplayConfig, ReplayMode
from r3bridge.errors import ConfigError, ReplayStateError
from r3bridge.forms.masked import row_names
from r3bridge.hf import ModelInfo
from r3bridge.job_check import JobCheck, replay_section
from r3bridge.megatron.roles import Role
from r3bridge.rollout.forwarding import CallRecorder
from r3bridge.session.adapter_session import AdapterSession, averaged, declared_session
from r3bridge.session.packed_micro_batch import packed_micro_batches
from r3bridge.session.phase import PhaseResult
from r3bridge.versions import check_internals, check_release, checked_subclass

__all__ = ["SGLangEngineMixin", "WorkflowMixin", "PPOActorMixin", "MegatronEngineMixin", "MB_KEY", "RoleEngineMixin",
           "megatron_role_engine_class", "megatron_ppo_actor_class", "trainer_class", "workflow_class",
           "log_areal_metrics"]

MB_KEY = "r3bridge_mb"          # in each padded micro-batch: its r3bridge.megatron.MicroBatch
# what supplies the routes of each kind
_PROVIDE = {"rollout": "InferenceEngineConfig.return_routed_experts + WorkflowMixin",
            "recorded": "R2 routes are written back by PPOActorMixin.compute_logp"}


# ------------------------------------------------------------------------------------ rollout
async def _generate_deduped(agenerate, req: Any, inner_engine: Any) -> Any:
    """One ``agenerate`` with AReaL's concatenation of resubmitted attempts' routes replaced by their
    first-seen rows (:func:`generate_first_seen`, through the engine instance's ``SGLangBackend``'s
    ``parse_generation_response``); provenance: the first attempt's, AReaL's ``output_versions``."""
    core = getattr(inner_engine, "_engine", inner_engine)          # RemoteSGLangEngine -> RemoteInfEngine
    resp, stitched = await generate_first_seen(lambda: agenerate(req), core, parse="parse_generation_response")
    if stitched is not None and getattr(resp, "routed_experts", None) is not None:
        resp.routed_experts = stitched.rows          # AReaL's own [tokens - 1, L_all*K] int32 rows
        resp.r3bridge_resubmits = stitched.resubmits
        resp.r3bridge_disagreeing_rows = stitched.disagreeing_rows
        resp.r3bridge_provenance = attempt_provenance(stitched.first, getattr(resp, "output_versions", None))
    return resp


class SGLangEngineMixin:
    """``class E(SGLangEngineMixin, RemoteSGLangEngine)``: resubmits deduplicated in the engine."""

    async def agenerate(self, req: Any) -> Any:
        return await _generate_deduped(super().agenerate, req, self)


class WorkflowMixin:
    """Adds ``r3bridge_routes`` (and the provenance fields) to the trajectory of any workflow whose
    ``arun_episode`` calls ``engine.agenerate`` and returns ``input_ids`` ``[1, S]`` (RLVR, multi-turn)."""

    r3_model: Optional[ModelInfo] = None

    async def arun_episode(self, engine: Any, data: Any) -> Any:
        calls = CallRecorder(engine, "agenerate", through=functools.partial(_generate_deduped, inner_engine=engine))
        out = await super().arun_episode(calls, data)
        responses = calls.results
        if out is None or self.r3_model is None:
            return out
        ids = out["input_ids"]
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ConfigError("WorkflowMixin handles one trajectory per episode ([1, S] input_ids)")
        tokens, m = ids[0].tolist(), self.r3_model
        stitched = routes_from_responses(responses, tokens, num_experts=m.num_experts, num_layers=m.num_layers,
                                         topk=m.topk, moe_layer_ids=m.moe_layer_ids,
                                         sample=sample_name(data, len(tokens)))
        out[codec.ROUTES_KEY] = sequence_last_routes(stitched.routes, [len(tokens)])
        # rows a later turn returned again (re-prefill, radix cache) and how many of them differed from
        # the first-seen rows that replay: per trajectory, as verl's agent loop reports them
        out[codec.REPREFILL_KEY] = torch.tensor([[stitched.overlap_rows, stitched.disagreeing_rows]], dtype=torch.int64)
        # the first turn's rows are first-seen for the earliest tokens: its provenance is the routes'
        routes, logprobs = (getattr(responses[0], "r3bridge_provenance", None) if responses else None) or (None, None)
        out.update(provenance_fields([routes], [logprobs]))     # one row each: one trajectory
        return out


# ------------------------------------------------------------------------------------ trainer
class PPOActorMixin:
    """Phases and R2 write-back for AReaL's ``PPOActor``."""

    def compute_logp(self, data: list) -> Any:
        session = getattr(self.engine, "r3", None)
        if session is not None:
            session.result = None                       # never a previous step's recording
        out = super().compute_logp(data)
        if session is not None and session.mode is ReplayMode.R2 and session.replayer is not None:
            # each of AReaL's dicts in place: its trainer passes them on
            write_right_padded(session.recorded_for, data, codec.RECORDED_KEY, framework="AReaL")
        return out

    def _compute_logp(self, data: dict) -> Any:
        return self._r3_phase(Phase.OLD_LOG_PROB, data, lambda: super(PPOActorMixin, self)._compute_logp(data))

    def _ppo_update(self, data: dict) -> Any:
        return self._r3_phase(Phase.UPDATE, data, lambda: super(PPOActorMixin, self)._ppo_update(data))

    def _r3_phase(self, phase: Phase, data: dict, fn):
        eng = self.engine
        for key in (codec.ROUTES_KEY, codec.RECORDED_KEY):
            t = data.get(key)
            if t is not None and t.shape[1] * t.shape[2] == 1:
                # [B, 1, 1, S] has B*S elements: AReaL's splitter would cut it like a per-token field
                raise ConfigError("r3bridge + AReaL: one MoE layer with top-1 is not supported (routes tensor "
                                  "would be split as a per-token field)")
            if t is not None and getattr(eng, "r3", None) is not None:
                eng.r3.check_topk(repr(key), int(t.shape[2]), where="AReaL batch (every sample)")
        # on the batch's device, like every field AReaL's splitter and engine move with it
        data[codec.SAMPLE_KEY] = per_token_sample_ids(data["attention_mask"])
        eng.r3_phase = phase
        # per batch row (named so); the engine keeps each pass's samples (by sample id) for the R3 check
        rows = int(data["attention_mask"].shape[0])
        eng.r3_provenance = pairing_from_fields(data.get, samples=rows, names=row_names(rows), engine=codec.ENGINE,
                                                framework="AReaL")
        try:
            return fn()
        finally:
            eng.r3_phase = None
            eng.r3_provenance = None
            data.pop(codec.SAMPLE_KEY, None)


class MegatronEngineMixin:
    """Per-micro-batch replay for AReaL's ``MegatronEngine`` (set-up: :class:`r3bridge.session.AdapterSession`)."""

    r3_config: Optional[ReplayConfig] = None    # the section, when the trainer sets it before r3_attach
    r3: Optional[AdapterSession] = None
    r3_phase: Optional[Phase] = None
    r3_provenance: Optional[ProvenancePairing] = None       # the actor's batch, per batch row
    r3_pass_provenance: Optional[ProvenancePairing] = None  # the next pass's samples (_prepare_mb_list)

    def initialize(self, *args: Any, **kwargs: Any) -> Any:
        out = super().initialize(*args, **kwargs)
        self.r3_attach(ModelInfo.from_hf_config(self.hf_config), role=kwargs.get("role"))
        return out

    def r3_attach(self, model: ModelInfo, layout=None, role: Optional[str] = None) -> None:
        """``role``: what AReaL's trainer initialised this engine as (the Replayer refuses anything
        but the actor). AReaL's stats tracker exports compute_logp's stats with the step."""
        self.r3 = AdapterSession("areal", self.r3_config, where="AReaL Megatron actor", provide=_PROVIDE)
        self.r3_config = self.r3.config
        check = JobCheck(self.r3.config, "r3bridge", "AReaL engine").all_hidden_layers("SGLang")
        for flag, why in (("enable_tree_training", "tree training packs shared prefixes"),
                          ("is_vision_model", "vision models run on padded [B, S] input"),
                          ("use_padded_seq", "padded (BSHD) models are not wired")):
            check.refuse(getattr(self, flag, False), f"r3bridge + AReaL: {flag} is not supported ({why})")
        check.raise_if_any()
        self.r3.attach(list(self.model), model, layout=layout, role=Role.of(role or "actor"))

    def _r3_log(self, result: Optional[PhaseResult]) -> None:
        """Into AReaL's stats tracker, logged with the actor's stats of the step under the documented
        names (``r3bridge/update/coverage``, outside the actor's scope: the tag carries the phase)."""
        tracker = import_areal("areal.utils.stats_tracker")
        log_areal_metrics(tracker, averaged(self.r3.metrics_to_log(result)), device=getattr(self, "device", None))

    def _r3_plan(self):
        if self.r3 is None or self.r3_phase is None:
            return None
        return self.r3.plan(self.r3_phase)

    def _prepare_mb_list(self, input_: dict) -> Any:
        input_ = dict(input_)
        keys = (codec.ROUTES_KEY, codec.RECORDED_KEY, codec.SAMPLE_KEY, *codec.PROVENANCE_KEYS)
        carried = {k: input_.pop(k) for k in keys if k in input_}
        mb_list = super()._prepare_mb_list(input_)
        self.r3_pass_provenance = None
        plan = self._r3_plan()
        if plan is None:
            return mb_list
        sample = carried.get(codec.SAMPLE_KEY)
        if sample is None:
            raise ConfigError("r3bridge: the batch has no sample ids: wrap the actor in PPOActorMixin")
        key = codec.RECORDED_KEY if plan.route_kind == "recorded" else codec.ROUTES_KEY
        if plan.action is Action.REPLAY:        # R2 records into its own key: rollout routes never collide
            self.r3.check_routes(plan, key in carried, field=key)
        gid_of_row = sample[:, 0].tolist()
        order = [gid_of_row[r] for r in (mb_list.forward_indices or range(len(gid_of_row)))]   # AReaL's packing
        routes = None
        if plan.action is Action.REPLAY:     # each micro-batch's samples of AReaL's tensor, viewed
            routes = functools.partial(codec.handed_routes, carried[key], num_experts=self.r3.model.num_experts,
                                       moe_layer_ids=self.r3.model.moe_layer_ids, route_kind=plan.route_kind)
        packed = [(mb["cu_seqlens"], pmb["cu_seqlens"], mb["input_ids"])
                  for mb, pmb in zip(mb_list.mbs, mb_list.padded_mbs)]
        built = packed_micro_batches(packed, order, routes=routes, uids=self.r3.sample_uids)
        for pmb, item in zip(mb_list.padded_mbs, built):
            pmb[MB_KEY] = item
        if self.r3_provenance is not None:      # this pass's samples: a mini-batch of the actor's batch
            self.r3_pass_provenance = self.r3_provenance.select(order)
        return mb_list

    def forward_backward_batch(self, mb_list: Any, process_output_fn: Any, forward_only: bool = False) -> Any:
        plan = self._r3_plan()
        if plan is None:
            if self.r3_phase is not None and self.r3 is not None:
                self._r3_log(None)               # replay off is logged too: r3bridge/replay_mode = 0
            return super().forward_backward_batch(mb_list, process_output_fn, forward_only)
        items = [pmb.get(MB_KEY) for pmb in mb_list.padded_mbs]
        if any(x is None for x in items):
            raise ReplayStateError("micro-batches without r3bridge targets (built outside _prepare_mb_list?)")
        pairing, self.r3_pass_provenance = self.r3_pass_provenance, None
        with self.r3.run(self.r3_phase, forward_only=forward_only, targets=items, provenance=pairing):
            out = super().forward_backward_batch(mb_list, process_output_fn, forward_only)
        self._r3_log(self.r3.result)
        return out


class RoleEngineMixin:
    """``class M(RoleEngineMixin, MegatronPPOActor)`` for AReaL's other engines (reference, teacher):
    the model declared its role, re-checked before every pass (docs/use-with-areal.md, "Roles")."""

    r3: Optional[AdapterSession] = None

    def initialize(self, *args: Any, **kwargs: Any) -> Any:
        out = super().initialize(*args, **kwargs)
        self.r3_declare_role(kwargs.get("role"))
        return out

    def r3_declare_role(self, role: Optional[str]) -> None:
        self.r3 = declared_session("areal", list(self.model), role or "ref", actor_refused=(
            "RoleEngineMixin is for AReaL's other engines (ref, teacher); the actor replays through r3bridge's "
            "MegatronEngineMixin"))

    def forward_backward_batch(self, *args: Any, **kwargs: Any) -> Any:
        if self.r3 is not None:
            self.r3.check_role()
        return super().forward_backward_batch(*args, **kwargs)


def log_areal_metrics(tracker: Any, values: dict, device: Any = None) -> None:
    """``values`` into AReaL's stats tracker (``areal.utils.stats_tracker``), unscoped: ``*_min`` keys
    as MIN stats over the step's passes and ranks (as verl and SkyRL reduce them by name), every other
    as a scalar (AReaL averages those). ``device``: the engine's: ``export_stats`` all-reduces MIN stats
    over the data-parallel group, which NCCL does only for GPU tensors (None: the host)."""
    mins = {k: v for k, v in values.items() if k.endswith("_min")}
    rest = {k: v for k, v in values.items() if k not in mins}
    with tracker.DEFAULT_TRACKER.disable_scope():
        if rest:
            tracker.scalar(**rest)
        for key, value in mins.items():
            tracker.denominator(**{f"{key}__count": torch.ones(1, dtype=torch.bool, device=device)})
            tracker.stat(denominator=f"{key}__count", reduce_type=tracker.ReduceType.MIN,
                         **{key: torch.tensor([float(value)], dtype=torch.float32, device=device)})


def megatron_ppo_actor_class(config=None):
    """``MegatronPPOActor`` subclass with r3bridge: engine mixin + a ``PPOActorMixin`` actor."""
    check_release("areal", what="'s AReaL adapter")
    ppo = import_areal("areal.trainer.ppo.actor").PPOActor
    actor_cls = checked_subclass("areal", "R3BridgePPOActor", PPOActorMixin, ppo,
                                 ("compute_logp", "_compute_logp", "_ppo_update"))
    section = None if config is None else ReplayConfig.resolve(config)

    def __init__(self, config):
        super(engine_cls, self).__init__(config)
        self.actor = actor_cls(config, self)
    engine_cls = checked_subclass("areal", "R3BridgeMegatronPPOActor", MegatronEngineMixin,
                                  import_areal("areal.engine.megatron_engine").MegatronPPOActor,
                                  ("initialize", "_prepare_mb_list", "forward_backward_batch"),
                                  {"r3_config": section, "__init__": __init__})
    return engine_cls


def megatron_role_engine_class():
    """AReaL's ``MegatronPPOActor`` for a reference / teacher engine, its role declared."""
    me = import_areal("areal.engine.megatron_engine")
    return checked_subclass("areal", "R3BridgeMegatronRoleEngine", RoleEngineMixin, me.MegatronPPOActor,
                            ("initialize", "forward_backward_batch"))


def trainer_class(config=None):
    """``PPOTrainer`` subclass whose actor (never the reference / teacher) is the r3bridge actor.
    SPMD mode only: the single-controller mode builds its workers from AReaL's own class paths."""
    rl = import_areal("areal.trainer.rl_trainer")
    check_internals("areal", [("PPOTrainer._create_train_engine", rl.PPOTrainer, "_create_train_engine")])
    actor_cls = megatron_ppo_actor_class(config)

    class R3BridgePPOTrainer(rl.PPOTrainer):
        def _create_train_engine(self, actor_config, alloc):
            is_actor = actor_config is getattr(getattr(self, "config", None), "actor", None)
            if alloc.backend != "megatron" or (rl.is_single_controller() and not is_actor):
                return super()._create_train_engine(actor_config, alloc)
            if rl.is_single_controller():
                raise ConfigError("r3bridge + AReaL: the single-controller mode is not wired; run SPMD")
            # a reference / teacher engine: AReaL's class, its model's role declared
            engine = actor_cls(config=actor_config) if is_actor else megatron_role_engine_class()(config=actor_config)
            section = replay_section(getattr(self, "config", None)) if is_actor else None   # the YAML's r3bridge:
            if section is not None:     # the actor's session merges it with R3BRIDGE_CONFIG
                engine.r3_config = section
            engine.create_process_group(parallel_strategy=alloc.parallel)
            return engine

    return R3BridgePPOTrainer


def workflow_class(base: type, hf_config) -> type:
    """``base`` (e.g. ``RLVRWorkflow``, ``MultiTurnWorkflow``) with :class:`WorkflowMixin`, for the
    model described by ``hf_config`` (a ``PretrainedConfig``, a config dict, or a path)."""
    return type(f"R3Bridge{base.__name__}", (WorkflowMixin, base), {"r3_model": ModelInfo.from_hf_config(hf_config)})

"""Subclasses / mixins of SkyRL's classes (nothing is monkey-patched) around one
:class:`r3bridge.session.AdapterSession` per model. docs/use-with-skyrl.md, "Formats and hook points"."""
from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

from r3bridge.adapters.skyrl import codec
from r3bridge.adapters.skyrl._compat import import_skyrl, skyrl_release
from r3bridge.adapters.skyrl.handles import HANDLES_KEY, RouteWriter
from r3bridge.adapters.skyrl.replay import SkyRLReplay
from r3bridge.adapters.skyrl.rollout import first_seen_update
from r3bridge.batch.recorded import from_payloads
from r3bridge.config import Phase, ReplayConfig, ReplayMode
from r3bridge.errors import ConfigError, ReplayStateError
from r3bridge.hf import ModelInfo
from r3bridge.megatron.roles import Role
from r3bridge.session.adapter_session import declared_session
from r3bridge.versions import check_internals, checked_subclass

__all__ = ["model_wrapper_class", "PolicyWorkerMixin", "RefWorkerMixin", "TrainerMixin",
           "FirstSeenRoutesMixin", "policy_worker_class", "ref_worker_class", "RECORDED_KEY"]

RECORDED_KEY = "r3bridge_recorded"     # per-sample R2 payload in the worker's loss_fn_outputs


class _Configured:
    r3_config: Optional[ReplayConfig] = None    # the launcher's section (None: R3BRIDGE_CONFIG, else off)

    @property
    def r3_section(self) -> ReplayConfig:
        return ReplayConfig.resolve(self.r3_config)

    @property
    def r3_mode(self) -> ReplayMode:
        return self.r3_section.replay_mode


def model_wrapper_class(base: Optional[type] = None) -> type:
    """``MegatronModelWrapper`` (or ``base``) running its passes in the replay; constructed like
    SkyRL's, plus ``r3_replay=SkyRLReplay(...)``."""
    module = "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper"
    base = base or import_skyrl(module).MegatronModelWrapper
    check_internals("skyrl", [(f"MegatronModelWrapper.{m}", base, m)
                              for m in ("forward", "forward_backward_mini_batch")])

    class R3BridgeMegatronModelWrapper(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, r3_replay: SkyRLReplay, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.r3 = r3_replay

        def forward(self, micro_batches, seq_len, micro_batch_size, temperature: float = 1.0):
            sup = super().forward
            return self.r3.run_micro_batches(Phase.OLD_LOG_PROB, micro_batches, forward_only=True,
                                             call=lambda mbs: sup(mbs, seq_len, micro_batch_size, temperature))

        def forward_backward_mini_batch(self, micro_batches, seq_len, micro_batch_size, temperature: float = 1.0,
                                        loss_fn=None, loss_fn_config=None, forward_only: bool = False, **kwargs):
            # forward_only: SkyRL's loss-only evaluation (the update's routes); kwargs: 0.4's return_per_token_outputs
            sup = super().forward_backward_mini_batch
            return self.r3.add_metrics(self.r3.run_micro_batches(
                Phase.UPDATE, micro_batches, forward_only=forward_only,
                call=lambda mbs: sup(mbs, seq_len, micro_batch_size, temperature, loss_fn=loss_fn,
                                     loss_fn_config=loss_fn_config, forward_only=forward_only, **kwargs)))

    return R3BridgeMegatronModelWrapper


class RefWorkerMixin:
    """``class MyRefWorker(RefWorkerMixin, MegatronRefWorkerBase)``: declared the reference, never
    replays (NeMo RL #4083); a replay object on its routers raises a ``RoleError``."""

    def init_model(self, *args, **kwargs):
        out = super().init_model(*args, **kwargs)
        self.r3 = declared_session("skyrl", self.actor_module, Role.REFERENCE)
        return out

    def forward(self, data, *args, **kwargs):
        self.r3.check_role()
        return super().forward(data, *args, **kwargs)


class PolicyWorkerMixin(_Configured):
    """``class MyPolicyWorker(PolicyWorkerMixin, MegatronPolicyWorkerBase)``; ``r3_config``: set by
    :func:`policy_worker_class`."""

    def init_configs(self, model_path, megatron_config, *args, **kwargs):
        mc = copy.copy(megatron_config)
        mc.moe_enable_routing_replay = False       # megatron's RouterReplay + SkyRL's patches stay off
        return super().init_configs(model_path, mc, *args, **kwargs)

    def init_model(self, *args, **kwargs):
        out = super().init_model(*args, **kwargs)
        replay = SkyRLReplay(self.actor_module, self.r3_config, ModelInfo.from_hf_config(self.strategy.hf_config),
                             where="SkyRL policy worker")
        self.r3_config = replay.session.config
        w = self.model
        self.model = model_wrapper_class(type(w))(config=w.cfg, actor_module=w.actor_module,
                                                  actor_optimizer=w.actor_optimizer, policy_loss_fn=w.policy_loss_fn,
                                                  is_vlm=w.is_vlm, r3_replay=replay)
        # SkyRL copies rollout_expert_indices into its micro-batches only with this flag on
        self.enable_router_replay = self.r3_config.replay_mode is not ReplayMode.OFF
        return out

    def forward(self, data, loss_fn=None, loss_fn_config=None, **kwargs):
        # kwargs: SkyRL 0.4's return_per_token_outputs, passed through
        with self._r3_provenance(data), self.model.r3.handles_from(data.metadata):
            if self.r3_mode is not ReplayMode.R2 or loss_fn is not None:
                return super().forward(data, loss_fn=loss_fn, loss_fn_config=loss_fn_config, **kwargs)
            r3 = self.model.r3
            # the sample ids travel in rollout_expert_indices, the one per-sample field SkyRL copies into
            # its micro-batches
            with r3.sample_ids_in(data, codec.ROUTES_KEY, *data["attention_mask"].shape):
                out = super().forward(data, loss_fn=loss_fn, loss_fn_config=loss_fn_config, **kwargs)
            r3.record_into(lambda: out.loss_fn_outputs, RECORDED_KEY)     # per sample, as SkyRL carries outputs
            return out

    def _r3_provenance(self, data):     # the pass's route / log-prob provenance (R3), for this call only
        return self.model.r3.providing(codec.provenance_pairing(data) if self.r3_mode is ReplayMode.R3 else None)

    def forward_backward(self, data, loss_fn=None, loss_fn_config=None, **kwargs):
        mark = (data.metadata or {}).get(codec.ROUTES_MARK)
        if self.r3_mode is ReplayMode.R2 and mark != "recorded":
            raise ConfigError("replay_mode=R2: this batch does not carry the routes recorded in compute_log_prob "
                              "(use r3bridge's TrainerMixin; verl 0.9.1 silently replayed rollout routes here)")
        self.model.r3.route_kind = "recorded" if mark == "recorded" else "rollout"
        with self._r3_provenance(data), self.model.r3.handles_from(data.metadata):
            return super().forward_backward(data, loss_fn=loss_fn, loss_fn_config=loss_fn_config, **kwargs)


class TrainerMixin(_Configured):
    """``class MyTrainer(TrainerMixin, RayPPOTrainer)``: R2's recorded routes go back into the batch;
    with ``route_transport: handles`` each sample's routes are written once and the batch carries
    handles (:mod:`r3bridge.adapters.skyrl.handles`), released when the step's training ends."""

    r3_routes_dir: Optional[str] = None  # overrides the section's route_store folder (tests)
    _r3_writer: Optional[RouteWriter] = None
    _r3_fwd_handles: Any = None          # the handles compute_log_prob's batch (SkyRL's select) dropped

    def _r3_route_writer(self) -> Optional[RouteWriter]:
        """The job's route store (``route_transport: handles``, replay on), made once."""
        rc = self.r3_section
        if rc.route_transport != "handles" or rc.replay_mode is ReplayMode.OFF:
            return None
        if self._r3_writer is None:
            self._r3_writer = RouteWriter(rc, directory=self.r3_routes_dir)
        return self._r3_writer

    def _r3_model(self) -> ModelInfo:
        return ModelInfo.from_hf_config(self.cfg.trainer.policy.model.path)

    def convert_to_training_input(self, generator_output, uids):
        writer = self._r3_route_writer()
        if writer is None or self.r3_mode is not ReplayMode.R3:
            return super().convert_to_training_input(generator_output, uids)
        # the routes are written once, here; SkyRL never builds their dense field
        routes = generator_output.get(codec.ROUTES_KEY)
        out = super().convert_to_training_input({**generator_output, codec.ROUTES_KEY: None}, uids)
        writer.write_rollout(out, routes, uids, step=self.global_step, model=self._r3_model())
        return out

    def train_critic_and_policy(self, data):
        try:
            return super().train_critic_and_policy(data)
        finally:                                  # the step's training ended (or failed): its routes go
            if self._r3_writer is not None:
                self._r3_writer.release(self.global_step)

    def _execute_forward_pass(self, model, data_fwd_pass, key, mini_batch_boundaries):
        if model == "policy" and self._r3_fwd_handles is not None:
            # the policy's batch only (a view of the same fields): the other models' never carry handles
            data_fwd_pass = data_fwd_pass.select(keys=list(data_fwd_pass.keys()))
            data_fwd_pass.metadata = {**(data_fwd_pass.metadata or {}), HANDLES_KEY: self._r3_fwd_handles}
        if model != "policy" or self.r3_mode is not ReplayMode.R2:
            return super()._execute_forward_pass(model, data_fwd_pass, key, mini_batch_boundaries)
        to_tensor = import_skyrl("skyrl.backends.skyrl_train.distributed.dispatch").loss_fn_outputs_to_tensor
        outputs: list = []
        if self.cfg.trainer.recompute_old_logprobs_per_minibatch and mini_batch_boundaries:
            for refs in self.dispatch.stage_data(model, data_fwd_pass, mini_batch_boundaries):
                outputs.extend(self.dispatch.forward_from_staged(model, refs).loss_fn_outputs)
        else:
            outputs = list(self.dispatch.forward(model, data_fwd_pass).loss_fn_outputs)
        self._r3_recorded = from_payloads([o.pop(RECORDED_KEY) for o in outputs])
        return to_tensor(outputs, key=key)

    def fwd_logprobs_values_reward(self, training_input):
        self._r3_recorded = None
        self._r3_fwd_handles = (training_input.metadata or {}).get(HANDLES_KEY)
        try:
            out = super().fwd_logprobs_values_reward(training_input)
        finally:
            self._r3_fwd_handles = None
        rec = self._r3_recorded
        if self.r3_mode is ReplayMode.R2:
            if rec is None:
                raise ReplayStateError("replay_mode=R2 but the policy forward recorded no routes (skipped forward? "
                                       "LOSSES_WITHOUT_OLD_LOGPROBS cannot be combined with R2)")
            writer = self._r3_route_writer()
            if writer is not None:      # written once; the batch carries handles, marked "recorded"
                writer.write_recorded(training_input, rec, training_input.metadata.get("uids") or [],
                                      step=self.global_step)
                return out
            n = self._r3_model().num_layers
            # in the installed release's layout (0.3 dense, 0.4 PackedTensor), marked "recorded"
            codec.SkyRLCodec(num_experts=rec.num_experts, moe_layer_ids=rec.layer_ids,
                       num_hidden_layers=n).write_recorded(training_input, rec)
        return out


class FirstSeenRoutesMixin:
    """``class MyGenerator(FirstSeenRoutesMixin, SkyRLGymGenerator)``: each turn's routes merged
    first-seen into earlier turns' rows (SkyRL 0.3.0 replaces them); refused under 0.4, whose
    generator does it itself (``RoutedExpertTrace``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if skyrl_release() == "0.4":
            raise ConfigError("SkyRL 0.4's generator keeps first-seen multi-turn routes itself (RoutedExpertTrace); "
                              "use SkyRLGymGenerator without r3bridge's FirstSeenRoutesMixin")
        super().__init__(*args, **kwargs)

    def _update_agent_loop_state_with_multiturn_chat_template(self, agent_loop_state, turn_output):
        sup = super()._update_agent_loop_state_with_multiturn_chat_template
        return first_seen_update(sup, agent_loop_state, turn_output, codec.ROUTES_KEY)

    def _update_agent_loop_state_with_singleturn_chat_template(self, agent_loop_state, turn_output):
        sup = super()._update_agent_loop_state_with_singleturn_chat_template
        return first_seen_update(sup, agent_loop_state, turn_output, codec.ROUTES_KEY)


def _worker_class(name: str, mixin: type, base: str, methods: Sequence[str], num_gpus: int, attrs=None):
    import ray

    module = import_skyrl("skyrl.backends.skyrl_train.workers.megatron.megatron_worker")
    return ray.remote(num_gpus=num_gpus)(checked_subclass("skyrl", name, mixin, getattr(module, base), methods, attrs))


def policy_worker_class(config=None, num_gpus: int = 1):
    """The Ray actor class to pass to ``RayPPOTrainer.build_models`` as ``PolicyWorker``."""
    return _worker_class("R3BridgeMegatronPolicyWorker", PolicyWorkerMixin, "MegatronPolicyWorkerBase",
                         ("init_configs", "init_model", "forward", "forward_backward"), num_gpus,
                         {"r3_config": None if config is None else ReplayConfig.resolve(config)})


def ref_worker_class(num_gpus: int = 1):
    """The Ray actor class to pass to ``RayPPOTrainer.build_models`` as ``RefWorker``."""
    return _worker_class("R3BridgeMegatronRefWorker", RefWorkerMixin, "MegatronRefWorkerBase",
                         ("init_model", "forward"), num_gpus)

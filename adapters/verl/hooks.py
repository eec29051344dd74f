"""The engine r3bridge registers (only when the job asks for replay): verl's
``MegatronEngineWithLMHead`` translating each batch for the driver (:class:`r3bridge.session.AdapterSession`).
Phases: the reference engine and LoRA-adapter-disabled passes are ``ref_log_prob``, other
forward-only passes ``compute_log_prob``, passes with a backward ``update``. With
``route_transport: handles`` the routes come as route handles (:mod:`.route_handles`: each rank
reads its rows of its stage's layers; R2's recording goes back as handles; the step's files are
released after its last update pass). docs/use-with-verl.md, "How it hooks into verl".
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from verl.models.mcore.util import preprocess_thd_engine
from verl.utils import tensordict_utils as tu
from verl.utils.megatron_utils import unwrap_model
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
from verl.workers.utils.padding import no_padding_2_padding

from r3bridge.adapters.verl import engine_pass
from r3bridge.adapters.verl.codec import LOG_RATIO_KEY, ROUTES_KEY, SAMPLE_KEY, handed_routes, provenance_pairing
from r3bridge.adapters.verl.config import check_engine_config
from r3bridge.adapters.verl.nested import nested_like, nested_routes
from r3bridge.adapters.verl.route_handles import HANDLE_KEY, RECORDED_HANDLE_KEY, RouteHandles, uses_handles
from r3bridge.adapters.verl.watch import report
from r3bridge.config import Action, Phase
from r3bridge.megatron.roles import Role
from r3bridge.session.adapter_session import AdapterSession

__all__ = ["R3BridgeMegatronEngine"]

# the verl setting that supplies the routes of each kind, and the one that keeps rollout routes out
_PROVIDE = {"rollout": "enable actor_rollout_ref.rollout.enable_rollout_routing_replay",
            "recorded": "R2 records them in compute_log_prob: keep algorithm.rollout_correction.bypass_mode=False",
            "off": "set actor_rollout_ref.rollout.enable_rollout_routing_replay=False"}


class R3BridgeMegatronEngine(MegatronEngineWithLMHead):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.r3_init_state(None)        # the launcher's R3BRIDGE_CONFIG
        if self.r3.replays:
            check_engine_config(self.r3.config, self.engine_config, hf_config=self.model_config.hf_config)

    def r3_init_state(self, cfg) -> None:
        """The session: the reference engine's model is declared the reference; verl's trainer
        drops compute_log_prob's metrics, so they are logged with the update."""
        ref = bool(getattr(self.engine_config, "forward_only", False))
        self.r3 = AdapterSession("verl", cfg, where="verl reference engine" if ref else "verl engine",
                                 role=Role.REFERENCE if ref else Role.ACTOR, provide=_PROVIDE,
                                 carry_log_prob_metrics=True, route_transports=("inline", "handles"))
        # routes by reference (route_transport: handles): the pass's handles, and the step's to release
        self._r3_handles = RouteHandles(self.r3.config) if uses_handles(self.r3.config) and self.r3.replays else None
        self._r3_pass = None              # the open ReplayPass while verl's schedule runs
        self._r3_adapter_off = 0          # >0 inside disable_adapter(): LoRA reference pass

    # ------------------------------------------------------------------------------ set-up
    def initialize(self) -> None:
        super().initialize()
        self.r3_attach()
        if self.r3.replays:
            report("engine_ready")      # the launcher's stall watchdog: this stage is done

    def r3_attach(self) -> None:
        """Check the engine's settings and attach the session to the built model."""
        hf = self.model_config.hf_config
        if self.r3.replays:
            check_engine_config(self.r3.config, self.engine_config, hf_config=hf, tf_config=self.tf_config,
                                cp_layout=self._get_context_parallel_layout(unwrap_model(self.module[0])))
        self.r3.attach(self.module, hf)

    @contextlib.contextmanager
    def disable_adapter(self):
        self._r3_adapter_off += 1       # a LoRA reference pass: routes natively
        try:
            with super().disable_adapter():
                yield
        finally:
            self._r3_adapter_off -= 1

    # ------------------------------------------------------------------------------ phases
    def r3_phase(self, forward_only: bool) -> Phase:
        if self._r3_adapter_off or self.r3.role is not Role.ACTOR:
            return Phase.REF_LOG_PROB
        return Phase.OLD_LOG_PROB if forward_only else Phase.UPDATE

    def forward_backward_batch(self, data, loss_function: Callable, forward_only: bool = False) -> Any:
        phase = self.r3_phase(forward_only)
        routes = data.get(ROUTES_KEY, None)
        field = ROUTES_KEY
        by_reference = self._r3_handles is not None and phase is not Phase.REF_LOG_PROB and \
            self._r3_handles.take(data)
        if by_reference:
            routes, field = self._r3_handles.batch, f"route handles ({HANDLE_KEY} / {RECORDED_HANDLE_KEY})"
        plan = engine_pass.checked_plan(self.r3, phase, routes, field=field, where=f"the {phase.value} batch")
        if plan is None:
            return super().forward_backward_batch(data, loss_function, forward_only)
        if plan.action is Action.REPLAY:
            if by_reference:
                self._r3_handles.check_topk(self.r3, where=f"the {phase.value} batch")
            else:
                self._r3_check_topk(data, phase)
        # the batch-level sample index travels with each sample through verl's micro-batching:
        # R2 records by it, and route errors name the sample by it (not its micro-batch position)
        data[SAMPLE_KEY] = torch.arange(len(data), dtype=torch.int64)
        try:
            # R3: routes whose engine pass differs from their log-probs' are counted or refused
            # (provenance_check) before the schedule starts
            pairing = provenance_pairing(data) if plan.action is Action.REPLAY else None
            with self.r3.run(phase, forward_only=forward_only, provenance=pairing) as phase_pass:
                self._r3_pass = phase_pass
                output = super().forward_backward_batch(data, loss_function, forward_only)
        finally:
            self._r3_pass = None
            data.pop(SAMPLE_KEY, None)
        if by_reference:        # after the step's last update pass its routes are released
            self._r3_handles.pass_done(update=phase is Phase.UPDATE, releases=self.is_mp_src_rank_with_outputs(),
                                       last_of_step=bool(tu.get(data, "update_lr_scheduler", default=False)))
        report("first_pass")
        if not output:                                  # not the last pipeline stage
            return output
        if plan.action is Action.RECORD and self._r3_handles is not None:
            # routes by reference: the recording stored once, only its handles go back to verl
            output.setdefault("model_output", {})[RECORDED_HANDLE_KEY] = self._r3_handles.store_recorded(
                self.r3.recorded_for(len(data)), data)
        elif plan.action is Action.RECORD:
            output.setdefault("model_output", {})[ROUTES_KEY] = nested_routes(self.r3.recorded_for(len(data)))
        logp = (output.get("model_output") or {}).get("log_probs")
        rollout_logp = data.get("rollout_log_probs", None)
        # the trainer-vs-rollout log-prob mismatch, in verl's padded response layout
        padded = None if logp is None or rollout_logp is None else no_padding_2_padding(logp, data)
        engine_pass.extend_pass_metrics(output.setdefault("metrics", {}), self.r3, phase, log_probs=padded,
                                         rollout_log_probs=rollout_logp, response_mask=data.get("response_mask", None))
        return output

    def _r3_check_topk(self, data, phase: Phase) -> None:
        engine_pass.check_route_width(self.r3, data.get(ROUTES_KEY, None), field=ROUTES_KEY,
                                       where=f"the {phase.value} batch")

    # ------------------------------------------------------------------------------ per micro-batch
    def forward_step(self, batch_iter: Iterator, model, logits_processor_func, postprocess_micro_batch_func):
        if self._r3_pass is None:
            return super().forward_step(batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
        batch = next(batch_iter)
        index = self.r3_install(batch, model)
        output, loss = super().forward_step(iter((batch,)), model, logits_processor_func, postprocess_micro_batch_func)

        def hand_over(per_seq) -> None:        # the loss's router_log_ratio, nested like input_ids
            batch[LOG_RATIO_KEY] = nested_like(per_seq, batch["input_ids"])
        return output, engine_pass.loss_after_routers(loss, self._r3_pass, model, index, hand_over)

    def r3_install(self, batch, model) -> int:
        """Install this (chunk, micro-batch)'s targets (REPLAY) or recording slot (RECORD). Under
        VPP the micro-batch is decoded and its packing read by its first chunk's install only."""
        return self._r3_pass.install(model, lambda: self.r3_micro_batch(batch, model))

    def r3_micro_batch(self, batch, model):
        """verl's micro-batch as the driver installs it, with its routes (REPLAY) and the
        batch-level sample index (R2 records by it, traces and route errors name samples by it)."""
        routes = None
        if self._r3_pass.action is Action.REPLAY and self._r3_handles is not None and self._r3_handles.batch:
            # routes by reference: the micro-batch's handles; the driver's read of each chunk reads
            # this rank's rows of the chunk's layers from the store, every byte checked
            routes = self._r3_handles.micro_batch(batch[SAMPLE_KEY].tolist(), batch["input_ids"].offsets().diff().tolist())
        elif self._r3_pass.action is Action.REPLAY:
            # verl's nested values viewed (nothing copied; their width was checked for the whole
            # batch before the schedule): the driver's reader reads this rank's rows once
            m = self.r3.model
            routes = handed_routes(batch, moe_layer_ids=m.moe_layer_ids, num_experts=m.num_experts,
                                   route_kind=self._r3_pass.plan.route_kind, num_hidden_layers=m.num_layers,
                                   layer_axis=self.r3.config.layer_axis)
        return engine_pass.nested_micro_batch(
            self.r3, batch["input_ids"], routes=routes, sample_ids=batch[SAMPLE_KEY].tolist(),
            cu_seqlens_padded=self.r3_cu_seqlens_padded(batch["input_ids"], model))

    def r3_cu_seqlens_padded(self, input_ids, model) -> torch.Tensor:
        """The trainer's real THD packing: verl's own ``preprocess_thd_engine`` metadata."""
        unwrapped = unwrap_model(model)
        fp8 = getattr(unwrapped.config, "fp8", None)
        _, params, _ = preprocess_thd_engine(input_ids, pre_process=False,
                                             use_fp8_padding=fp8 in ("e4m3", "hybrid"),
                                             cp_layout=self._get_context_parallel_layout(unwrapped))
        return params.cu_seqlens_q_padded.cpu()

"""The engine r3bridge registers (only when the job asks for replay): verl's
``MegatronEngineWithLMHead`` plus the driver (:class:`r3bridge.megatron.AdapterSession`).

It overrides ``initialize`` (attach), ``forward_backward_batch`` (one pass: verl's schedule inside
the session's pass, R2's recorded routes and the metrics into verl's output), ``forward_step``
(install each (chunk, micro-batch)) and ``disable_adapter`` (a LoRA reference pass never replays).
Phases: the reference engine and passes with the LoRA adapter disabled are ``ref_log_prob``,
other forward-only passes ``compute_log_prob``, passes with a backward ``update``.
docs/use-with-verl.md, "How it hooks into verl".
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
from verl.workers.utils.padding import no_padding_2_padding

from r3bridge.adapters.verl.codec import (
    LOG_RATIO_KEY,
    ROUTES_KEY,
    SAMPLE_KEY,
    handed_routes,
    provenance_pairing,
    routes_to_nested,
)
from r3bridge.adapters.verl.config import check_engine_config
from r3bridge.config import Action, Phase
from r3bridge.launch.ray_watch import report
from r3bridge.megatron.phase import MicroBatch, phase_tag
from r3bridge.megatron.roles import Role
from r3bridge.megatron.session import AdapterSession
from r3bridge.metrics import logprob_mismatch

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
                                 carry_log_prob_metrics=True)
        self._r3_pass = None              # the open PhasePass while verl's schedule runs
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
                                cp_layout=self._get_context_parallel_layout(_unwrap(self.module[0])))
        self.r3.attach(self.module, hf)

    def disable_adapter(self):
        return _counting(self, super().disable_adapter())

    # ------------------------------------------------------------------------------ phases
    def r3_phase(self, forward_only: bool) -> Phase:
        if self._r3_adapter_off or self.r3.role is not Role.ACTOR:
            return Phase.REF_LOG_PROB
        return Phase.OLD_LOG_PROB if forward_only else Phase.UPDATE

    def forward_backward_batch(self, data, loss_function: Callable, forward_only: bool = False) -> Any:
        phase = self.r3_phase(forward_only)
        plan = self.r3.plan(phase)
        if plan is None:
            return super().forward_backward_batch(data, loss_function, forward_only)
        self.r3.check_routes(plan, data.get(ROUTES_KEY, None) is not None, field=ROUTES_KEY,
                             where=f"the {phase.value} batch")
        if plan.action is Action.REPLAY:
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
        report("first_pass")
        if not output:                                  # not the last pipeline stage
            return output
        if plan.action is Action.RECORD:
            output.setdefault("model_output", {})[ROUTES_KEY] = routes_to_nested(self.r3.recorded_for(len(data)))
        extra = self._r3_logprob_metrics(output, data, phase_tag(phase))
        for k, v in self.r3.metrics_to_log(self.r3.result, extra).items():
            output.setdefault("metrics", {}).setdefault(k, []).extend(v)
        return output

    def _r3_check_topk(self, data, phase: Phase) -> None:
        routes = data.get(ROUTES_KEY, None)
        if routes is not None:
            width = int(routes.values().shape[-1] if getattr(routes, "is_nested", False) else routes.shape[-1])
            self.r3.check_topk(ROUTES_KEY, width, where=f"the {phase.value} batch")

    def _r3_logprob_metrics(self, output: dict, data, tag: str) -> dict[str, float]:
        """Trainer-vs-rollout log-prob mismatch of this pass, in verl's padded response layout."""
        prefix = self.r3.config.metrics_prefix
        out: dict[str, float] = {}
        logp = (output.get("model_output") or {}).get("log_probs")
        if logp is not None and data.get("rollout_log_probs", None) is not None:
            train = no_padding_2_padding(logp, data).float()
            rollout = _padded(data["rollout_log_probs"], train).float()
            mask = _padded(data["response_mask"], train).bool()
            if train.shape == rollout.shape == mask.shape:
                # verl's padded response layout: column j is response token j for both, the last
                # sampled token included (its logits come from the row before): nothing to drop.
                out.update(logprob_mismatch(train, rollout, mask, exclude_last=False, prefix=f"{prefix}{tag}/"))
        return out

    # ------------------------------------------------------------------------------ per micro-batch
    def forward_step(self, batch_iter: Iterator, model, logits_processor_func, postprocess_micro_batch_func):
        if self._r3_pass is None:
            return super().forward_step(batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
        batch = next(batch_iter)
        index = self.r3_install(batch, model)
        output, loss = super().forward_step(iter((batch,)), model, logits_processor_func, postprocess_micro_batch_func)
        if not (self.r3.config.router_log_ratio and self._r3_pass.action is Action.REPLAY):
            return output, loss
        phase_pass = self._r3_pass

        def loss_with_log_ratio(*args: Any, **kwargs: Any) -> Any:
            # the loss runs after this chunk's forward: every router of the micro-batch has run
            batch[LOG_RATIO_KEY] = log_ratio_field(phase_pass.router_log_ratio_tokens(model, index), batch["input_ids"])
            return loss(*args, **kwargs)
        return output, loss_with_log_ratio

    def r3_install(self, batch, model) -> int:
        """Install this (chunk, micro-batch)'s targets (REPLAY) or recording slot (RECORD)."""
        input_ids = batch["input_ids"]
        seq_lens = input_ids.offsets().diff().tolist()
        routes = None
        # every pass carries the batch-level sample index: R2 records by it, traces and route
        # errors name samples by it
        sample_ids = batch[SAMPLE_KEY].tolist()
        if self._r3_pass.action is Action.REPLAY:
            # verl's nested values viewed (nothing copied or checked here): the driver's reader
            # reads this rank's rows once per micro-batch, whichever chunk installs first
            m = self.r3.model
            routes = handed_routes(batch, moe_layer_ids=m.moe_layer_ids, num_experts=m.num_experts,
                                   route_kind=self._r3_pass.plan.route_kind, num_hidden_layers=m.num_layers, topk=m.topk,
                                   layer_axis=self.r3.config.layer_axis)
        return self._r3_pass.install(model, MicroBatch(seq_lens, routes, sample_ids, format="thd",
                                                       cu_seqlens_padded=self.r3_cu_seqlens_padded(input_ids, model),
                                                       uids=self.r3.sample_uids(input_ids.unbind())))

    def r3_cu_seqlens_padded(self, input_ids, model) -> torch.Tensor:
        """The trainer's real THD packing: verl's own ``preprocess_thd_engine`` metadata."""
        from verl.models.mcore.util import preprocess_thd_engine

        unwrapped = _unwrap(model)
        fp8 = getattr(unwrapped.config, "fp8", None)
        _, params, _ = preprocess_thd_engine(input_ids, pre_process=False,
                                             use_fp8_padding=fp8 in ("e4m3", "hybrid"),
                                             cp_layout=self._get_context_parallel_layout(unwrapped))
        return params.cu_seqlens_q_padded.cpu()


def log_ratio_field(per_seq: Optional[list[torch.Tensor]], input_ids: torch.Tensor) -> torch.Tensor:
    """The loss's ``router_log_ratio``, nested like verl's jagged ``input_ids``; zeros where the
    chunk replayed nothing with weights (``per_seq`` ``None``: no MoE layer), not a loss error."""
    device = input_ids.values().device
    if per_seq is None:
        per_seq = [torch.zeros(int(n), dtype=torch.float32) for n in input_ids.offsets().diff().tolist()]
    return torch.nested.as_nested_tensor([t.to(device) for t in per_seq], layout=torch.jagged)


def _padded(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-response field as ``like``'s padded ``[batch, max_response]`` (TransferQueue keeps it nested)."""
    x = x.to(like.device)
    if getattr(x, "is_nested", False):
        x = x.to_padded_tensor(0, output_size=tuple(like.shape))
    return x


def _unwrap(model):
    from verl.utils.megatron_utils import unwrap_model
    return unwrap_model(model)


@contextlib.contextmanager
def _counting(engine: R3BridgeMegatronEngine, ctx):
    engine._r3_adapter_off += 1
    try:
        with ctx:
            yield
    finally:
        engine._r3_adapter_off -= 1


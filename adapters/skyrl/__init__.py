"""r3bridge for SkyRL 0.3.x: ``replay_mode: R2 | R3 | off`` on SkyRL's Megatron backend.

Generator side (:mod:`.ingest`): vLLM ``CompletionOutput.routed_experts`` / SkyRL's JSON lists /
base64 ``.npy`` payloads -> :class:`r3bridge.ReplayBatch`; multi-turn calls stitched first-seen
(:func:`rollout_routes`, and :class:`FirstSeenRoutesMixin` for ``SkyRLGymGenerator``, which
otherwise keeps only the last turn's routes).

Trainer side (:mod:`.trainer`): ``TrainingInputBatch`` fields ``rollout_expert_indices`` +
``router_padding_mask`` <-> ReplayBatch, and subclasses of SkyRL's own classes:
``MegatronModelWrapper`` (per-micro-batch install, R3 and R2, VPP), ``MegatronPolicyWorkerBase``
(:class:`PolicyWorkerMixin`) and ``RayPPOTrainer`` (:class:`TrainerMixin`, R2 write-back). What
SkyRL lacks and this adds: R2, VPP, first-seen multi-turn routes, validity instead of zero rows.

Configuration: the same ``r3bridge`` section as every adapter (:class:`r3bridge.config.ReplayConfig`),
passed explicitly or through ``R3BRIDGE_CONFIG`` (JSON) / ``R3BRIDGE_REPLAY_MODE``.
See docs/use-with-skyrl.md.
"""
from __future__ import annotations

from typing import Optional

from r3bridge.adapters.skyrl.ingest import (
    MASK_KEY,
    ROUTES_KEY,
    decode_routed_experts,
    make_router_padding_mask,
    merge_first_seen,
    replay_batch_from_training_batch,
    rollout_routes,
    training_batch_fields,
)
from r3bridge.adapters.skyrl.trainer import (
    PolicyWorkerMixin,
    SkyRLReplay,
    TrainerMixin,
    model_wrapper_class,
    replay_config,
)

__all__ = ["ROUTES_KEY", "MASK_KEY", "decode_routed_experts", "rollout_routes", "merge_first_seen",
           "replay_batch_from_training_batch", "training_batch_fields", "make_router_padding_mask",
           "SkyRLReplay", "model_wrapper_class", "PolicyWorkerMixin", "TrainerMixin", "replay_config",
           "FirstSeenRoutesMixin", "policy_worker_class", "SkyRLCodec"]


class FirstSeenRoutesMixin:
    """``class MyGenerator(FirstSeenRoutesMixin, SkyRLGymGenerator)``: SkyRL 0.3.0 replaces a
    sample's routes with each turn's (``agent_loop_state.rollout_expert_indices =
    turn_output.rollout_expert_indices``); this keeps the rows earlier turns returned (the routes
    that sampled those tokens) and appends only the new rows."""

    def _update_agent_loop_state_with_multiturn_chat_template(self, agent_loop_state, turn_output):
        prev = agent_loop_state.rollout_expert_indices
        state = super()._update_agent_loop_state_with_multiturn_chat_template(agent_loop_state, turn_output)
        if state.rollout_expert_indices is not None:
            state.rollout_expert_indices = merge_first_seen(prev, turn_output.rollout_expert_indices)
        return state

    def _update_agent_loop_state_with_singleturn_chat_template(self, agent_loop_state, turn_output):
        prev = agent_loop_state.rollout_expert_indices
        state = super()._update_agent_loop_state_with_singleturn_chat_template(agent_loop_state, turn_output)
        if state.rollout_expert_indices is not None:
            state.rollout_expert_indices = merge_first_seen(prev, turn_output.rollout_expert_indices)
        return state


def policy_worker_class(config=None, num_gpus: int = 1):
    """The Ray actor class to pass to ``RayPPOTrainer.build_models`` as ``PolicyWorker``."""
    import ray

    from r3bridge.adapters.skyrl._compat import import_skyrl
    base = import_skyrl("skyrl.backends.skyrl_train.workers.megatron.megatron_worker").MegatronPolicyWorkerBase
    cls = type("R3BridgeMegatronPolicyWorker", (PolicyWorkerMixin, base),
               {"r3_config": None if config is None else replay_config(config)})
    return ray.remote(num_gpus=num_gpus)(cls)


class SkyRLCodec:
    """The :class:`r3bridge.protocols.BatchCodec` of SkyRL's ``TrainingInputBatch`` (used by the
    conformance suite and by anything that moves routes in and out of SkyRL batches)."""

    def __init__(self, *, num_experts: int, moe_layer_ids, num_hidden_layers: int) -> None:
        self.num_experts = int(num_experts)
        self.moe_layer_ids = list(moe_layer_ids)
        self.num_hidden_layers = int(num_hidden_layers)

    def to_replay_batch(self, native, *, source: str = "rollout"):
        return replay_batch_from_training_batch(
            native, num_experts=self.num_experts, moe_layer_ids=self.moe_layer_ids,
            num_hidden_layers=None if source == "recorded" else self.num_hidden_layers, source=source)

    def write_recorded(self, native, recorded):
        for k, v in training_batch_fields(recorded, native["attention_mask"],
                                          num_hidden_layers=self.num_hidden_layers).items():
            native[k] = v
        if getattr(native, "metadata", None) is None:
            native.metadata = {}
        native.metadata["r3bridge_routes"] = "recorded"
        return native

    def seq_lens(self, native) -> list[int]:
        return native["attention_mask"].sum(-1).long().tolist()

    def split(self, native, num_parts: int, order: Optional[list[int]] = None):
        """SkyRL's ``TensorBatch.chunk`` (its micro-batching), after an optional sample permutation
        (what dynamic sampling / shuffling would do to the batch)."""
        b = native.batch_size
        idx = list(range(b)) if order is None else list(order)
        src = native
        if order is not None:
            import torch
            t = torch.tensor(idx)
            src = type(native)({k: (None if v is None else v[t]) for k, v in native.items()})
            src.metadata = native.metadata
        size = -(-b // num_parts)
        parts = src.chunk(size)
        return [(p, idx[i * size:(i + 1) * size]) for i, p in enumerate(parts)]

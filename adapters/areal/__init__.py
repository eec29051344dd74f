"""r3bridge for AReaL 1.0.x: ``replay_mode: R2 | R3 | off`` on AReaL's Megatron engine.

Rollout side: SGLang ``meta_info["routed_experts"]`` (base64 int32) -> :class:`r3bridge.ReplayBatch`
with resubmit dedupe (:class:`SGLangEngineMixin`; AReaL 1.0.4 concatenates every attempt's
routes, duplicating the prefix) and parent-concat multi-turn stitching (:class:`WorkflowMixin`,
:func:`routes_from_responses`), first-seen rows kept.

Trainer side: :class:`PPOActorMixin` around ``compute_logp`` / ``ppo_update`` (phases, R2
write-back into the trajectory dicts) and :class:`MegatronEngineMixin` around
``MegatronEngine._prepare_mb_list`` / ``forward_backward_batch`` (one explicit ReplayBatch slice
per micro-batch, per-(chunk, micro-batch) install: VPP works). R3 and R2.

Configuration: the same ``r3bridge`` section as every adapter (:class:`r3bridge.config.ReplayConfig`),
explicit (``engine.r3_config``) or through ``R3BRIDGE_CONFIG`` (JSON) / ``R3BRIDGE_REPLAY_MODE``.
See docs/use-with-areal.md.
"""
from __future__ import annotations

from typing import Optional

from r3bridge.adapters.areal.engine import (
    MegatronEngineMixin,
    ModelInfo,
    PPOActorMixin,
    RecordingBackend,
    SGLangEngineMixin,
    WorkflowMixin,
    replay_config,
)
from r3bridge.adapters.areal.ingest import (
    RECORDED_KEY,
    ROUTES_KEY,
    SAMPLE_KEY,
    batch_tensor,
    decode_sglang,
    first_seen_rows,
    replay_batch_from_batch,
    replay_batch_from_tensor,
    routes_from_attempts,
    routes_from_responses,
    trajectory_tensor,
)

__all__ = ["ROUTES_KEY", "RECORDED_KEY", "SAMPLE_KEY", "decode_sglang", "first_seen_rows", "routes_from_attempts",
           "routes_from_responses", "trajectory_tensor", "replay_batch_from_batch", "replay_batch_from_tensor",
           "batch_tensor", "ModelInfo", "SGLangEngineMixin", "RecordingBackend", "WorkflowMixin", "PPOActorMixin",
           "MegatronEngineMixin", "replay_config", "ArealCodec", "megatron_ppo_actor_class", "trainer_class", "workflow_class"]


class ArealCodec:
    """The :class:`r3bridge.protocols.BatchCodec` of AReaL's batched trajectory dicts."""

    def __init__(self, model: ModelInfo) -> None:
        self.model = model

    def to_replay_batch(self, native: dict, *, source: str = "rollout"):
        key = RECORDED_KEY if source == "recorded" else ROUTES_KEY
        return replay_batch_from_batch(native, key=key, num_experts=self.model.num_experts,
                                       moe_layer_ids=self.model.moe_layer_ids, source=source)

    def write_recorded(self, native: dict, recorded) -> dict:
        native[RECORDED_KEY] = batch_tensor(recorded, native["attention_mask"])
        return native

    def seq_lens(self, native: dict) -> list[int]:
        return native["attention_mask"].sum(-1).long().tolist()

    def split(self, native: dict, num_parts: int, order: Optional[list] = None):
        """AReaL's own ``split_padded_tensor_dict_into_mb_list`` (token-balanced, reorders samples),
        with the routes tensor carried whole and sliced by the per-token sample ids, as the engine
        does."""
        import torch

        from r3bridge.adapters.areal._compat import import_areal
        data_mod = import_areal("areal.utils.data")
        spec_mod = import_areal("areal.api.cli_args")
        d = dict(native)
        attn = d["attention_mask"]
        d[SAMPLE_KEY] = torch.arange(attn.shape[0])[:, None].expand(attn.shape).contiguous()
        carried = {k: d.pop(k) for k in (ROUTES_KEY, RECORDED_KEY) if k in d}
        mbl = data_mod.split_padded_tensor_dict_into_mb_list(d, spec_mod.MicroBatchSpec(n_mbs=num_parts))
        out = []
        for mb in mbl.mbs:
            ids = mb[SAMPLE_KEY][:, 0].tolist()
            part = {k: v for k, v in mb.items() if k != SAMPLE_KEY}
            part.update({k: v[torch.tensor(ids)] for k, v in carried.items()})
            out.append((part, ids))
        return out


def megatron_ppo_actor_class(config=None):
    """``MegatronPPOActor`` subclass with r3bridge: engine mixin + a ``PPOActorMixin`` actor."""
    from r3bridge.adapters.areal._compat import import_areal
    me = import_areal("areal.engine.megatron_engine")
    ppo = import_areal("areal.trainer.ppo.actor")

    class R3BridgePPOActor(PPOActorMixin, ppo.PPOActor):
        pass

    class R3BridgeMegatronPPOActor(MegatronEngineMixin, me.MegatronPPOActor):
        r3_config = None if config is None else replay_config(config)

        def __init__(self, config):
            super().__init__(config)
            self.actor = R3BridgePPOActor(config, self)

    return R3BridgeMegatronPPOActor


def trainer_class(config=None):
    """``PPOTrainer`` subclass whose actor (never the reference / teacher) is the r3bridge actor.
    SPMD mode only: the single-controller mode builds its workers from AReaL's own class paths."""
    from r3bridge.adapters.areal._compat import import_areal
    rl = import_areal("areal.trainer.rl_trainer")
    actor_cls = megatron_ppo_actor_class(config)

    class R3BridgePPOTrainer(rl.PPOTrainer):
        def _create_train_engine(self, actor_config, alloc):
            if actor_config is not getattr(getattr(self, "config", None), "actor", None) or alloc.backend != "megatron":
                return super()._create_train_engine(actor_config, alloc)
            if rl.is_single_controller():
                from r3bridge.errors import ConfigError
                raise ConfigError("r3bridge + AReaL: the single-controller mode is not wired; run SPMD")
            actor = actor_cls(config=actor_config)
            actor.create_process_group(parallel_strategy=alloc.parallel)
            return actor

    return R3BridgePPOTrainer


def workflow_class(base: type, hf_config) -> type:
    """``base`` (e.g. ``RLVRWorkflow``, ``MultiTurnWorkflow``) with :class:`WorkflowMixin`, for the
    model described by ``hf_config`` (a ``PretrainedConfig``, a config dict, or a path)."""
    if isinstance(hf_config, str):
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(hf_config, trust_remote_code=True)
    return type(f"R3Bridge{base.__name__}", (WorkflowMixin, base), {"r3_model": ModelInfo.from_hf_config(hf_config)})

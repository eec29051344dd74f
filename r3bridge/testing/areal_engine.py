"""AReaL 1.0.4's real ``MegatronPPOActor`` around harness model chunks (CPU, tests only).

What is AReaL's own code here: the engine class (``MegatronPPOActor`` with r3bridge's
``MegatronEngineMixin``), its ``PPOActor`` (with ``PPOActorMixin``), ``create_process_group``,
``_create_optimizer`` (megatron's optimizer over megatron-DDP-wrapped chunks), and everything the
trainer calls per step: ``compute_logp`` -> ``forward_batch`` -> ``_prepare_mb_list`` ->
``forward_backward_batch``, ``compute_advantages``, ``ppo_update`` -> ``train_batch`` (AReaL's
GRPO loss, ``finalize_model_grads``, optimizer step). Nothing of it is re-implemented.

What is not AReaL's: :func:`initialize_on_cpu` stands in for ``MegatronEngine.initialize``, which
cannot run on a CPU-only torch: its first device call is ``torch.device(int(LOCAL_RANK))`` (an
accelerator index; torch 2.13 CPU raises "Cannot access accelerator device when none is
available"), and it builds the model through ``mbridge`` from a HF checkpoint. It sets the same
engine state ``initialize`` sets (device, ranks, hf/tf config, the DDP-wrapped model list,
``finalize_model_grads``, the optimizer through AReaL's own ``_create_optimizer``) with the
harness's deterministic megatron-core chunks as the model, and then attaches r3bridge exactly as
``MegatronEngineMixin.initialize`` does after AReaL's ``initialize``. The harness model's learned
absolute position embedding is switched off (AReaL models use RoPE and feed un-split
``position_ids``).

Megatron's ``FP32Optimizer`` allocates its loss scale with a literal ``device='cuda'``
(``optimizer/optimizer.py:907``), and the grad-norm it always computes in ``step`` does too
(``optimizer/clip_grads.py:103``, its fallback l2-norm ``utils.py:1207``): those three modules' ``torch`` name gets the same CPU proxy
``r3bridge.testing.cpu_shim`` gives the schedules (:func:`_shim_optimizer`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch

from r3bridge.testing.areal_env import import_areal

__all__ = ["hf_config_for", "make_actor", "initialize_on_cpu", "ENGINE_KW"]

# The engine options the tests run with (AReaL defaults except where noted).
ENGINE_KW = dict(dtype="float32",          # the CPU harness is fp32 (AReaL's default is bfloat16)
                 temperature=1.0)


def hf_config_for(chunks: list) -> Any:
    """A HF ``Qwen3MoeConfig`` describing the harness model (what ``initialize`` reads from the
    checkpoint): the adapter takes layer ids, experts and top-k from it."""
    from transformers import Qwen3MoeConfig

    cfg = chunks[0].config
    freq = cfg.moe_layer_freq
    moe = [bool(freq[i]) if isinstance(freq, list) else i % freq == 0 for i in range(cfg.num_layers)]
    return Qwen3MoeConfig(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                          intermediate_size=cfg.ffn_hidden_size, moe_intermediate_size=cfg.moe_ffn_hidden_size,
                          num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
                          num_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                          decoder_sparse_step=1, mlp_only_layers=[i for i, m in enumerate(moe) if not m],
                          vocab_size=chunks[0].vocab_size if hasattr(chunks[0], "vocab_size") else 128)


def _shim_optimizer() -> None:
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, optimizer as mopt

    from r3bridge.testing.cpu_shim import _proxy_torch_in

    _proxy_torch_in(mopt)
    _proxy_torch_in(clip_grads)
    _proxy_torch_in(mutils)


def actor_config(ctx: Any, *, n_mbs: int, ppo_n_minibatches: int, recompute: bool, lr: float = 1e-3) -> Any:
    cli = import_areal("areal.api.cli_args")
    mcore = cli.MegatronEngineConfig(
        virtual_pipeline_parallel_size=ctx.vpp or 1,
        # megatron's DistributedOptimizer checks for torch.cuda.*Tensor params
        # (distrib_optimizer.py:431): the plain one, same schedule and loss.
        ddp=cli.DistributedDataParallelConfig(use_distributed_optimizer=False),
    )
    return cli.PPOActorConfig(
        experiment_name="r3bridge", trial_name="cpu", path="", gradient_checkpointing=recompute,
        mb_spec=cli.MicroBatchSpec(n_mbs=n_mbs), megatron=mcore,
        # gradient clipping allocates with device='cuda' literals (clip_grads.py:90): off
        optimizer=cli.OptimizerConfig(type="adam", lr=lr, gradient_clipping=0.0, warmup_steps_proportion=0.0),
        ppo_n_minibatches=ppo_n_minibatches, recompute_logprob=True, use_decoupled_loss=False,
        **ENGINE_KW,
    )


def initialize_on_cpu(engine: Any, chunks: list, *, total_train_steps: int = 4) -> None:
    """Everything ``MegatronEngine.initialize`` sets, on CPU, with ``chunks`` as the model
    (see the module docstring), then r3bridge attached as its mixin does after ``initialize``."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    me = import_areal("areal.engine.megatron_engine")
    api = import_areal("areal.api")
    from r3bridge.adapters.areal import ModelInfo

    _shim_optimizer()
    engine.seed = 1
    engine.device = torch.device("cpu")
    engine.rank, engine.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine.is_pp_head = (mpu.get_data_parallel_rank(with_context_parallel=True) == 0
                         and mpu.get_tensor_model_parallel_rank() == 0)
    engine.weight_update_group_name = f"update_weight_group_{mpu.get_pipeline_model_parallel_rank()}"
    engine.hf_config = hf_config_for(chunks)
    engine.tf_config = chunks[0].config
    engine.is_vision_model = False
    engine.use_padded_seq = False
    engine.quantization_config = None
    for c in chunks:      # AReaL models use RoPE: no learned absolute positions
        if getattr(c, "embedding", None) is not None:
            c.embedding.add_position_embedding = False
    ddp_cfg = DistributedDataParallelConfig(**dataclasses.asdict(engine.mcore_config.ddp))
    wrapped = []
    for i, c in enumerate(chunks):
        # as areal.models.mcore.registry.make_mcore_model wraps non-bridge models
        w = DDP(config=c.config, ddp_config=ddp_cfg, module=c,
                disable_bucketing=i > 0 and len(chunks) > 1)
        if len(chunks) > 1:
            w.vp_stage = i
        wrapped.append(w)
    engine.model = me._MegatronModelList(wrapped)
    engine._glu_fc1_names = engine._build_glu_fc1_names()
    if engine.config.disable_dropout:
        for m in engine.model:
            me.disable_dropout_in_model(m)
    model_config = chunks[0].config
    model_config.finalize_model_grads_func = finalize_model_grads
    try:
        engine._create_optimizer(api.FinetuneSpec(total_train_epochs=1, dataset_size=total_train_steps,
                                                  train_batch_size=1))
    except AssertionError as e:
        # Its last statement builds the checkpoint manager, which requires the distributed
        # optimizer; that one refuses CPU parameters (distrib_optimizer.py:420 checks for
        # torch.cuda.*Tensor). Optimizer and LR scheduler are set by then; save/load are untested.
        if "distributed optimizer" not in str(e) or engine.optimizer is None or engine.lr_scheduler is None:
            raise
        engine.checkpointer = None
    engine._initialized = True
    engine.r3_attach(ModelInfo.from_hf_config(engine.hf_config))


def make_actor(ctx: Any, chunks: list, mode: str, *, n_mbs: int = 2, ppo_n_minibatches: int = 2,
               recompute: bool = False) -> Any:
    """r3bridge's ``MegatronPPOActor`` subclass (``r3bridge.adapters.areal.megatron_ppo_actor_class``)
    with ``replay_mode=mode``, process groups through AReaL's ``create_process_group`` (the
    spawned rank already holds megatron's parallel state, as under AReaL's launcher), initialised
    on CPU around ``chunks``."""
    from r3bridge.adapters.areal import megatron_ppo_actor_class
    from r3bridge.config import ReplayConfig

    os.environ.setdefault("LOCAL_RANK", "0")
    alloc = import_areal("areal.api.alloc_mode")
    cls = megatron_ppo_actor_class(ReplayConfig(replay_mode=mode))
    eng = cls(actor_config(ctx, n_mbs=n_mbs, ppo_n_minibatches=ppo_n_minibatches, recompute=recompute))
    eng.create_process_group(alloc.ParallelStrategy(
        tensor_parallel_size=ctx.tp, pipeline_parallel_size=ctx.pp, context_parallel_size=ctx.cp,
        data_parallel_size=ctx.dp, expert_parallel_size=ctx.ep, expert_tensor_parallel_size=ctx.etp))
    initialize_on_cpu(eng, chunks)
    return eng

"""AReaL 1.0.4's real ``MegatronPPOActor`` on CPU, its model built through mbridge (tests only).

What is AReaL's own code here: the engine class (``MegatronPPOActor`` with r3bridge's
``MegatronEngineMixin``), its ``PPOActor`` (with ``PPOActorMixin``), ``create_process_group``, the
model build (``_build_hf_mcore_bridge`` -> ``mbridge.AutoBridge``, ``make_hf_and_mcore_config``,
``configure_pipeline_layer_splits``, ``make_mcore_model``: DDP-wrapped chunks),
``_create_optimizer`` (megatron's optimizer), and everything the trainer calls per step:
``compute_logp`` -> ``forward_batch`` -> ``_prepare_mb_list`` -> ``forward_backward_batch``,
``compute_advantages``, ``ppo_update`` -> ``train_batch`` (AReaL's GRPO loss,
``finalize_model_grads``, optimizer step). Nothing of it is re-implemented.

What is not AReaL's (each for a reason that exists only on a CPU machine without TE):

* :func:`initialize_on_cpu` runs the parts of ``MegatronEngine.initialize`` that can run: its
  first device call is ``torch.device(int(LOCAL_RANK))`` (an accelerator index; a CPU-only
  torch 2.13 raises "Cannot access accelerator device when none is available"), which every later
  ``with self.device:`` and ``.to(self.device)`` use. It sets the same state with a CPU device.
* the bridge is mbridge's registered Qwen3-MoE bridge with the TE-free spec hook
  (:mod:`testlab.mbridge_spec`, shared with verl's test); its seeded ``load_weights``
  replaces AReaL's ``_load_model_from_hf`` (there is no safetensors checkpoint).
* megatron's ``FP32Optimizer`` allocates its loss scale with a literal ``device='cuda'``
  (``optimizer/optimizer.py:907``), the grad norm ``step`` always computes does too
  (``optimizer/clip_grads.py:103``, its fallback L2 norm ``utils.py:1207``): those three modules'
  ``torch`` name gets the same CPU proxy ``r3bridge.testing.harness.cpu_shim`` gives the schedules
  (:func:`_shim_optimizer`).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from testlab.areal_env import import_areal
from testlab.mbridge_spec import tiny_qwen3_moe

__all__ = ["make_actor", "build_through_mbridge", "initialize_on_cpu", "chunks_of", "reference_roles", "ENGINE_KW"]

# The engine options the tests run with (AReaL defaults except where noted).
ENGINE_KW = dict(dtype="float32",          # the CPU harness is fp32 (AReaL's default is bfloat16)
                 temperature=1.0)




def _shim_optimizer() -> None:
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mopt

    from r3bridge.testing.harness.cpu_shim import _proxy_torch_in

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


def initialize_on_cpu(engine: Any, models: list, *, total_train_steps: int = 4, device: str = "cpu",
                      role: str = "actor") -> None:
    """The rest of what ``MegatronEngine.initialize`` sets, on CPU, for ``models`` (built by
    :func:`build_through_mbridge`; see the module docstring), then r3bridge attached as its mixin
    does after ``initialize(role=role)``: the actor's ``MegatronEngineMixin`` attaches the driver,
    the other engines' ``RoleEngineMixin`` declares the model's role. ``device="cuda"`` (the device
    scripts): the same state on this rank's GPU, as ``initialize`` sets it, and megatron's optimizer
    without the CPU proxy."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    me = import_areal("areal.engine.megatron_engine")
    api = import_areal("areal.api")
    from r3bridge.hf import ModelInfo

    if device == "cpu":
        _shim_optimizer()
        engine.device = torch.device("cpu")
    else:
        engine.device = torch.device("cuda", torch.cuda.current_device())
    engine.seed = 1
    engine.rank, engine.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine.is_pp_head = (mpu.get_data_parallel_rank(with_context_parallel=True) == 0
                         and mpu.get_tensor_model_parallel_rank() == 0)
    engine.weight_update_group_name = f"update_weight_group_{mpu.get_pipeline_model_parallel_rank()}"
    engine.is_vision_model = False
    engine.use_padded_seq = False
    engine.quantization_config = None
    engine.model = me._MegatronModelList(models)
    engine._glu_fc1_names = engine._build_glu_fc1_names()
    if engine.config.disable_dropout:
        for m in engine.model:
            me.disable_dropout_in_model(m)
    for chunk in engine.model:        # as initialize: vp_stage on DDP chunks
        if isinstance(chunk, DDP) and engine.mcore_config.virtual_pipeline_parallel_size > 1:
            chunk.vp_stage = getattr(chunk.module, "vp_stage", None)
    model_config = get_model_config(engine.model[0])
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
    if hasattr(engine, "r3_attach"):
        engine.r3_attach(ModelInfo.from_hf_config(engine.hf_config), role=role)
    else:
        engine.r3_declare_role(role)


def build_through_mbridge(engine: Any, hf_config: Any, workdir: str, *, device: str = "cpu") -> list:
    """The model as ``MegatronEngine.initialize`` builds it, with AReaL's own functions:
    ``_build_hf_mcore_bridge`` (``mbridge.AutoBridge.from_pretrained`` of a checkpoint directory
    holding ``hf_config``, recompute options from AReaL's config), ``make_hf_and_mcore_config``,
    ``configure_pipeline_layer_splits``, ``make_mcore_model`` (``bridge.get_model`` with AReaL's
    DDP options), all inside :func:`testlab.mbridge_spec.te_free_bridges` (megatron's
    local TE-free layer spec, MoE-only layers as the harness's ``attention='identity'``). Weights:
    the bridge's ``load_weights`` (the harness's seeded init) instead of AReaL's
    ``_load_model_from_hf``, which reads safetensors shards (there is no checkpoint). Sets
    ``engine.bridge``, ``hf_config``, ``tf_config``; returns the DDP-wrapped chunks."""
    from testlab.mbridge_spec import te_free_bridges

    registry = import_areal("areal.models.mcore.registry")
    pls = import_areal("areal.engine.megatron_utils.pipeline_parallel")
    hf_config.save_pretrained(workdir)
    engine.config.path = workdir
    with te_free_bridges(attention="identity", on_device=device != "cpu"):
        engine.bridge = engine._build_hf_mcore_bridge()
        hf = engine.bridge.hf_config
        if not hasattr(hf, "rope_theta"):
            # mbridge 0.15.1 reads hf_config.rope_theta; transformers >= 5.4 (here: verl's 5.10,
            # AReaL pins <= 5.3) keeps it only in rope_parameters
            hf.rope_theta = hf.rope_parameters["rope_theta"]
        engine.hf_config, engine.tf_config = registry.make_hf_and_mcore_config(
            workdir, dtype=engine.dtype, bridge=engine.bridge, bridge_type=engine.bridge_cls)
        engine.tf_config = pls.configure_pipeline_layer_splits(engine.parallel_strategy, engine.hf_config,
                                                               engine.tf_config)
        models = registry.make_mcore_model(hf_config=engine.hf_config, tf_config=engine.tf_config,
                                           mcore_config=engine.mcore_config, bridge=engine.bridge,
                                           bridge_type=engine.bridge_cls, is_critic=False, use_lora=False)
    engine.bridge.load_weights(models)
    return models


def make_actor(ctx: Any, mode: str, workdir: str, *, hf_config: Any = None, n_mbs: int = 2,
               ppo_n_minibatches: int = 2, recompute: bool = True, trace_dir: Optional[str] = None,
               device: str = "cpu", role: str = "actor", engine_class: Any = None) -> Any:
    """r3bridge's ``MegatronPPOActor`` subclass (``r3bridge.adapters.areal.hooks.megatron_ppo_actor_class``)
    with ``replay_mode=mode``: process groups through AReaL's ``create_process_group`` (the spawned
    rank already holds megatron's parallel state, as under AReaL's launcher), the model through
    mbridge as AReaL builds it (:func:`build_through_mbridge`, checkpoint config in ``workdir``),
    the rest of ``initialize`` on CPU (:func:`initialize_on_cpu`). ``recompute``: AReaL's
    ``gradient_checkpointing`` (full, uniform, 1 layer: its defaults). ``device``: "cpu" (the CPU
    harness) or "cuda" (a real GPU: the same model, spec and steps, no CPU shims). ``role`` /
    ``engine_class``: the role AReaL's trainer initialises the engine as, and another class than
    r3bridge's actor (e.g. ``r3bridge.adapters.areal.hooks.megatron_role_engine_class()`` for the reference)."""
    from r3bridge.adapters.areal.hooks import megatron_ppo_actor_class
    from r3bridge.config import ReplayConfig

    if device == "cuda":
        # AReaL's launcher gives each process its own LOCAL_RANK and the engine pins its GPU from it
        # (megatron_engine.py:313); the harness already set this rank's device. With "0" on every rank
        # both ranks of the 2-GPU run sat on GPU 0 ("Duplicate GPU detected", 2026-11-26)
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
    os.environ.setdefault("LOCAL_RANK", "0")
    alloc = import_areal("areal.api.alloc_mode", stand_ins=True)   # before the engine module is imported
    cls = engine_class or megatron_ppo_actor_class(ReplayConfig(replay_mode=mode, trace_dir=trace_dir))
    eng = cls(actor_config(ctx, n_mbs=n_mbs, ppo_n_minibatches=ppo_n_minibatches, recompute=recompute))
    eng.create_process_group(alloc.ParallelStrategy(
        tensor_parallel_size=ctx.tp, pipeline_parallel_size=ctx.pp, context_parallel_size=ctx.cp,
        data_parallel_size=ctx.dp, expert_parallel_size=ctx.ep, expert_tensor_parallel_size=ctx.etp))
    models = build_through_mbridge(eng, hf_config if hf_config is not None else tiny_qwen3_moe(), workdir,
                                   device=device)
    initialize_on_cpu(eng, models, device=device, role=role)
    return eng


def chunks_of(engine: Any) -> list:
    """The GPTModel chunks inside the engine's DDP wrappers (what the routing probe walks)."""
    from testlab.mbridge_spec import _unwrap

    return [_unwrap(m) for m in engine.model]


def reference_roles(ctx: Any, workdir: str) -> dict:
    """Only the actor replays (r3bridge.megatron.roles), on AReaL's engines: the reference engine
    ``trainer_class`` builds (``RoleEngineMixin``) declares its model the reference; given megatron's
    RouterReplay (what a build with ``moe_enable_routing_replay`` makes) it refuses its next pass;
    r3bridge's actor engine initialised as ``role="ref"`` refuses to attach. Each error, or "no error"."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from r3bridge.adapters.areal.hooks import megatron_role_engine_class
    from r3bridge.megatron.roles import model_routers, role_of

    def outcome(fn) -> str:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the test reads what was raised
            return f"{type(e).__name__}: {e}"
        return "no error"

    import_areal("areal.api.alloc_mode", stand_ins=True)        # before the engine module is imported
    ref = make_actor(ctx, "R3", f"{workdir}/ref", role="ref", engine_class=megatron_role_engine_class())
    out = {"reference": sorted({str(getattr(role_of(r), "value", None)) for c in chunks_of(ref) for _, r in model_routers(c)})}
    router = next(r for c in chunks_of(ref) for _, r in model_routers(c))
    router.router_replay = RouterReplay()
    try:
        out["reference_with_megatron_replay"] = outcome(lambda: ref.forward_backward_batch(None, None, True))
    finally:
        RouterReplay.global_router_replay_instances.remove(router.router_replay)
        router.router_replay = None
    out["actor_engine_as_reference"] = outcome(lambda: make_actor(ctx, "R3", f"{workdir}/actor_as_ref", role="ref"))
    return out

"""Build models through ``mbridge`` (verl 0.9 / AReaL 1.0's model builder) without Transformer Engine.

verl's ``MegatronEngine`` (``vanilla_mbridge``) and AReaL's ``MegatronEngine`` build their
Megatron model with ``mbridge.AutoBridge.from_config(hf_config)``, which looks the bridge class up
by ``hf_config.model_type`` in ``mbridge.core.bridge._MODEL_REGISTRY``. Every LLM bridge then
asks for a Transformer Engine layer spec (``LLMBridge._get_transformer_layer_spec`` hard-codes
``use_transformer_engine=True``) and turns on TE-only config options; none of that can exist on
the CPU harness.

:func:`te_free_bridges` swaps, for the duration of a ``with`` block, every registry entry for a
subclass of the registered bridge (:class:`TEFreeBridgeMixin` first in its MRO). Why a registry
entry and not a patch: the registry is the lookup mbridge itself provides for model types
(``register_model``), so the substitution needs no change to any mbridge or verl class, is
visible only to bridges created inside the block, and is undone on exit. Everything else a
bridge does (the HF -> Megatron config mapping, ``get_model`` with verl's / AReaL's DDP and
Float16 wrapping, the provider, callbacks) is the registered class's own code.

What the subclass changes, each for a reason that exists only without TE / CUDA:

* ``_get_transformer_layer_spec``: megatron's own local (non-TE) per-layer block spec
  ``get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=...)`` (so
  ``moe_layer_freq`` is honoured as in production), with the harness's SP-tolerant torch norms
  (:class:`r3bridge.testing.harness.models.SequenceParallelTorchNorm`; megatron's local norm asserts
  ``not sequence_parallel``) and, with ``attention='identity'``, MoE-only layers.
* config options that need TE, Apex or CUDA kernels are switched off (:data:`TE_ONLY_OFF`):
  ``persist_layer_norm``, ``gradient_accumulation_fusion``, ``apply_rope_fusion``,
  ``bias_activation_fusion``, ``bias_dropout_fusion``, ``masked_softmax_fusion``, and
  ``moe_grouped_gemm`` (GroupedMLP needs the ``grouped_gemm`` package: SequentialMLP instead).
* ``get_model``: mbridge calls ``model.cuda(torch.cuda.current_device())``; on CPU that is
  :func:`r3bridge.testing.harness.cpu_shim.tensor_cuda_is_identity` around the build only.
* ``load_weights``: mbridge's name mapping knows only TE / GroupedMLP parameter names
  (``linear_qkv.layer_norm_weight``, ``experts.linear_fc1.weight<E>``), so the local spec's
  names raise ``NotImplementedError``. Parameters are set from the harness's seeded
  layout-independent init instead (:func:`r3bridge.testing.harness.models.deterministic_init`), so
  actor and reference models, and every parallel layout, start from the same weights.
* Qwen2/3-MoE ``mlp_only_layers`` / ``decoder_sparse_step``: mbridge 0.15.1's
  ``Qwen2MoEBridge`` / ``Qwen3MoEBridge`` ignore them and build every layer MoE (their
  ``load_weights`` would then look for experts of dense layers). The subclass passes HF's own
  rule (a layer is MoE iff ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``)
  as ``moe_layer_freq``; ``dense_from_hf=False`` keeps mbridge's behaviour (all MoE).

Nothing here changes how a framework batches, splits micro-batches or schedules.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator, Literal, Optional

import torch

#: TransformerConfig options that select TE / Apex / CUDA-only kernels; all off on the harness.
TE_ONLY_OFF: dict[str, Any] = {
    "persist_layer_norm": False,
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "moe_grouped_gemm": False,
}


def hf_moe_layer_freq(hf_config: Any) -> Optional[list[int]]:
    """HF Qwen2/3-MoE's dense-layer rule as a Megatron ``moe_layer_freq`` list; None when the
    config has neither ``mlp_only_layers`` nor ``decoder_sparse_step`` (not that family)."""
    dense = getattr(hf_config, "mlp_only_layers", None)
    step = getattr(hf_config, "decoder_sparse_step", None)
    if dense is None and step is None:
        return None
    dense_set = {int(i) for i in (dense or [])}
    step = int(step or 1)
    n = int(hf_config.num_hidden_layers)
    return [0 if (i in dense_set or (i + 1) % step != 0) else 1 for i in range(n)]


class TEFreeBridgeMixin:
    """Mixed in front of a registered mbridge bridge class by :func:`te_free_bridges`."""

    # set per generated subclass by te_free_bridges()
    r3_attention: Literal["real", "identity"] = "real"
    r3_seed: int = 1234
    r3_init_std: float = 0.02
    r3_router_init_std: float = 0.5
    r3_dense_from_hf: bool = True
    r3_on_device: bool = False      # a real accelerator (the device scripts): mbridge's .cuda() runs

    def _build_base_config(self, text_config_key: Any = None, **kwargs: Any) -> Any:
        kwargs.update(TE_ONLY_OFF)
        if self.r3_dense_from_hf and "moe_layer_freq" not in kwargs:
            freq = hf_moe_layer_freq(self.hf_config)  # type: ignore[attr-defined]
            if freq is not None:
                kwargs["moe_layer_freq"] = freq
        # The user's overrides (verl's override_transformer_config) are applied last by mbridge
        # itself: a TE-only option asked for there must still be refused, so re-check after.
        cfg = super()._build_base_config(text_config_key, **kwargs)  # type: ignore[misc]
        on = [k for k, v in TE_ONLY_OFF.items() if bool(getattr(cfg, k, False)) != v]
        if on:
            raise ValueError(f"TE-only option(s) {on} switched on by the job's overrides: the CPU "
                             f"harness has no Transformer Engine")
        return cfg

    def _get_transformer_layer_spec(self, vp_stage: Optional[int] = None) -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        from r3bridge.testing.harness.models import _identity_attention, _swap_norms

        self.has_vp_stage = True  # read by LLMBridge's provider (megatron >= 0.13 has vp_stage)
        block = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False,  # type: ignore[attr-defined]
                                           vp_stage=vp_stage)
        if self.r3_attention == "identity":
            block = dataclasses.replace(block, layer_specs=[_identity_attention(s) for s in block.layer_specs])
        return _swap_norms(block)

    def get_model(self, *args: Any, **kwargs: Any) -> Any:
        from r3bridge.testing.harness.cpu_shim import tensor_cuda_is_identity

        if self.r3_on_device:
            return super().get_model(*args, **kwargs)  # type: ignore[misc]
        with tensor_cuda_is_identity():
            return super().get_model(*args, **kwargs)  # type: ignore[misc]

    def load_weights(self, models: list, weights_path: str = "", memory_efficient: bool = False) -> None:
        seeded_init([_unwrap(m) for m in models], num_layers=self.config.num_layers,  # type: ignore[attr-defined]
                    seed=self.r3_seed, init_std=self.r3_init_std, router_init_std=self.r3_router_init_std)


@torch.no_grad()
def seeded_init(chunks: list, *, num_layers: int, seed: int, init_std: float, router_init_std: float) -> None:
    """The harness's layout-independent init (:func:`r3bridge.testing.harness.models.deterministic_init`:
    values from (seed, canonical parameter name, full shape)), also for the strided TP partitions
    of gated ``linear_fc1`` weights that a bridge-built model has: rank r keeps strided pieces
    ``r, r + world, ...`` of the full tensor, as megatron's own CPU init does."""
    from r3bridge.testing.harness.models import (
        ModelSpec,
        _full_init_value,
        _named_params_with_module,
        canonical_name,
        is_expert_param,
    )

    spec = ModelSpec(num_layers=num_layers, seed=seed, init_std=init_std, router_init_std=router_init_std)
    ctx = rank_context_from_mpu(seed)
    one = dataclasses.replace(ctx, tp=1, etp=1, tp_rank=0, etp_rank=0)   # full-shape view for the values
    for chunk in chunks:
        for name, p, mod in _named_params_with_module(chunk):
            cname = canonical_name(chunk, name, ctx)
            rank, world = (ctx.etp_rank, ctx.etp) if is_expert_param(cname) else (ctx.tp_rank, ctx.tp)
            if not getattr(p, "tensor_model_parallel", False):
                world = 1
            dim, stride = int(getattr(p, "partition_dim", 0)), int(getattr(p, "partition_stride", 1))
            shape = list(p.shape)
            shape[dim] *= world
            # a plain meta tensor of the full shape: the values depend on name and shape only
            full = _full_init_value(cname, torch.empty(shape, device="meta"), mod, spec, one)
            if world == 1:
                p.copy_(full)
                continue
            pieces = torch.split(full, shape[dim] // (world * stride), dim=dim)
            p.copy_(torch.cat(pieces[rank::world], dim=dim))


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def rank_context_from_mpu(seed: int) -> Any:
    """A harness :class:`~r3bridge.testing.harness.dist.RankContext` read from megatron's parallel state
    (for models a framework built itself, after it initialised model parallelism)."""
    import torch
    from megatron.core import parallel_state as ps

    from r3bridge.testing.harness.dist import RankContext

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return RankContext(
        rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=vpp, cp=ps.get_context_parallel_world_size(), ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(with_context_parallel=False),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(), ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(with_context_parallel=False), seed=seed,
    )


@contextlib.contextmanager
def te_free_bridges(*, attention: Literal["real", "identity"] = "real", seed: int = 1234,
                    init_std: float = 0.02, router_init_std: float = 0.5,
                    dense_from_hf: bool = True, on_device: bool = False) -> Iterator[dict[str, type]]:
    """Inside the block, ``mbridge.AutoBridge`` builds TE-free harness bridges (see module doc).

    ``on_device``: the model goes to the GPU as mbridge puts it there (``.cuda()``), no CPU shim.
    Yields the substituted classes by model type. Bridges created inside keep their class after
    the block (verl keeps its bridge for the engine's lifetime); the registry is restored on exit.
    """
    from mbridge.core import bridge as mb_bridge
    from mbridge.core.llm_bridge import LLMBridge

    registry = mb_bridge._MODEL_REGISTRY
    saved = dict(registry)
    attrs = dict(r3_attention=attention, r3_seed=seed, r3_init_std=init_std,
                 r3_router_init_std=router_init_std, r3_dense_from_hf=dense_from_hf, r3_on_device=on_device)
    swapped: dict[str, type] = {}
    try:
        for model_type, cls in saved.items():
            if isinstance(cls, type) and issubclass(cls, LLMBridge):
                swapped[model_type] = type(f"TEFree{cls.__name__}", (TEFreeBridgeMixin, cls), dict(attrs))
        registry.update(swapped)
        yield swapped
    finally:
        registry.clear()
        registry.update(saved)


__all__ = ["DEFAULT_HEAD_DIM", "TE_ONLY_OFF", "TEFreeBridgeMixin", "hf_moe_layer_freq", "rank_context_from_mpu", "seeded_init",
           "te_free_bridges"]


DEFAULT_HEAD_DIM = 8     # the tiny models' attention head width unless R3E2E_HEAD_DIM or the caller widens it


def tiny_qwen3_moe(*, num_layers: int = 4, dense: tuple = (0,), num_experts: int = 4, topk: int = 2,
                   vocab: int = 128, max_positions: int = 512, head_dim: int | None = None) -> Any:
    """The HF config of a tiny first-k-dense Qwen3-MoE, as the verl and AReaL runners hand it to mbridge (what a checkpoint's ``config.json`` holds;
    no weights: the harness bridge seeds them). ``head_dim``: 8 unless given or set by ``R3E2E_HEAD_DIM``
    (a GPU run can widen the heads without a code change, should an engine's attention kernels refuse 8)."""
    from transformers import Qwen3MoeConfig

    head_dim = head_dim if head_dim is not None else int(os.environ.get("R3E2E_HEAD_DIM", DEFAULT_HEAD_DIM))

    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         num_experts=num_experts, num_experts_per_tok=topk, mlp_only_layers=list(dense),
                         decoder_sparse_step=1, max_position_embeddings=max_positions, tie_word_embeddings=False,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1,
                         # as Qwen3-MoE checkpoints set it: mbridge 0.15.1's Qwen3MoEBridge ignores the
                         # field and always renormalises the top-k weights (moe_router_pre_softmax=False,
                         # mbridge/models/qwen3moe.py); with transformers' default (False) the engine and
                         # the trainer weight the experts differently and diverge after the first MoE
                         # layer (native agreement 0.30 on the GPU, 2026-11-26)
                         norm_topk_prob=True)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg

"""A hybrid (Nemotron-H style) megatron model without Mamba kernels or Transformer Engine.

megatron-core's hybrid model (``MambaModel`` + ``MambaStack`` in 0.16-0.17, ``HybridModel`` +
``HybridStack`` from 0.18) builds one layer per symbol of its pattern. Which symbols can run on
the CPU harness: "E" (MoE: a TransformerLayer with a MoELayer and no attention) and "-" (dense
MLP); "M" needs the mamba_ssm / causal_conv1d kernels and "*" with packed sequences needs TE
attention, so a harness pattern uses "E" and "-" only. The stack's final norm is a ``TENorm``
(TE-only), so the stack is built with ``post_layer_norm=False`` through the spec's params
(megatron's own option, no shim). The layer specs are the GPT local specs with the harness's
identity attention and SP-tolerant norms (models.py).

Then a hybrid model's MoE layers sit at the pattern's "E" indices, like Nemotron-H's in an engine's
routes, and r3bridge must map them by pattern, not by ``moe_layer_freq`` (discovery.layout_for).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any

import torch

from r3bridge.testing.harness.models import ModelSpec, _identity_attention, _swap_norms, deterministic_init, make_config

if TYPE_CHECKING:  # pragma: no cover
    from r3bridge.testing.harness.dist import RankContext

HARNESS_SYMBOLS = {"E", "-"}


def _stack_classes() -> tuple[Any, Any, Any, str]:
    """(model class, stack class, stack submodules class, pattern keyword) of this release."""
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        return HybridModel, HybridStack, HybridStackSubmodules, "hybrid_layer_pattern"
    except ImportError:     # 0.16 / 0.17
        from megatron.core.models.mamba.mamba_model import MambaModel
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules

        return MambaModel, MambaStack, MambaStackSubmodules, "hybrid_override_pattern"


def build_hybrid_model(spec: ModelSpec, ctx: "RankContext", pattern: str) -> torch.nn.Module:
    """One hybrid model chunk (no VPP, no PP) with ``len(pattern)`` layers, deterministically
    initialised like the GPT harness models."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from r3bridge.megatron.compat import reset_moe_metrics_tracker
    from r3bridge.testing.harness import cpu_shim

    bad = set(pattern) - HARNESS_SYMBOLS
    if bad or ctx.pp != 1 or ctx.vpp:
        raise ValueError(f"the CPU hybrid harness builds 'E' / '-' layers without PP (got {pattern!r}, pp={ctx.pp})")
    spec = dataclasses.replace(spec, num_layers=len(pattern), attention="identity")
    reset_moe_metrics_tracker()
    config = make_config(spec, ctx)
    moe = get_gpt_layer_local_spec(num_experts=spec.num_moe_experts, moe_grouped_gemm=False)
    mlp = get_gpt_layer_local_spec()
    model_cls, stack_cls, sub_cls, pattern_kw = _stack_classes()
    if "hybrid_layer_pattern" in inspect.signature(model_cls.__init__).parameters:
        pattern_kw = "hybrid_layer_pattern"     # 0.17 renamed it (hybrid_override_pattern deprecated)
    stack = ModuleSpec(
        module=stack_cls,
        submodules=sub_cls(moe_layer=_swap_norms(_identity_attention(moe)),
                           mlp_layer=_swap_norms(_identity_attention(mlp))),
        params={"post_layer_norm": False},
    )
    kw = {"hybrid_stack_spec": stack} if stack_cls.__name__ == "HybridStack" else {"mamba_stack_spec": stack}
    with cpu_shim.tensor_cuda_is_identity():
        model = model_cls(config=config, vocab_size=spec.vocab_size, max_sequence_length=spec.max_sequence_length,
                          pre_process=True, post_process=True, position_embedding_type="learned_absolute",
                          **{pattern_kw: pattern}, **kw)
    model.train()
    deterministic_init([model], spec, ctx)
    return model


def engine_routes(pattern: str, seq_lens: list[int], num_experts: int, topk: int, seed: int) -> list[Any]:
    """What vLLM returns for a Nemotron-H-style model: per sequence ``[len - 1, len(pattern), K]``
    uint8, one entry per pattern symbol, zero rows for layers without experts."""
    import numpy as np

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in seq_lens:
        arr = torch.zeros((n - 1, len(pattern), topk), dtype=torch.uint8)
        for i, c in enumerate(pattern):
            if c == "E":
                arr[:, i] = torch.rand((n - 1, num_experts), generator=g).topk(topk, dim=-1).indices.to(torch.uint8)
        out.append(np.asarray(arr))
    return out


def run_hybrid_check(ctx: "RankContext", pattern: str) -> dict[str, Any]:
    """R3 training step on a hybrid model fed engine-style routes; every router call checked."""
    from replay_grid import _check_probe

    from r3bridge.batch.schema import ReplayBatch
    from r3bridge.errors import ReplayError
    from r3bridge.megatron import Replayer
    from r3bridge.parallel.layout import ParallelLayout
    from r3bridge.testing.harness.data import local_inputs, make_packed_batch, packed_seq_params
    from r3bridge.testing.harness.probe import RoutingProbe

    spec = ModelSpec()
    model = build_hybrid_model(spec, ctx, pattern)
    out: dict[str, Any] = {"router_layer_numbers": sorted(
        int(m.layer_number) for m in model.modules() if type(m).__name__ == "TopKRouter")}
    try:    # what a GPT-style layout (config.moe_layer_freq) would say about this model
        Replayer([model], ParallelLayout.from_megatron(model.config))
        out["freq_layout_error"] = None
    except ReplayError as e:
        out["freq_layout_error"] = f"{type(e).__name__}: {e}"
    rep = Replayer([model])
    out["layer_ids"] = rep.layer_ids
    moe_ids = [i for i, c in enumerate(pattern) if c == "E"]
    seq_lens = [13, 7, 20]
    batch = make_packed_batch(seq_lens, spec.vocab_size, 3)
    routes = ReplayBatch.from_vllm(engine_routes(pattern, seq_lens, spec.num_moe_experts, spec.moe_router_topk, 4),
                                   num_experts=spec.num_moe_experts, moe_layer_ids=moe_ids)
    loc = local_inputs(batch, 1, 0)
    with RoutingProbe([model]) as probe:
        with rep.open_pass("replay", forward_only=False, route_kind="rollout") as st:
            st.install(model, routes, seq_lens, cu_seqlens_padded=batch.cu_seqlens_padded)
            per_token = model(loc["input_ids"], loc["position_ids"], None, labels=loc["labels"],
                              packed_seq_params=packed_seq_params(batch))
            (per_token * loc["loss_mask"]).sum().backward()
    out["errors"] = _check_probe(probe, [batch], [routes], ctx, False, False, rep.layer_ids)
    out["calls"] = sorted({c.layer_id for c in probe.calls})
    out["metrics"] = dict(st.metrics)
    out["grads"] = all(p.grad is not None for n, p in model.named_parameters() if ".router." in n)
    return out

"""The kit's Transformer Engine layer spec, as far as a CPU machine can check it.

TE cannot install here (it needs CUDA); the TE cells themselves run on the GPU
(``scripts/gpu/nccl_conformance.py --spec te``, results in docs/gpu.md). Here: asking for TE
without it fails with an error naming the package, before any rank starts; the GPU script's
refusal expectations are what r3bridge's guards say for the same configs; TE's parameter names
get canonical names and inits like the local spec's.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from r3bridge import ConfigError
from r3bridge.megatron import check_config
from r3bridge.testing.harness.models import ModelSpec, _full_init_value, canonical_name, make_config, require_te

ROOT = Path(__file__).resolve().parents[2]
TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None


def _conformance_script():
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    try:
        import nccl_conformance
    finally:
        sys.path.pop(0)
    return nccl_conformance


def test_te_spec_without_te_names_the_missing_package():
    if TE_INSTALLED:          # a GPU machine with TE: the same call must simply pass
        require_te()
        return
    with pytest.raises(ImportError) as e:
        make_config(ModelSpec(layer_spec="te"), SimpleNamespace(cp=1, tp=1))
    msg = str(e.value)
    assert "transformer-engine" in msg and "layer_spec='local'" in msg, msg


def test_unknown_layer_spec_is_refused():
    with pytest.raises(ValueError, match="layer_spec must be 'local' or 'te'"):
        make_config(ModelSpec(layer_spec="apex"), SimpleNamespace(cp=1, tp=1))  # type: ignore[arg-type]


def test_gpu_script_with_te_spec_fails_before_any_rank_starts():
    if TE_INSTALLED:
        pytest.fail("this CPU test expects a machine without Transformer Engine")
    script = _conformance_script()
    env = dict(os.environ)
    with pytest.raises(ImportError, match="transformer-engine"):
        script.main(["--device", "cpu", "--spec", "te", "--cells", "te_base"])
    assert dict(os.environ) == env


def test_gpu_script_refusal_expectations_match_the_guards():
    """Every TE cell the GPU script expects to be refused is refused by check_config with the
    words the script looks for; every other TE cell's options are accepted."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    script = _conformance_script()
    cells = {c.name: c for c in script.te_cells()}
    assert set(script.REFUSED) <= set(cells)
    for name, cell in cells.items():
        # options whose __post_init__ checks import TE are set after construction
        needs_te = ("fp8", "fp8_recipe", "moe_permute_fusion")
        extra = {k: v for k, v in cell.spec.extra_config.items() if k not in needs_te}
        cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                                moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False,
                                use_cpu_initialization=True, gradient_accumulation_fusion=False, **extra)
        for k in needs_te:
            if k in cell.spec.extra_config:
                setattr(cfg, k, cell.spec.extra_config[k])
        if name in script.REFUSED:
            with pytest.raises(ConfigError) as e:
                check_config(cfg)
            assert script.REFUSED[name] in str(e.value), (name, str(e.value))
        else:
            check_config(cfg)
    # every TE cell builds the TE spec; FP8 cells ask for FP8
    assert all(c.spec.layer_spec == "te" for c in cells.values())
    assert {n for n, c in cells.items() if c.spec.extra_config.get("fp8")} >= {"te_fp8_hybrid", "te_fp8_e4m3"}


def test_te_grouped_expert_weights_get_global_expert_ids():
    chunk = SimpleNamespace(config=SimpleNamespace(num_moe_experts=8))
    ctx = SimpleNamespace(ep=2, ep_rank=1)
    assert canonical_name(chunk, "mtp.layers.0.mlp.experts.linear_fc1.weight3", ctx) == \
        "mtp.layers.0.mlp.experts.linear_fc1.weight7"
    assert canonical_name(chunk, "mtp.layers.0.mlp.experts.linear_fc2.weight0", ctx) == \
        "mtp.layers.0.mlp.experts.linear_fc2.weight4"
    # the local spec's SequentialMLP names are unchanged by the grouped rule
    assert canonical_name(chunk, "mtp.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", ctx) == \
        "mtp.layers.0.mlp.experts.local_experts.5.linear_fc1.weight"


def test_te_fused_norm_weights_start_at_one_and_grouped_fc2_gets_the_scaled_std():
    spec = ModelSpec(layer_spec="te", num_layers=8)
    ctx = SimpleNamespace(tp=1, etp=1, tp_rank=0, etp_rank=0)
    p = torch.nn.Parameter(torch.empty(64))
    linear = torch.nn.Linear(2, 2)
    assert torch.equal(_full_init_value("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", p, linear,
                                        spec, ctx), torch.ones(64))
    assert torch.equal(_full_init_value("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias", p, linear,
                                        spec, ctx), torch.zeros(64))
    w = torch.nn.Parameter(torch.empty(256, 256))
    fc2 = _full_init_value("decoder.layers.0.mlp.experts.linear_fc2.weight3", w, linear, spec, ctx)
    fc1 = _full_init_value("decoder.layers.0.mlp.experts.linear_fc1.weight3", w, linear, spec, ctx)
    assert abs(float(fc2.std()) - spec.init_std / 4) < 5e-4      # 0.02 / sqrt(2 * 8)
    assert abs(float(fc1.std()) - spec.init_std) < 5e-4

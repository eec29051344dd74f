"""The demo's weight transfer on the Transformer Engine layer spec: ``to_te_names`` /
``from_te_names`` (r3bridge/demo/hf_to_mcore.py). TE itself cannot run here; the names are checked
against an independent source, Megatron-Bridge 0.6.2's Qwen3-MoE mapping (megatron-side names of
the TE spec, ``megatron/bridge/models/qwen/qwen3_moe_bridge.py:68-111``)."""

from __future__ import annotations

import fnmatch

import pytest
import torch

# Megatron-Bridge 0.6.2 Qwen3MoEBridge.mapping_registry(): the megatron (TE spec) parameter names
BRIDGE_TE_NAMES = [
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "decoder.final_layernorm.weight",
    "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.*.mlp.router.weight",
    "decoder.layers.*.pre_mlp_layernorm.weight",
    "decoder.layers.*.self_attention.q_layernorm.weight",
    "decoder.layers.*.self_attention.k_layernorm.weight",
    "decoder.layers.*.self_attention.linear_proj.weight",
    "decoder.layers.*.self_attention.linear_qkv.weight",
    "decoder.layers.*.mlp.experts.linear_fc1.weight*",
    "decoder.layers.*.mlp.experts.linear_fc2.weight*",
]


@pytest.fixture(scope="module")
def states():
    from r3bridge.demo.hf_engine import build_hf_model, tiny_qwen3_moe_config
    from r3bridge.demo.hf_to_mcore import hf_to_mcore, to_te_names

    cfg = tiny_qwen3_moe_config()
    local = hf_to_mcore(build_hf_model(cfg).state_dict(), cfg)
    return cfg, local, to_te_names(local)


def test_round_trip_is_exact(states):
    from r3bridge.demo.hf_to_mcore import from_te_names

    _, local, te = states
    back = from_te_names(te)
    assert sorted(back) == sorted(local)
    assert all(back[k] is local[k] for k in local)


def test_te_names_are_the_te_spec_names(states):
    cfg, local, te = states
    assert len(te) == len(local)
    p0, p1 = "decoder.layers.0.", "decoder.layers.1."
    # dense layer 0: the MLP's pre-norm is fused into linear_fc1, no pre_mlp_layernorm
    assert te[p0 + "mlp.linear_fc1.layer_norm_weight"] is local[p0 + "pre_mlp_layernorm.weight"]
    assert p0 + "pre_mlp_layernorm.weight" not in te
    # every layer: the attention's input norm is fused into linear_qkv
    assert te[p1 + "self_attention.linear_qkv.layer_norm_weight"] is local[p1 + "input_layernorm.weight"]
    assert not any(k.endswith("input_layernorm.weight") for k in te)
    # MoE layers keep pre_mlp_layernorm; TEGroupedMLP names expert e's weights "...weight<e>"
    assert te[p1 + "pre_mlp_layernorm.weight"] is local[p1 + "pre_mlp_layernorm.weight"]
    for e in range(cfg.num_experts):
        assert (
            te[p1 + f"mlp.experts.linear_fc1.weight{e}"]
            is local[p1 + f"mlp.experts.local_experts.{e}.linear_fc1.weight"]
        )
        assert (
            te[p1 + f"mlp.experts.linear_fc2.weight{e}"]
            is local[p1 + f"mlp.experts.local_experts.{e}.linear_fc2.weight"]
        )
    # all but the dense MLP's three tensors are names Megatron-Bridge's mapping knows
    dense = {p0 + "mlp.linear_fc1.weight", p0 + "mlp.linear_fc2.weight", p0 + "mlp.linear_fc1.layer_norm_weight"}
    unknown = [k for k in te if k not in dense and not any(fnmatch.fnmatchcase(k, pat) for pat in BRIDGE_TE_NAMES)]
    assert unknown == []
    assert all(isinstance(v, torch.Tensor) for v in te.values())

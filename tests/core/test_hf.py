"""`moe_layer_ids_from_hf_config`: MoE layer ids per model family, checked against the real
Hugging Face modelling code where building a tiny model is cheap."""
from __future__ import annotations

import pytest
import torch
import transformers

from r3bridge.errors import LayerMappingError
from r3bridge.hf import moe_layer_ids_from_hf_config, num_experts_from_hf_config, topk_from_hf_config

TINY = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=64)


def _hf_moe_layers(model):
    """Ids of decoder layers whose mlp is an MoE block (it owns experts) in the real HF model."""
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def test_qwen3_moe_sparse_step_and_mlp_only_layers_match_hf_model():
    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=6, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=8, decoder_sparse_step=2,
                                      mlp_only_layers=[3], head_dim=8, **TINY)
    ids = moe_layer_ids_from_hf_config(cfg)
    assert ids == [1, 5]                       # (i+1) % 2 == 0 -> 1, 3, 5; 3 is mlp-only
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    assert _hf_moe_layers(model) == ids


def test_qwen2_moe_all_layers_by_default():
    cfg = transformers.Qwen2MoeConfig(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=8, shared_expert_intermediate_size=8, **TINY)
    assert moe_layer_ids_from_hf_config(cfg) == [0, 1, 2, 3]
    with torch.device("meta"):
        model = transformers.Qwen2MoeForCausalLM(cfg)
    assert _hf_moe_layers(model) == [0, 1, 2, 3]


def test_deepseek_v3_first_k_dense_matches_hf_model():
    cfg = transformers.DeepseekV3Config(num_hidden_layers=5, first_k_dense_replace=2, n_routed_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=8, n_group=1,
                                        topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                                        qk_nope_head_dim=4, v_head_dim=4, **TINY)
    ids = moe_layer_ids_from_hf_config(cfg)
    assert ids == [2, 3, 4]
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(cfg)
    assert _hf_moe_layers(model) == ids


def test_moonlight_style_dict_with_moe_layer_freq():
    # Moonlight-16B-A3B config.json (deepseek_v3 remote code: i >= k and i % freq == 0)
    d = {"model_type": "deepseek_v3", "num_hidden_layers": 27, "first_k_dense_replace": 1,
         "moe_layer_freq": 1, "n_routed_experts": 64, "num_experts_per_tok": 6}
    assert moe_layer_ids_from_hf_config(d) == list(range(1, 27))
    d2 = dict(d, num_hidden_layers=8, first_k_dense_replace=1, moe_layer_freq=2)
    assert moe_layer_ids_from_hf_config(d2) == [2, 4, 6]
    assert num_experts_from_hf_config(d) == 64 and topk_from_hf_config(d) == 6


def test_glm45_first_k_dense_replace():
    cfg = transformers.Glm4MoeConfig(num_hidden_layers=5, first_k_dense_replace=1, n_routed_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=8, head_dim=8,
                                     n_group=1, topk_group=1, **TINY)
    assert moe_layer_ids_from_hf_config(cfg) == [1, 2, 3, 4]
    with torch.device("meta"):
        model = transformers.Glm4MoeForCausalLM(cfg)
    assert _hf_moe_layers(model) == [1, 2, 3, 4]


def test_mixtral_and_gpt_oss_all_layers():
    mix = transformers.MixtralConfig(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2)
    assert moe_layer_ids_from_hf_config(mix) == [0, 1, 2]
    oss = {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_local_experts": 32,
           "num_experts_per_tok": 4}
    assert moe_layer_ids_from_hf_config(oss) == list(range(24))
    assert topk_from_hf_config(oss) == 4


def test_llama4_moe_layers_and_interleave():
    assert moe_layer_ids_from_hf_config({"num_hidden_layers": 6, "num_local_experts": 16,
                                         "moe_layers": [5, 1, 3]}) == [1, 3, 5]
    assert moe_layer_ids_from_hf_config({"num_hidden_layers": 6, "num_local_experts": 16,
                                         "interleave_moe_layer_step": 2}) == [1, 3, 5]
    with pytest.raises(LayerMappingError):
        moe_layer_ids_from_hf_config({"num_hidden_layers": 2, "num_local_experts": 4, "moe_layers": [2]})


def test_ernie_interval():
    d = {"num_hidden_layers": 6, "moe_num_experts": 8, "moe_layer_interval": 1,
         "moe_layer_start_index": 1, "moe_layer_end_index": -1}
    assert moe_layer_ids_from_hf_config(d) == [1, 2, 3, 4, 5]
    # without the start index a raw dict means what transformers' Ernie4_5_MoeConfig defaults to
    from transformers import Ernie4_5_MoeConfig
    d.pop("moe_layer_start_index")
    assert Ernie4_5_MoeConfig().moe_layer_start_index == 1
    assert moe_layer_ids_from_hf_config(d) == [1, 2, 3, 4, 5]


def test_dense_and_nested_text_config():
    assert moe_layer_ids_from_hf_config({"num_hidden_layers": 4}) == []
    assert moe_layer_ids_from_hf_config({"num_hidden_layers": 4, "num_experts": 0}) == []
    vlm = {"model_type": "qwen3_vl_moe",
           "text_config": {"num_hidden_layers": 3, "num_experts": 8, "decoder_sparse_step": 1,
                           "mlp_only_layers": []}}
    assert moe_layer_ids_from_hf_config(vlm) == [0, 1, 2]
    with pytest.raises(LayerMappingError):
        moe_layer_ids_from_hf_config({"num_experts": 4})


def test_model_info_reads_every_field_the_adapters_need():
    from r3bridge.hf import ModelInfo

    info = ModelInfo.from_hf_config({"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8,
                                     "num_experts_per_tok": 2, "mlp_only_layers": [0]})
    assert (info.num_experts, info.moe_layer_ids, info.num_layers, info.topk) == (8, [1, 2, 3], 4, 2)
    # numpy / tensor ints from a framework config become plain ints
    import numpy as np
    info = ModelInfo(num_experts=np.int64(4), moe_layer_ids=np.array([1, 3]), num_layers=np.int32(4))
    assert info.moe_layer_ids == [1, 3] and type(info.num_experts) is int and info.topk is None

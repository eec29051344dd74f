"""What differs between megatron-core 0.16 and 0.19 for replay: the guards for routing paths that
only later releases have, the release window of ``check_megatron``, the MoE metrics tracker reset.

Options that do not exist in the installed release are set on a plain copy of a real
``TransformerConfig`` (``SimpleNamespace`` of its fields): ``check_config`` reads them by name, as
it does on the release that has them. The same tests run unchanged on 0.19 (scripts/version_matrix.py).
"""
from __future__ import annotations

import types

import pytest
import torch

from r3bridge import ConfigError
from r3bridge.megatron import check_config


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                            moe_router_topk=2, moe_token_dispatcher_type="alltoall", use_cpu_initialization=True,
                            add_bias_linear=False, gradient_accumulation_fusion=False)
    ns = types.SimpleNamespace(**vars(cfg))
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


def test_plain_config_copy_is_accepted():
    check_config(_config())


# option -> (value, words the error must contain); each exists from the release in the comment
NEW_BYPASSES = {
    "quantile_balancing": ({"moe_router_load_balancing_type": "quantile_balancing", "moe_aux_loss_coeff": 0.0},
                           ["quantile_balancing", "precomputed_indices"]),                       # 0.19
    "quantile_balancing_in_list": ({"moe_router_load_balancing_type": ["seq_aux_loss", "quantile_balancing"]},
                                   ["quantile_balancing"]),
    "force_biased": ({"moe_router_force_biased": 0.1}, ["moe_router_force_biased"]),          # 0.17
    "force_biased_negative": ({"moe_router_force_biased": -0.1}, ["moe_router_force_biased"]),
    "rank_capacity_hybridep": ({"moe_expert_rank_capacity_factor": 1.5, "moe_token_dispatcher_type": "flex",
                                "moe_flex_dispatcher_backend": "hybridep"}, ["moe_expert_rank_capacity_factor"]),  # 0.18
    "inference_optimized": ({"transformer_impl": "inference_optimized"}, ["inference_optimized"]),
    "full_iteration_graph": ({"cuda_graph_impl": "full_iteration", "cuda_graph_modules": []},
                             ["full_iteration"]),                                                  # 0.19
    # 0.18+: __post_init__ moves cuda_graph_scope into cuda_graph_modules and sets it to None
    "router_graph_modules": ({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": None,
                              "cuda_graph_modules": ["moe_router", "moe_preprocess"]}, ["moe_router"]),
    "whole_layer_graph_modules": ({"cuda_graph_impl": "local", "cuda_graph_scope": None,
                                   "cuda_graph_modules": []}, ["cuda_graph_modules"]),
    # every release: two stages + virtual stages + batched p2p swaps the directions (test_pp2_interleaved.py)
    "pp2_interleaved_batched_p2p": ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
                                     "batch_p2p_comm": True}, ["batch_p2p_comm=True", "#1450"]),
    # every release: two stages + virtual stages + variable lengths: the shape exchange crosses directions
    "pp2_interleaved_shapes": ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
                                "batch_p2p_comm": False, "overlap_p2p_comm": False, "variable_seq_lengths": True},
                               ["overlap_p2p_comm=False", "#5271"]),
}


@pytest.mark.parametrize("name", sorted(NEW_BYPASSES))
def test_later_release_bypasses_are_refused(name):
    overrides, words = NEW_BYPASSES[name]
    with pytest.raises(ConfigError) as e:
        check_config(_config(**overrides))
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides", [
    # capture of attention only never contains a router
    {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": None, "cuda_graph_modules": ["attn"]},
    # ncclep fails loudly over the budget instead of dropping
    {"moe_expert_rank_capacity_factor": 2.0, "moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "ncclep"},
    {"moe_router_force_biased": None, "moe_router_load_balancing_type": "seq_aux_loss"},
    # the p2p guard only where the two directions share one peer and are batched
    {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "batch_p2p_comm": False,
     "overlap_p2p_comm": True, "variable_seq_lengths": True},
    {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "batch_p2p_comm": False,
     "overlap_p2p_comm": False, "variable_seq_lengths": False},
    {"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2, "batch_p2p_comm": True},
    {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": None, "batch_p2p_comm": True},
], ids=["attn_graphs", "ncclep_budget", "defaults", "pp2_vpp_overlapped", "pp2_vpp_fixed_lengths", "pp4_vpp_batched",
       "pp2_no_vpp"])
def test_later_release_options_that_keep_replay_exact_are_accepted(overrides):
    check_config(_config(**overrides))


def _real_config(**kw):
    """The installed release's own TransformerConfig, __post_init__ normalisation included."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                             moe_router_topk=2, moe_token_dispatcher_type="alltoall", use_cpu_initialization=True,
                             add_bias_linear=False, gradient_accumulation_fusion=False, **kw)


# Transformer Engine's paths that touch routing (tried on 1 x H100 with TE 2.20.2:
# scripts/gpu/nccl_conformance.py --spec te, docs/gpu.md): TE CUDA graphs of the whole layer
# (megatron's default scope) or of the router capture the router; the 0.16 spellings too.
TE_GRAPHS = {
    "te_graphs_default_scope": dict(cuda_graph_impl="transformer_engine"),
    "te_graphs_moe_router": dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe_router"]),
    # scope "moe" needs drop-padding MoE (a capacity factor), refused on its own
    "external_cuda_graph": dict(external_cuda_graph=True),      # 0.16's deprecated name for TE graphs
    "enable_cuda_graph": dict(enable_cuda_graph=True),          # 0.16's deprecated name for local graphs
}


@pytest.mark.parametrize("name", sorted(TE_GRAPHS))
def test_cuda_graphs_that_capture_the_router_are_refused(name):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # the deprecated spellings warn
        cfg = _real_config(**TE_GRAPHS[name])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert "CUDA graphs capture the router" in str(e.value) and "'attn'" in str(e.value), str(e.value)


def test_te_graphs_of_attention_only_are_accepted():
    check_config(_real_config(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"]))


def test_router_fusion_is_refused_naming_the_option_and_the_fused_path():
    with pytest.raises(ConfigError) as e:
        check_config(_real_config(moe_router_fusion=True))
    for words in ("moe_router_fusion=True", "fused_topk_with_score_function", "moe_router_fusion=False"):
        assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("fp8", ["hybrid", "e4m3"])
def test_fp8_and_permute_fusion_keep_replay_exact(fp8):
    """FP8 GEMMs and the fused permutation act after the router's top-k: accepted (replayed
    exactly on 1 x H100, docs/gpu.md); the packing comes from the trainer, not from config.fp8."""
    cfg = _config(fp8=fp8, moe_permute_fusion=True)
    check_config(cfg)


def test_router_fusion_is_refused_on_every_release_with_the_fused_early_return():
    """The fused top-k returns before ``router_replay`` in the installed release's moe_utils too."""
    import inspect

    from megatron.core.transformer.moe import moe_utils

    src = inspect.getsource(moe_utils.topk_routing_with_score_function)
    fused_at, replay_at = src.index("return fused_topk_with_score_function("), src.index("router_replay.get_replay_topk")
    assert fused_at < replay_at
    with pytest.raises(ConfigError, match="moe_router_fusion"):
        check_config(_config(moe_router_fusion=True))


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as e:
        check_config(_config(moe_router_force_biased=0.1, moe_router_load_balancing_type="quantile_balancing"))
    assert "moe_router_force_biased" in str(e.value) and "quantile_balancing" in str(e.value)


def test_release_window(monkeypatch):
    from megatron.core import package_info

    from r3bridge.megatron import check_megatron
    from r3bridge.megatron.compat import megatron_version

    check_megatron()                       # the installed release is one of the checked ones
    assert (0, 16, 0) <= megatron_version() < (0, 20, 0)
    monkeypatch.setattr(package_info, "MINOR", 20)
    monkeypatch.setattr(package_info, "MAJOR", 0)
    with pytest.raises(ConfigError, match="newer than the releases"):
        check_megatron()


def test_router_takes_padding_mask_on_every_supported_release():
    from r3bridge.megatron.compat import router_takes_padding_mask

    assert router_takes_padding_mask()


def _record(name: str, layer_number: int, num_layers: int) -> None:
    """One aux-loss value through the installed release's own tracker API."""
    value = torch.tensor(1.0)
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:                    # 0.16 / 0.17
        from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

        save_to_aux_losses_tracker(name, value, layer_number, num_layers)
        return
    get_moe_metrics_tracker().record(name, value, layer_number, num_layers)


def test_metrics_tracker_reset_lets_a_larger_model_record():
    from r3bridge.megatron.compat import reset_moe_metrics_tracker

    reset_moe_metrics_tracker()
    _record("r3bridge_test_loss", 4, num_layers=4)        # a 4-layer model sizes the tracker
    with pytest.raises(IndexError):                        # what pp2_uneven_dense_stage hit on 0.19
        _record("r3bridge_test_loss", 6, num_layers=6)
    reset_moe_metrics_tracker()
    _record("r3bridge_test_loss", 6, num_layers=6)
    reset_moe_metrics_tracker()

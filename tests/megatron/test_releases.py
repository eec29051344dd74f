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

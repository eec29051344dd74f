"""Configurations under which replay cannot be exact are refused up front (design principle 6).

Each check names the option and why. Options that exist only in later megatron-core releases are
read with ``getattr`` defaults, so one function serves 0.16 through 0.19; docs/support-matrix.md
lists, per release, the routing paths of ``router.py`` / ``moe_utils.py`` that never reach the
replay hook and the check here that refuses each.
"""
from __future__ import annotations

from typing import Any

from r3bridge.errors import ConfigError

# CUDA graph scopes that capture the router (its Python replay branch would be baked in).
_ROUTER_CAPTURING_SCOPES = {"full", "full_iteration", "moe", "moe_router", "moe_preprocess"}


def _scopes(config: Any) -> set[str]:
    # 0.18+ renamed cuda_graph_scope to cuda_graph_modules: __post_init__ moves a given scope
    # there and sets cuda_graph_scope to None, so read the new name first where it exists.
    scope = getattr(config, "cuda_graph_modules", None)
    if scope is None:
        scope = getattr(config, "cuda_graph_scope", None)
    if scope is None:
        return set()
    items = scope if isinstance(scope, (list, tuple)) else [scope]
    names = {getattr(s, "name", str(s)) for s in items}
    return names or {"full"}   # an empty list means the full layer


def check_config(config: Any) -> None:
    """Raise ConfigError for every option that makes router replay inexact or a no-op."""
    g = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    problems = []
    if g("moe_router_fusion"):
        # moe_utils.topk_routing_with_score_function returns TE's fused_topk_with_score_function
        # before router_replay is looked at, in every release 0.16.1-0.19.2 (checked in the wheels)
        problems.append("moe_router_fusion=True: the fused TE kernel (fused_topk_with_score_function in "
                        "moe_utils.topk_routing_with_score_function) returns before the replay hook is consulted "
                        "in megatron-core 0.16-0.19; set moe_router_fusion=False")
    lb = g("moe_router_load_balancing_type", "aux_loss")
    lbs = lb if isinstance(lb, (list, tuple)) else [lb]
    if "sinkhorn" in lbs:
        problems.append("moe_router_load_balancing_type='sinkhorn': sinkhorn routing never consults the replay hook")
    if "quantile_balancing" in lbs:
        # 0.19: TopKRouter.routing takes its own branch, picks the experts itself and passes them
        # as precomputed_indices to topk_routing_with_score_function (the only caller that does)
        problems.append("moe_router_load_balancing_type='quantile_balancing': quantile-balancing routing selects "
                        "experts itself (precomputed_indices) and never consults the replay hook")
    if g("moe_expert_capacity_factor") is not None:
        problems.append("moe_expert_capacity_factor is set: token dropping can discard replayed assignments")
    if g("moe_pad_expert_input_to_capacity"):
        problems.append("moe_pad_expert_input_to_capacity=True: pad-to-capacity can discard replayed assignments")
    if g("moe_router_force_load_balancing"):
        problems.append("moe_router_force_load_balancing=True: routing uses random logits")
    if g("moe_router_force_biased") is not None:
        problems.append(f"moe_router_force_biased={g('moe_router_force_biased')!r}: a random bias is added to the "
                        f"router logits (a benchmark option), so the gate weights of replayed experts are not the model's")
    rank_cf = g("moe_expert_rank_capacity_factor")
    if rank_cf is not None and not (g("moe_token_dispatcher_type") == "flex"
                                    and g("moe_flex_dispatcher_backend") == "ncclep"):
        # hybridep drops tokens over the per-rank budget; only ncclep fails loudly instead
        problems.append(f"moe_expert_rank_capacity_factor={rank_cf!r}: tokens over an expert rank's budget are "
                        f"dropped, discarding replayed assignments")
    if g("transformer_impl") == "inference_optimized":
        problems.append("transformer_impl='inference_optimized': InferenceTopKRouter runs the hook inside "
                        "torch.compile with dense outputs (megatron's inference path, not a trainer's)")
    impl = g("cuda_graph_impl", "none")
    if impl == "full_iteration":
        problems.append("cuda_graph_impl='full_iteration': the whole forward-backward, routers included, is one "
                        "CUDA graph; the replay branch would be baked into it")
    graphs = g("enable_cuda_graph") or g("external_cuda_graph") or impl not in (None, "none", "full_iteration")
    if graphs and _scopes(config) & _ROUTER_CAPTURING_SCOPES:
        problems.append(f"CUDA graphs capture the router (cuda_graph_impl={impl!r}, "
                        f"cuda_graph_scope / cuda_graph_modules={sorted(_scopes(config))}): "
                        f"the replay branch would be baked into the graph; restrict the scope to 'attn'")
    if g("num_microbatches_with_partial_activation_checkpoints") is not None:
        problems.append("num_microbatches_with_partial_activation_checkpoints is set: micro-batches would be "
                        "recomputed unevenly")
    if g("overlap_moe_expert_parallel_comm"):
        problems.append("overlap_moe_expert_parallel_comm=True: the combined 1F1B A2A-overlap schedule "
                        "interleaves micro-batches inside a layer")
    vpp = g("virtual_pipeline_model_parallel_size")
    if g("pipeline_model_parallel_size", 1) == 2 and vpp is not None and vpp > 1:
        # With two stages the previous and the next stage are one rank, and point-to-point ops to
        # one peer pair in posting order (NCCL and gloo alike). The interleaved 1F1B steady state
        # without overlap_p2p_comm exchanges both directions in one call: send_prev, recv_prev,
        # send_next, recv_next on both ranks, so each receives the other's gradient as its
        # activation (batch_p2p_comm=True: same shapes, no error), and variable_seq_lengths' shape
        # exchange, always batched, crosses the two shapes (different lengths: wrong-size buffers).
        # overlap_p2p_comm splits the directions. Megatron-LM #1450 / #5271; megatron-core
        # 0.16.1-0.19.2 pipeline_parallel/p2p_communication.py; tests/megatron/test_pp2_interleaved.py.
        if g("batch_p2p_comm", False):
            problems.append("pipeline_model_parallel_size=2 with virtual pipeline stages and batch_p2p_comm=True: "
                            "megatron's batched p2p swaps activations and gradients between the two stages "
                            "(Megatron-LM #1450); set batch_p2p_comm=False and overlap_p2p_comm=True (what "
                            "Megatron-LM, mbridge and the frameworks set for interleaved schedules)")
        elif g("variable_seq_lengths", False) and not g("overlap_p2p_comm", False):
            problems.append("pipeline_model_parallel_size=2 with virtual pipeline stages, variable_seq_lengths=True "
                            "and overlap_p2p_comm=False: megatron's shape exchange crosses the two directions "
                            "(Megatron-LM #5271), so micro-batches of different lengths are received into "
                            "buffers of the wrong shape; set overlap_p2p_comm=True")
    if g("moe_enable_routing_replay"):
        problems.append("moe_enable_routing_replay=True: megatron's own RouterReplay (or a framework driving it, "
                        "e.g. a framework's own router replay switch) would replay too; r3bridge attaches its own hook, "
                        "so keep megatron's disabled")
    if problems:
        raise ConfigError("exact routing replay is impossible with this megatron config:\n  - " + "\n  - ".join(problems))

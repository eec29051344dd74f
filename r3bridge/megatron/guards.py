"""Configurations under which replay cannot be exact are refused up front (design principle 6).

Each check names the option and why: each is an option under which
megatron would bypass the router hook silently (docs/driver-api.md).
"""
from __future__ import annotations

from typing import Any

from r3bridge.errors import ConfigError

# CUDA graph scopes that capture the router (its Python replay branch would be baked in).
_ROUTER_CAPTURING_SCOPES = {"full", "full_iteration", "moe", "moe_router", "moe_preprocess"}


def _scopes(config: Any) -> set[str]:
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
        problems.append("moe_router_fusion=True: the fused TE kernel returns before the replay hook is consulted")
    lb = g("moe_router_load_balancing_type", "aux_loss")
    if "sinkhorn" in (lb if isinstance(lb, (list, tuple)) else [lb]):
        problems.append("moe_router_load_balancing_type='sinkhorn': sinkhorn routing never consults the replay hook")
    if g("moe_expert_capacity_factor") is not None:
        problems.append("moe_expert_capacity_factor is set: token dropping can discard replayed assignments")
    if g("moe_pad_expert_input_to_capacity"):
        problems.append("moe_pad_expert_input_to_capacity=True: pad-to-capacity can discard replayed assignments")
    if g("moe_router_force_load_balancing"):
        problems.append("moe_router_force_load_balancing=True: routing uses random logits")
    graphs = g("enable_cuda_graph") or g("external_cuda_graph") or g("cuda_graph_impl", "none") not in (None, "none")
    if graphs and _scopes(config) & _ROUTER_CAPTURING_SCOPES:
        problems.append(f"CUDA graphs capture the router (cuda_graph_impl={g('cuda_graph_impl')!r}, "
                        f"cuda_graph_scope={g('cuda_graph_scope')!r}): "
                        f"the replay branch would be baked into the graph; restrict the scope to 'attn'")
    if g("num_microbatches_with_partial_activation_checkpoints") is not None:
        problems.append("num_microbatches_with_partial_activation_checkpoints is set: micro-batches would be "
                        "recomputed unevenly")
    if g("overlap_moe_expert_parallel_comm"):
        problems.append("overlap_moe_expert_parallel_comm=True: the combined 1F1B A2A-overlap schedule "
                        "interleaves micro-batches inside a layer")
    if g("moe_enable_routing_replay"):
        problems.append("moe_enable_routing_replay=True: megatron's own RouterReplay (or a framework driving it, "
                        "e.g. verl's router_replay.mode) would replay too; r3bridge attaches its own hook, "
                        "so keep megatron's disabled")
    if problems:
        raise ConfigError("exact routing replay is impossible with this megatron config:\n  - " + "\n  - ".join(problems))

"""The one check that the installed megatron-core has the hook r3bridge relies on.

megatron-core >= 0.16 calls ``router.router_replay.get_replay_topk(scores, topk, num_groups,
group_topk, default_compute_topk)`` from ``topk_routing_with_score_function`` whenever
``router.router_replay`` is not None. Older versions have no such call: replay would silently do
nothing, so they are refused.
"""
from __future__ import annotations

import inspect

from r3bridge.errors import ConfigError

MIN_MEGATRON_CORE = (0, 16, 0)


def megatron_version() -> tuple[int, int, int]:
    try:
        from megatron.core import package_info
    except ImportError as e:  # pragma: no cover - exercised only without megatron
        raise ConfigError("r3bridge.megatron needs megatron-core >= 0.16 (pip install 'r3bridge[megatron]')") from e
    return (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))


def check_megatron() -> None:
    """Raise ConfigError unless megatron-core has the per-router replay hook."""
    v = megatron_version()
    from megatron.core.transformer.moe import moe_utils, router

    has_hook = "router_replay" in inspect.signature(moe_utils.topk_routing_with_score_function).parameters
    if v < MIN_MEGATRON_CORE or not has_hook or not hasattr(router.TopKRouter, "routing"):
        raise ConfigError(
            f"megatron-core {'.'.join(map(str, v))} has no per-router replay hook "
            f"(router.router_replay / get_replay_topk); r3bridge needs megatron-core >= "
            f"{'.'.join(map(str, MIN_MEGATRON_CORE))}")

"""Which megatron-core releases r3bridge runs on, and the few places where they differ.

megatron-core 0.16.0 through 0.19.x call ``router.router_replay.get_replay_topk(scores, topk,
num_groups, group_topk, default_compute_topk)`` from ``topk_routing_with_score_function``
whenever ``router.router_replay`` is not None, and ``TopKRouter.routing(logits, padding_mask)``
keeps rows marked as padding out of the aux / z losses and the expert-bias token counts. That is
the whole contract: one code path for every supported release. Older releases have no hook
(replay would silently do nothing) and are refused; newer ones are refused until their
``router.py`` / ``moe_utils.py`` have been read for new paths that bypass the hook
(docs/support-matrix.md lists what was checked per release).

Where the releases differ outside the router (the process-global MoE metrics tracker moved to
``moe_logging`` in 0.18), a helper here hides it, feature-detected rather than version-compared.
"""
from __future__ import annotations

import inspect

from packaging.version import Version

from r3bridge.errors import ConfigError
from r3bridge.versions import supported_range

MIN_MEGATRON_CORE = (0, 16, 0)      # the first release with the per-router hook
# The checked window itself is r3bridge's `megatron` extra (pyproject.toml), read back at run time
# (r3bridge.versions.supported_range): the first release past it has not been checked for hook bypasses.


def megatron_version() -> tuple[int, int, int]:
    try:
        from megatron.core import package_info
    except ImportError as e:  # pragma: no cover - exercised only without megatron
        raise ConfigError("r3bridge.megatron needs megatron-core >= 0.16 (pip install 'r3bridge[megatron]')") from e
    return (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))


def _megatron_release() -> Version:
    from megatron.core import package_info
    major, minor, patch = megatron_version()
    return Version(f"{major}.{minor}.{patch}{getattr(package_info, 'PRE_RELEASE', '') or ''}")


def check_megatron() -> None:
    """Raise ConfigError unless megatron-core is a checked release with the per-router hook."""
    v = _megatron_release()
    spec = supported_range("megatron-core")
    from megatron.core.transformer.moe import moe_utils, router

    has_hook = "router_replay" in inspect.signature(moe_utils.topk_routing_with_score_function).parameters
    too_new = any(s.operator in ("<", "<=") and not s.contains(v, prereleases=True) for s in spec)
    if not too_new and (not spec.contains(v, prereleases=True) or not has_hook
                        or not hasattr(router.TopKRouter, "routing")):
        raise ConfigError(
            f"megatron-core {v} has no per-router replay hook (router.router_replay / get_replay_topk); "
            f"r3bridge supports megatron-core{spec}")
    if too_new:
        raise ConfigError(
            f"megatron-core {v} is newer than the releases r3bridge was checked against (megatron-core{spec}): "
            f"a new routing path could bypass the replay hook and replay would silently do nothing")


def router_takes_padding_mask() -> bool:
    """``TopKRouter.routing(logits, padding_mask)`` exists (every supported release has it)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return "padding_mask" in inspect.signature(TopKRouter.routing).parameters


def reset_moe_metrics_tracker() -> None:
    """Forget megatron's process-global MoE loss/metrics tracker.

    The tracker sizes each metric's per-layer tensor by the first model that records it
    (``num_layers + mtp_num_layers``) and never resizes it, so a second, larger model in the same
    process indexes past it (``IndexError`` in ``moe_logging.py:125`` on 0.19). 0.16-0.17 keep
    it as a module dict in ``moe_utils``; 0.18+ as a ``MoEMetricsTracker`` in ``moe_logging``,
    whose ``clear()`` only zeroes values and whose legacy ``get_moe_layer_wise_logging_tracker()``
    returns a fresh copy (clearing that copy changes nothing).
    """
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:
        moe_logging = None
    if moe_logging is not None and hasattr(moe_logging, "destroy_moe_metrics_tracker"):
        moe_logging.destroy_moe_metrics_tracker()
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()

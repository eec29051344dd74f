"""How a phase's driver metrics are named and summarised before a framework logs them:
:func:`summarize_layers` (per-layer keys opt-in, a compact summary by default) and
:func:`tag_phase` (``r3bridge/coverage`` -> ``r3bridge/update/coverage``). Keys: ``docs/metrics.md``.
"""
from __future__ import annotations

import re
from typing import Mapping

__all__ = ["summarize_layers", "tag_phase", "WORST_LAYERS"]

WORST_LAYERS = 3      # per-layer agreement keys kept by default: the least-agreeing layers


def summarize_layers(metrics: Mapping[str, float], prefix: str, *, per_layer: bool = False,
                     worst: int = WORST_LAYERS) -> dict[str, float]:
    """``metrics`` with its ``{prefix}agreement/layer_<id>`` keys summarised.

    Adds ``{prefix}agreement/layer_min`` (the lowest per-layer agreement; trackers that reduce by
    name take its minimum over passes: by the ``min`` in the name, or as a MIN
    stat). Keeps every per-layer key when ``per_layer`` (``ReplayConfig.per_layer_metrics``), else
    only the ``worst`` least-agreeing layers' (ties: lower layer id first), so a 48-layer model logs
    a handful of keys per phase instead of 48. ``agreement/mean`` is untouched."""
    pattern = re.compile(re.escape(f"{prefix}agreement/layer_") + r"(\d+)$")
    layers = {int(m.group(1)): float(v) for k, v in metrics.items() if (m := pattern.match(k))}
    out = {k: float(v) for k, v in metrics.items() if not pattern.match(k)}
    if not layers:
        return out
    ranked = sorted(layers.items(), key=lambda kv: (kv[1], kv[0]))
    out[f"{prefix}agreement/layer_min"] = ranked[0][1]
    keep = ranked if per_layer else ranked[:max(0, int(worst))]
    out.update({f"{prefix}agreement/layer_{lid}": value for lid, value in sorted(keep)})
    return out


def tag_phase(metrics: Mapping[str, float], prefix: str, tag: str) -> dict[str, float]:
    """One schedule run's driver metrics named as every adapter logs them:
    ``{prefix}coverage`` -> ``{prefix}{tag}/coverage`` (tag ``old_log_prob`` or ``update``)."""
    return {f"{prefix}{tag}/{k[len(prefix):] if k.startswith(prefix) else k}": float(v) for k, v in metrics.items()}


"""Routing weights: the engine's gate weight of each replayed expert, per (row, layer, k).

Optional next to the routes (``ReplayBatch.weights``, ``None`` by default): float16
``[total_rows, L, K]``, aligned with ``routes`` entry by entry. What they are for
(docs/architecture.md, "Routing weights and replay policies"): the router log-ratio of router
importance sampling (prime-rl #1406 / #1661, RSPO arXiv 2510.23027) needs the rollout's router
probabilities of the replayed experts, which an indices-only schema cannot carry (SGLang #23999
proposes returning them).

Rows without a route hold weight 0 (like their filler ids, a canonical value: two batches with
the same routes and weights are byte-identical).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from r3bridge._validate import as_number_tensor
from r3bridge.engines.route_checks import locate
from r3bridge.errors import RouteWeightsError

__all__ = ["WEIGHTS_DTYPE", "as_weights_tensor", "check_weights", "canonical_weights"]

# Gate weights are probabilities in [0, 1] (times a routed scaling factor): float16's 11-bit
# mantissa keeps them to ~5e-4 relative, half the bytes of float32 and a quarter of the int32
# ids SGLang sends.
WEIGHTS_DTYPE = torch.float16


def as_weights_tensor(x: Any, *, what: str) -> torch.Tensor:
    """numpy array / tensor / nested lists of real numbers -> a float tensor (not yet narrowed)."""
    t = as_number_tensor(x, what=what, error=RouteWeightsError, kinds="fiu", expected="real numbers (weights)")
    if t.dtype == torch.bool or t.is_complex():
        raise RouteWeightsError(f"{what}: weights must be real numbers, got {t.dtype}")
    return t if t.is_floating_point() else t.to(torch.float32)


def check_weights(
    weights: Any,
    routes: torch.Tensor,
    valid: torch.Tensor,
    layer_ids: Sequence[int],
    offsets: torch.Tensor,
    starts: Sequence[int],
) -> torch.Tensor:
    """``weights`` as the schema keeps them: float16 ``[rows, L, K]`` on the routes' device, zeros
    on rows without a route. Raises :class:`RouteWeightsError` naming sequence, row, token and
    layer of the first value that is not finite, negative, or beyond float16's range."""
    w = as_weights_tensor(weights, what="weights")
    if tuple(w.shape) != tuple(routes.shape):
        raise RouteWeightsError(
            f"weights have shape {tuple(w.shape)}, routes {tuple(routes.shape)}: one weight per (row, layer, k)"
        )
    w = w.to(routes.device)
    narrow = w.to(WEIGHTS_DTYPE)
    # checked after narrowing too: 1e5 is finite in float32 and inf in float16
    bad = (~torch.isfinite(w) | (w < 0) | ~torch.isfinite(narrow)).any(-1) & valid.to(w.device)[:, None]
    hits = bad.nonzero()
    if hits.numel():
        r, col = int(hits[0, 0]), int(hits[0, 1])
        seq, row, tok = locate(offsets, starts, r)
        raise RouteWeightsError(
            f"sequence {seq}, row {row} (token {tok}), layer {layer_ids[col]}: weights "
            f"{w[r, col].tolist()} must be finite, non-negative and within float16 range "
            f"({int(bad.sum())} bad (row, layer) pairs in total)"
        )
    if narrow.data_ptr() == w.data_ptr() or narrow.data_ptr() == getattr(weights, "data_ptr", lambda: None)():
        narrow = narrow.clone()  # never alias the caller's buffer: rows without a route are zeroed
    return canonical_weights(narrow, valid)


def canonical_weights(weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Zero the weights of rows without a route (in place; returns ``weights``)."""
    if weights.numel() and not bool(valid.all()):
        weights[~valid.to(weights.device)] = 0
    return weights

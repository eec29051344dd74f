"""What the reader hands the driver: one rank's router targets for one micro-batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ShardedTargets"]


@dataclass
class ShardedTargets:
    """One rank's replay targets for one micro-batch.

    ``indices[layer_id]`` is the int64 ``[T_local, K]`` target of that MoE layer's router, rows in
    router order; ``valid[r]`` is False where row ``r`` has no route (filler ids ``0..K-1``).
    """

    indices: dict[int, torch.Tensor]
    valid: torch.Tensor
    layer_ids: tuple[int, ...]
    topk: int
    num_valid: int | None = None    # valid.sum(), counted on the host (no device sync)
    # the rollout's gate weight of each target id (float32 [T_local, K] per layer, 0 on rows
    # without a route); None when the routes carry no weights
    weights: dict[int, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.valid.numel())

    @property
    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self.indices.values()) + self.valid.numel()
                + sum(t.numel() * t.element_size() for t in (self.weights or {}).values()))

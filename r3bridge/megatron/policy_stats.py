"""What the replay policy and the routing weights add to a replay step: the threshold policy's
replaced fraction and the router log-ratio (formulas: :mod:`r3bridge.replay_policy`).

The router log-ratio needs the gate weights megatron-core's router applied to the replayed
experts. Those are the ``probs`` its ``TopKRouter.forward`` returns, computed by megatron's own
score function after the replay hook handed back the indices; a forward hook on the router
*instance* (removed when the step ends) reads them, so no routing math is repeated here. The
step announces each forward router call that has rollout weights (:meth:`PolicyStats.expect`);
the hook of that router, which runs right after, consumes the announcement. Recomputes announce
nothing: the forward already counted.

Counts accumulate on the device (no host sync per router call) and are summed over the
metrics groups at the end of the step, like the agreement counter.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence

import torch

from r3bridge.megatron.installed import InstalledMicroBatch
from r3bridge.replay_policy import router_log_ratio

__all__ = ["PolicyStats"]

# counts columns
_REPLACED, _SLOTS, _LR_SUM, _LR_ABS, _LR_PAIRS = range(5)


class _Scaling(Protocol):
    topk_scaling_factor: Optional[float]


class _Step(Protocol):
    replayer: _Scaling


class PolicyStats:
    """Per-step counters and per-(chunk, micro-batch) router log-ratios."""

    def __init__(self, prefix: str, *, device: torch.device) -> None:
        self.prefix = prefix
        self.counts = torch.zeros(5, dtype=torch.float64, device=device)
        # (chunk, micro-batch) -> float32 [rows]: sum over the chunk's layers of the log-ratio
        self.log_ratio: dict[tuple[int, int], torch.Tensor] = {}
        self._expected: dict[
            tuple[int, int],
            tuple[InstalledMicroBatch, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
        ] = {}

    # ------------------------------------------------------------------------- fed by the step
    def count_replaced(self, replaced: torch.Tensor, num_valid: Optional[int], topk: int) -> None:
        """One forward router call of the threshold policy: its replaced (row, k) slots out of
        the slots of rows with a route."""
        self.counts[_REPLACED] += replaced.sum()
        self.counts[_SLOTS] += float((num_valid if num_valid is not None else replaced.shape[0]) * topk)

    def expect(
        self,
        mb: InstalledMicroBatch,
        layer: int,
        idx: torch.Tensor,
        rollout_weights: torch.Tensor,
        valid: torch.Tensor,
        kept: Optional[torch.Tensor],
    ) -> None:
        """The forward router call of ``layer`` for ``mb`` dispatched ``idx``; the rollout's
        weights of the replayed ids are ``rollout_weights`` (``kept``: slots the policy kept)."""
        self._expected[(mb.chunk, layer)] = (mb, idx, rollout_weights, valid, kept)

    # ------------------------------------------------------------------------- router hooks
    def attach(self, routers: Sequence[Mapping[int, torch.nn.Module]], step: _Step) -> list[Any]:
        handles = []
        for c, chunk_routers in enumerate(routers):
            for layer, router in chunk_routers.items():
                handles.append(router.register_forward_hook(self._hook(step, c, layer)))
        return handles

    def _hook(self, step: _Step, chunk: int, layer: int):
        def post(module: torch.nn.Module, args: tuple, output: Any) -> None:
            entry = self._expected.pop((chunk, layer), None)
            if entry is None:
                return
            mb, idx, rollout, valid, kept = entry
            probs = output[0].detach()
            train = probs.gather(1, idx).float()
            scale = step.replayer.topk_scaling_factor
            if scale:  # engines report the weights before the routed scaling factor
                train = train / scale
            mask = valid[:, None] if kept is None else kept & valid[:, None]
            ratio = router_log_ratio(train, rollout, mask)
            key = (mb.chunk, mb.index)
            self.log_ratio[key] = ratio if key not in self.log_ratio else self.log_ratio[key] + ratio
            self.counts[_LR_SUM] += ratio.sum()
            self.counts[_LR_ABS] += ratio.abs().sum()
            self.counts[_LR_PAIRS] += valid.sum()

        return post

    # ------------------------------------------------------------------------- end of step
    def metrics(self, groups: Sequence[Any], *, threshold: bool) -> dict[str, float]:
        counts = self.counts
        import torch.distributed as dist

        if groups and dist.is_available() and dist.is_initialized():
            for group in groups:
                dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        replaced, slots, lr_sum, lr_abs, pairs = counts.tolist()
        out: dict[str, float] = {}
        if threshold:
            out[f"{self.prefix}replay/threshold_replaced_fraction"] = replaced / slots if slots else 0.0
        if pairs:
            out[f"{self.prefix}replay/router_log_ratio_mean"] = lr_sum / pairs
            out[f"{self.prefix}replay/router_log_ratio_abs_mean"] = lr_abs / pairs
        return out

    def clear(self) -> None:
        self._expected.clear()
        self.log_ratio.clear()

"""What the replay policy and the routing weights add to a replay pass: the threshold policy's
replaced fraction and the router log-ratio (formulas: :mod:`r3bridge.replay_policy`).

The router log-ratio needs the gate weights megatron-core's router applied to the replayed
experts. Those are the ``probs`` its ``TopKRouter.forward`` returns, computed by megatron's own
score function after the replay hook handed back the indices; a forward hook on the router
*instance* (removed when the pass ends) reads them, so no routing math is repeated here. The
pass announces each forward router call that has rollout weights (:meth:`PolicyStats.expect`);
the hook of that router, which runs right after, consumes the announcement. Recomputes announce
nothing: the forward already counted.

Counts accumulate on the device (no host sync per router call) and are summed over the
metrics groups at the end of the pass in the agreement counter's all_reduce (one collective per
group for both: ``ReplayPass._sum_counts``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence

import torch

from r3bridge.errors import ConfigError
from r3bridge.megatron.installed import InstalledMicroBatch
from r3bridge.megatron.recorder import _all_gather
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.packing import PackPlan, token_owners
from r3bridge.replay_policy import router_log_ratio

__all__ = ["PolicyStats", "per_token"]

# counts columns
_REPLACED, _SLOTS, _LR_SUM, _LR_ABS, _LR_PAIRS = range(5)


class _Scaling(Protocol):
    topk_scaling_factor: Optional[float]


class _Pass(Protocol):
    replayer: _Scaling
    route_kind: Optional[str]


class PolicyStats:
    """Per-pass counters and per-(chunk, micro-batch) router log-ratios."""

    def __init__(self, prefix: str, *, device: torch.device) -> None:
        self.prefix = prefix
        self.counts = torch.zeros(5, dtype=torch.float64, device=device)
        # (chunk, micro-batch) -> float32 [rows]: sum over the chunk's layers of the log-ratio
        self.log_ratio: dict[tuple[int, int], torch.Tensor] = {}
        self.micro_batches: dict[tuple[int, int], InstalledMicroBatch] = {}
        self._expected: dict[
            tuple[int, int],
            tuple[InstalledMicroBatch, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
        ] = {}

    # ------------------------------------------------------------------------- fed by the pass
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
    def attach(self, routers: Sequence[Mapping[int, torch.nn.Module]], driver_pass: _Pass) -> list[Any]:
        handles = []
        for c, chunk_routers in enumerate(routers):
            for layer, router in chunk_routers.items():
                handles.append(router.register_forward_hook(self._hook(driver_pass, c, layer)))
        return handles

    def _hook(self, driver_pass: _Pass, chunk: int, layer: int):
        def post(module: torch.nn.Module, args: tuple, output: Any) -> None:
            entry = self._expected.pop((chunk, layer), None)
            if entry is None:
                return
            mb, idx, rollout, valid, kept = entry
            probs = output[0].detach()
            train = probs.gather(1, idx).float()
            scale = driver_pass.replayer.topk_scaling_factor
            # engines report the weights before the routed scaling factor; weights recorded by
            # the trainer (record_weights) are its final ones, the factor included
            if scale and driver_pass.route_kind != "recorded":
                train = train / scale
            mask = valid[:, None] if kept is None else kept & valid[:, None]
            ratio = router_log_ratio(train, rollout, mask)
            key = (mb.chunk, mb.index)
            self.log_ratio[key] = ratio if key not in self.log_ratio else self.log_ratio[key] + ratio
            self.micro_batches[key] = mb
            self.counts[_LR_SUM] += ratio.sum()
            self.counts[_LR_ABS] += ratio.abs().sum()
            self.counts[_LR_PAIRS] += valid.sum()

        return post

    # ------------------------------------------------------------------------- end of pass
    def metrics(self, *, threshold: bool) -> dict[str, float]:
        """The pass's policy metrics from ``counts`` (already summed over the metrics groups)."""
        replaced, slots, lr_sum, lr_abs, pairs = self.counts.tolist()
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
        self.micro_batches.clear()


def per_token(
    ratio: torch.Tensor,
    mb: InstalledMicroBatch,
    layout: ParallelLayout,
    *,
    tp_rank: int,
    cp_rank: int,
    groups: Mapping[str, Any],
) -> list[torch.Tensor]:
    """A micro-batch's router log-ratio, this rank's router rows (``ratio [rows]``), as one
    ``[seq_len]`` tensor per sequence: position ``j`` holds the log-ratio of the routes at
    position ``j`` (0 where there is none). The rows of the other TP (sequence parallel) and
    CP ranks are all-gathered first: every rank of the group runs this micro-batch's forward at
    the same time, so the collective is safe inside the loss. Pipeline stages are not summed
    (they run other micro-batches at that moment): callers refuse ``pp > 1``."""
    if layout.pp > 1:
        raise ConfigError(
            f"the per-token router log-ratio needs pp == 1 (each of the {layout.pp} pipeline "
            f"stages holds only its own MoE layers' share); use the router_log_ratio metrics"
        )
    # the plan install built (not rebuilt per micro-batch inside the loss); built here only for a
    # record made without one
    plan = mb.plan if mb.plan is not None else PackPlan.build(layout, mb.seq_lens, **mb.pack)
    tp_parts = layout.tp if layout.sequence_parallel else 1
    rows = int(ratio.numel())
    flat = _all_gather(ratio.float(), groups.get("tp"), tp_parts)
    flat = _all_gather(flat, groups.get("cp"), layout.cp)  # [cp][tp][rows]
    rank, row = token_owners(plan, layout, tp_parts)
    values = flat[(rank * rows + row).to(flat.device)]
    return list(values.split(plan.seq_lens.tolist()))

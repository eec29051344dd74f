"""Routing-weights replay and recording: the combine weight of each replayed (token, k).

megatron-core's ``TopKRouter.forward`` returns ``(probs, routing_map)``: ``probs`` ``[tokens,
experts]`` holds, at the chosen experts, the final combine weight the MoE layer multiplies each
expert's output by (after the score function, the top-k normalisation and the routed scaling
factor, and with the aux-loss gradient attached). A forward hook on each router *instance*
(removed when the pass ends; no class is patched, no routing math repeated) sees that output:

* **replay** (``replay_weights``): the pass announces, per router call, the ids it handed back
  and the routes' weights of those ids (:meth:`CombineWeights.expect_replay`); the hook returns
  ``probs`` with each (token, k) of a row with a route set to the handed weight, a constant:
  no gradient reaches the router through the combine weights of those tokens (the router is
  frozen for them; its aux and z losses, computed from the logits, still reach it). Rows without
  a route keep the live router's weights, counted (``weights/live_pairs``). Recomputes announce
  too (the recomputed forward must be the forward), counted once, in the forward.
* **record** (``record_weights``): the hook reads the final weights of the ids the router used
  (the replayed ids under R3, its own under R2) into the micro-batch's record, next to its ids
  (:func:`r3bridge.megatron.recorder.gather_recorded_weights` gathers them like the ids).

The weights replayed are the routes' ``ReplayBatch.weights``, cast to ``probs``' dtype: a
recording's as recorded (float32 in the recording process: exactly the weights compute_log_prob
used), an engine's or a payload's in the schema's float16 (exact for a bf16 router's weights,
2**-11 relative for a float32 router's). Engines report weights before megatron's routed scaling factor (SGLang's
``select_experts``; the router log-ratio divides the same way), so "rollout" weights are
multiplied by ``moe_router_topk_scaling_factor`` here; recorded weights are the router's own
final ones and are replayed as they are.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from r3bridge.megatron.installed import InstalledMicroBatch

__all__ = ["CombineWeights"]

# counts columns
_REPLACED, _LIVE = range(2)


class CombineWeights:
    """Per-pass state of the combine-weights hooks: announcements per (chunk, layer), counts."""

    def __init__(self, prefix: str, *, device: torch.device, scaling_factor: Optional[float]) -> None:
        self.prefix = prefix
        self.scaling_factor = scaling_factor
        # (token, MoE layer) pairs given the handed weights / keeping the live router's (no route),
        # counted on the host from the install's counts (no device sync), summed over the ranks
        self.counts = torch.zeros(2, dtype=torch.float64, device=device)
        # (chunk, layer) -> (idx [rows, K], weights float32 [rows, K], valid [rows], already scaled)
        self._replay: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = {}
        # (chunk, layer) -> (micro-batch, idx): the forward call whose final weights are recorded
        self._record: dict[tuple[int, int], tuple[InstalledMicroBatch, torch.Tensor]] = {}

    # ------------------------------------------------------------------------- fed by the pass
    def expect_replay(self, chunk: int, layer: int, idx: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor,
                      *, scaled: bool) -> None:
        """The router call of ``layer`` in ``chunk`` dispatches ``idx``; rows with ``valid`` get
        ``weights`` (times the routed scaling factor unless ``scaled``: they already include it)."""
        self._replay[(chunk, layer)] = (idx, weights, valid, scaled)

    def count(self, replaced: int, live: int) -> None:
        """One forward router call: ``replaced`` token rows got the handed weights, ``live`` kept the router's."""
        self.counts[_REPLACED] += replaced
        self.counts[_LIVE] += live

    def expect_record(self, chunk: int, layer: int, mb: InstalledMicroBatch, idx: torch.Tensor) -> None:
        """The forward router call of ``layer`` for ``mb`` dispatches ``idx``: record their final weights."""
        self._record[(chunk, layer)] = (mb, idx)

    # ------------------------------------------------------------------------- router hooks
    def attach(self, routers: Sequence[Mapping[int, torch.nn.Module]]) -> list[Any]:
        """Forward hooks on every decoder router (``routers[chunk][layer]``); returns the handles.
        Registered after the other hooks of the pass, so those read the live router's output."""
        handles = []
        for c, chunk_routers in enumerate(routers):
            for layer, router in chunk_routers.items():
                handles.append(router.register_forward_hook(self._hook(c, layer)))
        return handles

    def _hook(self, chunk: int, layer: int):
        def post(module: torch.nn.Module, args: tuple, output: Any) -> Any:
            replay = self._replay.pop((chunk, layer), None)
            record = self._record.pop((chunk, layer), None)
            if replay is None and record is None:
                return None
            probs, routing_map = output[0], output[1]
            if replay is not None:
                probs = self._substitute(probs, *replay)
            if record is not None:
                mb, idx = record
                # in the router's dtype (a bf16 router's take half float32's memory until the gather)
                mb.recorded_weights[layer] = probs.detach().gather(1, idx)
            return (probs, routing_map, *output[2:]) if replay is not None else None

        return post

    def _substitute(self, probs: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor,
                    scaled: bool) -> torch.Tensor:
        """``probs`` with each replayed (row, k) of a row with a route set to its handed weight
        (detached); rows without a route keep the live weights (and their gradient)."""
        handed = weights.to(device=probs.device, dtype=torch.float32)
        if not scaled and self.scaling_factor:
            handed = handed * self.scaling_factor
        rows = valid.to(probs.device)[:, None]
        live = probs.gather(1, idx)
        combined = torch.where(rows, handed.to(probs.dtype), live)
        return probs.scatter(1, idx, combined)

    # ------------------------------------------------------------------------- end of pass
    def metrics(self) -> dict[str, float]:
        """``weights/replayed_pairs`` ((token, MoE layer) pairs whose K combine weights are the
        handed ones) and ``weights/live_pairs`` (pairs of tokens without a route: the live
        router's weights), from ``counts`` already summed over the metrics groups."""
        replaced, live = self.counts.tolist()
        return {f"{self.prefix}weights/replayed_pairs": replaced, f"{self.prefix}weights/live_pairs": live}

    def clear(self) -> None:
        self._replay.clear()
        self._record.clear()

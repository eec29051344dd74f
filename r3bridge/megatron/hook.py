"""The object attached to ``router.router_replay``: megatron-core calls its ``get_replay_topk``.

It holds no routes itself: it forwards each call to the replayer's active pass, which knows the
(chunk, micro-batch) being computed. Outside a pass it routes natively and counts the call, so a
forward the adapter forgot to wrap is visible in metrics instead of silently native.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, Tuple

import torch

TopkFn = Callable[..., Tuple[torch.Tensor, torch.Tensor]]


class RoutePass(Protocol):
    """The active replay pass (a :class:`r3bridge.megatron.ReplayPass`): routes one router call."""

    def route(self, chunk: int, layer: int, scores: torch.Tensor, topk: int, num_groups: Optional[int],
              group_topk: Optional[int], native_fn: TopkFn) -> Tuple[torch.Tensor, torch.Tensor]: ...


class PassSlot(Protocol):
    """Where the hook finds the active pass (a :class:`r3bridge.megatron.Replayer`), and counts
    the calls made outside any pass."""

    unmanaged_calls: int

    @property
    def active_pass(self) -> Optional[RoutePass]: ...


class RouterHook:
    """Duck-types megatron-core's ``RouterReplay`` for one router instance (never registered in
    megatron's process-global list)."""

    def __init__(self, replayer: PassSlot, chunk: int, layer_id: int) -> None:
        self.replayer = replayer
        self.chunk = chunk
        self.layer_id = layer_id

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None,
                        default_compute_topk: TopkFn | None = None) -> Tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None, "megatron-core passes its native top-k function"
        driver_pass = self.replayer.active_pass
        if driver_pass is None:
            self.replayer.unmanaged_calls += 1
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return driver_pass.route(self.chunk, self.layer_id, scores, topk, num_groups, group_topk, default_compute_topk)

    def __repr__(self) -> str:
        return f"RouterHook(chunk={self.chunk}, layer={self.layer_id})"

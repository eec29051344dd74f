"""Rows without a route stay out of the router's statistics (design principle 2).

megatron-core's ``TopKRouter.forward(input, padding_mask)`` keeps rows marked ``True`` out of the
z-loss, the aux losses (``compute_routing_scores_for_aux_loss`` and the token counts they divide
by) and the expert-bias token counts (``_apply_expert_bias``); the routing map it returns, and so
what the experts compute, is unchanged. During a replay pass a forward pre-hook on each decoder
router ORs the rows of the current (chunk, micro-batch) that have no route - packing padding,
rows the engine did not report, ``valid = False`` rows - into whatever mask the framework passed.
A hook on the router *instance* (removed when the pass ends), not a patched class.

Not masked, counted in the pass's ``stats_unmasked_calls`` metric instead:

* a micro-batch in which no row at all has a route: every rank of its TP x CP group would count
  zero tokens and the aux loss divides by that count;
* a router with expert bias (``moe_router_enable_expert_bias``): megatron-core 0.16.0 to 0.19.2
  apply the mask there as ``routing_map & (~padding_mask)`` (0.16.1 ``router.py:542``, 0.19.2
  ``router.py:738``), broadcasting ``[tokens, experts]`` against ``[tokens]``: a RuntimeError
  unless tokens == experts, and the mask applied per expert instead of per token when they are
  equal. Its unrouted rows stay in the aux loss, z-loss and expert-bias counts, as without r3bridge.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence

import torch

from r3bridge.megatron.installed import InstalledMicroBatch


class RouterCalls(Protocol):
    """The replay pass, as the mask sees it: which micro-batch a router call belongs to, and a
    count of the calls left unmasked (a :class:`r3bridge.megatron.ReplayPass`)."""

    stats_unmasked: int

    def micro_batch_of_call(self, chunk: int, layer: int) -> Optional[InstalledMicroBatch]: ...


def _merge(existing: Optional[torch.Tensor], unrouted: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    mask = unrouted.view(shape[0], shape[1])
    return mask if existing is None else (existing.to(torch.bool) | mask)


def attach(routers: Sequence[Mapping[int, torch.nn.Module]], driver_pass: RouterCalls) -> list[Any]:
    """Register the pre-hooks on every decoder router (``routers[chunk][layer]``) for ``driver_pass``;
    returns the handles."""
    handles = []
    for c, chunk_routers in enumerate(routers):
        for layer, router in chunk_routers.items():
            handles.append(router.register_forward_pre_hook(_hook(driver_pass, c, layer), with_kwargs=True))
    return handles


def _hook(driver_pass: RouterCalls, chunk: int, layer: int):
    def pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        mb = driver_pass.micro_batch_of_call(chunk, layer)
        if mb is None:
            return None
        targets = mb.targets
        if targets is None:
            # a non-reentrant recompute after its micro-batch's targets were freed: the pass
            # re-derives the indices, but the validity mask is gone, so this call is not masked
            if mb.routes is not None and not mb.all_valid:
                driver_pass.stats_unmasked += 1
            return None
        if mb.all_valid or not args:
            return None
        hidden = args[0]
        if hidden.dim() < 2 or hidden.shape[0] * hidden.shape[1] != targets.valid.shape[0]:
            return None                     # ReplayPass.route raises the row-count mismatch
        if not mb.batch_has_route or getattr(module, "enable_expert_bias", False):
            driver_pass.stats_unmasked += 1
            return None
        unrouted = ~targets.valid
        if len(args) > 1:
            return (args[0], _merge(args[1], unrouted, hidden.shape), *args[2:]), kwargs
        return args, {**kwargs, "padding_mask": _merge(kwargs.get("padding_mask"), unrouted, hidden.shape)}
    return pre

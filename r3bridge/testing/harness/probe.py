"""Record every router call of harness model chunks (forward hooks, removable).

Routers are found by walking each chunk's ``decoder.layers`` (and, separately, its MTP
block), never through megatron's process-global ``RouterReplay`` list (docs/architecture.md, "Driver").
A router returns ``(probs, routing_map)``, both ``[num_tokens, num_experts]``; the probe keeps
the routing_map and the top-k probabilities.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


@dataclass(frozen=True)
class RouterRef:
    """Where a router lives: chunk index, global id (``layer_number - 1``), MTP or decoder."""

    chunk: int
    layer_id: int
    mtp: bool
    module: Any  # TopKRouter (not pickled: use RouterRef.key())

    def key(self) -> tuple[int, int, bool]:
        return (self.chunk, self.layer_id, self.mtp)


@dataclass
class RouterCall:
    chunk: int
    layer_id: int  # router.layer_number - 1
    mtp: bool
    grad_enabled: bool  # False in the no_grad first pass of a checkpointed region
    training: bool
    routing_map: torch.Tensor  # [T, E] bool
    probs: torch.Tensor  # [T, E] float (zero outside the top-k)

    @property
    def num_rows(self) -> int:
        return int(self.routing_map.shape[0])

    def topk(self) -> torch.Tensor:
        return topk_indices(self.routing_map)


def topk_indices(routing_map: torch.Tensor, k: Optional[int] = None) -> torch.Tensor:
    """[T, E] bool routing map -> [T, k] int64 expert ids, ascending in each row.

    Every row must select exactly ``k`` experts (default: the first row's count); a dropped
    or duplicated assignment would show up as a different count and raises.
    """
    counts = routing_map.sum(dim=1)
    if k is None:
        k = int(counts[0]) if counts.numel() else 0
    if counts.numel() and not bool((counts == k).all()):
        raise ValueError(f"routing_map rows select {sorted(set(counts.tolist()))} experts, expected {k}")
    # Stable descending sort of 0/1 puts the selected ids first, in ascending id order.
    order = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True).indices
    return order[:, :k].contiguous()


def find_routers(chunks: Sequence[torch.nn.Module]) -> list[RouterRef]:
    """Decoder routers of every chunk (in layer order), then MTP routers."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    refs: list[RouterRef] = []
    for ci, chunk in enumerate(chunks):
        for layer in chunk.decoder.layers:  # type: ignore[union-attr]
            if isinstance(getattr(layer, "mlp", None), MoELayer):   # hybrid stacks: Mamba layers have none
                r = layer.mlp.router
                refs.append(RouterRef(ci, int(r.layer_number) - 1, False, r))
    for ci, chunk in enumerate(chunks):
        mtp = getattr(chunk, "mtp", None)
        if mtp is None:
            continue
        # Every MoE layer anywhere in the MTP block: 0.16 keeps one ``transformer_layer`` per MTP
        # layer, 0.17+ an ``mtp_model_layer`` that is a single layer (GPT) or a stack (hybrid).
        for module in mtp.modules():
            if isinstance(module, MoELayer):
                r = module.router
                refs.append(RouterRef(ci, int(r.layer_number) - 1, True, r))
    return refs


class RoutingProbe:
    """Context manager recording :class:`RouterCall` for every router call of ``chunks``."""

    def __init__(self, chunks: Sequence[torch.nn.Module], *, include_mtp: bool = True):
        self.routers = [r for r in find_routers(chunks) if include_mtp or not r.mtp]
        self.calls: list[RouterCall] = []
        self._handles: list[Any] = []

    def __enter__(self) -> "RoutingProbe":
        for ref in self.routers:
            self._handles.append(ref.module.register_forward_hook(self._hook(ref)))
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, ref: RouterRef) -> Any:
        def hook(module: torch.nn.Module, _inp: Any, out: Any) -> None:
            probs, routing_map = out
            self.calls.append(
                RouterCall(
                    chunk=ref.chunk,
                    layer_id=ref.layer_id,
                    mtp=ref.mtp,
                    grad_enabled=torch.is_grad_enabled(),
                    training=module.training,
                    routing_map=routing_map.detach().clone(),
                    probs=probs.detach().clone(),
                )
            )

        return hook

    def clear(self) -> None:
        self.calls.clear()

    # Picklable summaries (a rank function returns these to the test process).
    def layer_ids(self, *, mtp: bool = False) -> list[int]:
        return [r.layer_id for r in self.routers if r.mtp == mtp]

    def call_counts(self) -> Counter[tuple[int, bool, bool]]:
        """Calls per (layer_id, mtp, grad_enabled)."""
        return Counter((c.layer_id, c.mtp, c.grad_enabled) for c in self.calls)

    def summary(self) -> list[tuple[int, int, bool, bool, int]]:
        """(chunk, layer_id, mtp, grad_enabled, num_rows) per call, in call order."""
        return [(c.chunk, c.layer_id, c.mtp, c.grad_enabled, c.num_rows) for c in self.calls]

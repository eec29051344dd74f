"""Force given routes (and keep given rows out of the router's statistics) without r3bridge.

The reference side of the conformance grid's gradient check (tests/megatron/replay_grid.py): a
step whose routers dispatch routes chosen by the test, built only from megatron-core's own two
per-router inputs, so that r3bridge's replay of the same routes can be compared with it:

* ``router.router_replay``: megatron-core calls its ``get_replay_topk(scores, topk, num_groups,
  group_topk, default_compute_topk)`` in ``topk_routing_with_score_function`` whenever it is not
  None. :class:`ForcedRouting` puts its own object there for the duration of the ``with`` block
  (restoring whatever was there, e.g. r3bridge's hook, afterwards), never the class and never
  megatron's process-global ``RouterReplay`` list;
* ``TopKRouter.forward(input, padding_mask)``: rows marked ``True`` stay out of the aux / z losses
  and the expert-bias counts. A forward pre-hook on the router instance passes the rows the test
  says have no route.

Which micro-batch a router call belongs to is counted per router, as megatron's schedules call it:
every chunk's forwards run in micro-batch order, and so do the recomputes of a checkpointed layer
(full or selective ``moe`` recompute), which run inside autograd's backward; so the k-th forward
call is micro-batch k, and so is the k-th call made during a backward. Telling the two apart by
"inside a backward" rather than by grad mode holds for reentrant checkpoints (first pass under
``no_grad``) and non-reentrant ones (first pass with grad enabled) alike. Rows without a route
(``valid`` False) dispatch the router's own top-k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from r3bridge.testing.harness.probe import find_routers


@dataclass(frozen=True)
class ForcedRows:
    """One micro-batch of one router, in the router's row order: ``indices`` ``[rows, k]`` int64
    (None: the router's own top-k on every row) and ``valid`` ``[rows]`` bool (False: no route,
    the router's own top-k, and the row is kept out of the statistics when masking)."""

    indices: Optional[torch.Tensor]
    valid: torch.Tensor


def _merge(existing: Optional[torch.Tensor], unrouted: torch.Tensor) -> torch.Tensor:
    return unrouted if existing is None else (existing.to(torch.bool) | unrouted)


class _ForcedTopK:
    """Duck-types megatron-core's ``RouterReplay`` for one router (the part megatron calls)."""

    def __init__(self, owner: "ForcedRouting", layer_id: int) -> None:
        self.owner = owner
        self.layer_id = layer_id

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None, default_compute_topk: Any = None):
        rows = self.owner.current[self.layer_id]
        native = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if rows is None or rows.indices is None:
            return native
        if rows.indices.shape != (scores.shape[0], topk):
            raise ValueError(f"layer {self.layer_id}: forced routes {tuple(rows.indices.shape)} for "
                             f"{scores.shape[0]} rows, top-{topk}")
        idx = rows.indices.to(scores.device)
        idx = torch.where(rows.valid.to(scores.device)[:, None], idx, native[1])
        return scores.gather(1, idx), idx


class ForcedRouting:
    """Context manager over every decoder router of ``chunks`` (MTP routers keep routing natively).

    ``rows[layer_id][m]``: the :class:`ForcedRows` of micro-batch ``m`` for that layer's router on
    this rank. ``mask_unrouted``: pass the rows with ``valid`` False as ``padding_mask`` (only when
    a micro-batch has any).
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], rows: dict[int, list[ForcedRows]], *,
                 mask_unrouted: bool) -> None:
        self.routers = [r for r in find_routers(chunks) if not r.mtp]
        self.rows = rows
        self.mask_unrouted = mask_unrouted
        self.current: dict[int, Optional[ForcedRows]] = {}
        self.calls: dict[tuple[int, str], int] = {}
        self._saved: list[tuple[Any, Any]] = []
        self._handles: list[Any] = []

    def __enter__(self) -> "ForcedRouting":
        for ref in self.routers:
            self._saved.append((ref.module, getattr(ref.module, "router_replay", None)))
            ref.module.router_replay = _ForcedTopK(self, ref.layer_id)
            self._handles.append(ref.module.register_forward_pre_hook(self._pre(ref.layer_id), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module, saved in self._saved:
            module.router_replay = saved
        self._saved.clear()

    def _pre(self, layer_id: int) -> Any:
        def pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            # -1 outside autograd's backward: a recompute is the only router call made inside one
            kind = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
            m = self.calls.get((layer_id, kind), 0)
            self.calls[(layer_id, kind)] = m + 1
            per_mb = self.rows.get(layer_id)
            if per_mb is None:
                self.current[layer_id] = None
                return None
            if m >= len(per_mb):
                raise ValueError(f"layer {layer_id}: {kind} call {m + 1} for {len(per_mb)} micro-batches")
            rows = self.current[layer_id] = per_mb[m]
            if not self.mask_unrouted or bool(rows.valid.all()):
                return None
            hidden = args[0]
            if hidden.shape[0] * hidden.shape[1] != rows.valid.shape[0]:
                raise ValueError(f"layer {layer_id}: the router sees {hidden.shape[0] * hidden.shape[1]} rows, "
                                 f"{rows.valid.shape[0]} given")
            unrouted = (~rows.valid).to(hidden.device).view(hidden.shape[0], hidden.shape[1])
            if len(args) > 1:      # megatron passes (hidden, padding_mask) positionally
                return (hidden, _merge(args[1], unrouted), *args[2:]), kwargs
            return args, {**kwargs, "padding_mask": _merge(kwargs.get("padding_mask"), unrouted)}
        return pre

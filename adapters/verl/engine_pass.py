"""What verl's engine (``hooks.py``) calls around one pass of its
:class:`~r3bridge.session.AdapterSession`, holding the pass's routes field before the schedule
runs: the phase's plan with the field checked against it (present, of the model's top-k: the
session's checks, once per batch), each micro-batch of nested jagged ``input_ids`` as the
:class:`~r3bridge.megatron.MicroBatch` it installs, the router log-ratio handed to each
micro-batch's loss, and the metrics to log (with the trainer-vs-rollout log-prob mismatch) merged
into verl's per-key lists.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, MutableMapping, Optional, Sequence

import torch

from r3bridge.config import Action, Phase, PhasePlan
from r3bridge.megatron.replay_pass import MicroBatch
from r3bridge.metrics.mismatch import padded_response_mismatch
from r3bridge.session.packed_micro_batch import thd_micro_batch
from r3bridge.session.phase import phase_tag

__all__ = ["checked_plan", "route_width", "check_route_width", "nested_micro_batch", "loss_after_routers",
           "extend_metrics", "extend_pass_metrics"]


def route_width(routes: Any) -> int:
    """Expert ids per (token, layer): the last axis of a dense or nested jagged routes tensor."""
    values = routes.values() if getattr(routes, "is_nested", False) else routes
    return int(values.shape[-1])


def check_route_width(session: Any, routes: Any, *, field: str, where: str) -> None:
    """Routes (``None``: none) of another width than the model's top-k refused before the schedule
    starts, not at the first router (``session.check_topk``)."""
    if routes is not None:
        session.check_topk(field, route_width(routes), where=where)


def checked_plan(session: Any, phase: Phase, routes: Any, *, field: str, where: str) -> Optional[PhasePlan]:
    """``session.plan(phase)`` (``None``: route natively), with the pass's ``routes`` (``None``:
    the batch has no ``field``) present exactly when the plan needs them (``session.check_routes``);
    to replay, check their width too (:func:`check_route_width`)."""
    plan = session.plan(phase)
    if plan is not None:
        session.check_routes(plan, routes is not None, field=field, where=where)
    return plan


def nested_micro_batch(session: Any, input_ids: torch.Tensor, *, routes: Any, sample_ids: Sequence[int],
                       cu_seqlens_padded: Any) -> MicroBatch:
    """The THD micro-batch (:func:`~r3bridge.session.packed_micro_batch.thd_micro_batch`) of nested
    jagged ``input_ids`` (one sequence per sample, in order), named for traces by its tokens
    (``session.sample_uids``)."""
    return thd_micro_batch(input_ids.offsets().diff().tolist(), cu_seqlens_padded, routes=routes,
                           sample_ids=sample_ids, uids=session.sample_uids(input_ids.unbind()))


def loss_after_routers(loss: Callable, phase_pass: Any, model: torch.nn.Module, index: int,
                       hand_over: Callable[[Optional[list[torch.Tensor]]], None]) -> Callable:
    """A micro-batch's loss callable (Megatron's ``forward_step`` contract: it runs after the chunk's
    forward, when every router of the micro-batch has run) that first hands ``hand_over`` the
    micro-batch's per-token router log-ratio (``ReplayPass.router_log_ratio_tokens`` of the
    ``index`` that ``install`` returned) when the job asks for it (``router_log_ratio``, a
    replaying pass); else ``loss`` itself."""
    if not (phase_pass.runner.config.router_log_ratio and phase_pass.action is Action.REPLAY):
        return loss

    def with_log_ratio(*args: Any, **kwargs: Any) -> Any:
        hand_over(phase_pass.router_log_ratio_tokens(model, index))
        return loss(*args, **kwargs)
    return with_log_ratio


def extend_metrics(target: MutableMapping[str, list], metrics: Mapping[str, Sequence[float]]) -> None:
    """``metrics`` (``AdapterSession.metrics_to_log``'s lists) appended to ``target``'s list per key."""
    for key, values in metrics.items():
        target.setdefault(key, []).extend(values)


def extend_pass_metrics(target: MutableMapping[str, list], session: Any, phase: Phase, *, log_probs: Any = None,
                        rollout_log_probs: Any = None, response_mask: Any = None) -> None:
    """The pass's metrics (``session.metrics_to_log`` of ``session.result``) appended to ``target``
    (:func:`extend_metrics`), with the trainer-vs-rollout log-prob mismatch when both log-probs are
    given (padded ``[B, T]`` response layout: :func:`~r3bridge.metrics.mismatch.padded_response_mismatch`)."""
    extra = {}
    if log_probs is not None and rollout_log_probs is not None:
        extra = padded_response_mismatch(log_probs, rollout_log_probs, response_mask,
                                         prefix=f"{session.config.metrics_prefix}{phase_tag(phase)}/")
    extend_metrics(target, session.metrics_to_log(session.result, extra))

"""Replay policies and the router log-ratio: pure tensor rules the Megatron driver applies at
the router hook (``r3bridge/megatron/replay_pass.py``); no megatron import, so both are tested on CPU.

Policies (``ReplayConfig.replay_policy``):

* ``hard`` - every replayed expert is dispatched (R2 / R3 as in the papers).
* ``threshold`` - soft replay after prime-rl #2703: a replayed expert is kept only if the
  trainer's own router score for it is at least ``threshold_ratio`` x the weakest score of the
  trainer's native top-k for that token; a rejected slot is refilled from the native top-k in
  order (best first), skipping experts the row already holds, so every row keeps K distinct ids.
  The fraction of replaced (token, k) slots is a metric. With ``ratio = 1`` a replayed expert is
  kept exactly when the trainer's top-k holds it, so the dispatch is the native top-k set; as
  ``ratio -> 0`` it is hard replay.

Scores are compared in the router's probability space. megatron-core hands the replay hook the
scores it ranks (``topk_routing_with_score_function``): probabilities for a sigmoid router or a
softmax router with ``moe_router_pre_softmax``, the raw logits for a softmax router without it.
For logits the comparison is made on ``exp(logit - weakest logit)``, the ratio of the two
experts' softmax probabilities, so no score function is re-computed.

Router log-ratio (router importance sampling: prime-rl #1406 / #1661, RSPO arXiv 2510.23027), per
token ``t`` of a micro-batch::

    r_t = sum over MoE layers l, slots k kept by the policy, rows with a route of
          log w_train(t, l, k) - log w_rollout(t, l, k)

where ``w_train`` is the gate weight megatron-core's router applied to the replayed expert (the
``probs`` the router returns, divided by ``moe_router_topk_scaling_factor`` if one is set) and
``w_rollout`` is the weight the engine returned for it (``ReplayBatch.weights``). Both are the
engine-side normalisation: the weight each engine multiplies the expert's output by; for the
default softmax router (``moe_router_pre_softmax=False``) that is the softmax over the K
replayed logits, the same renormalised top-k weights SGLang's ``select_experts`` returns with
``renormalize`` (Qwen3-MoE, Mixtral; SGLang #23999 captures exactly these). The full softmax
over all experts is not used: no engine returns it, and the trainer's would then compare with a
quantity of another normalisation. Weights below float16's smallest subnormal (2**-24) are
clamped to it on both sides so that a zero weight gives a large finite term, not -inf.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from r3bridge.errors import ConfigError

__all__ = ["POLICIES", "SCORE_SPACES", "threshold_select", "router_log_ratio", "WEIGHT_FLOOR", "check_policy"]

POLICIES = ("hard", "threshold")
SCORE_SPACES = ("logits", "probs")
WEIGHT_FLOOR = 2.0**-24


def check_policy(policy: str, ratio: float) -> None:
    """``ConfigError`` unless ``policy`` is known and ``ratio`` is in (0, 1]."""
    if policy not in POLICIES:
        raise ConfigError(f"replay_policy must be one of {list(POLICIES)}, got {policy!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
        raise ConfigError(f"threshold_ratio must be a number in (0, 1], got {ratio!r}")


def threshold_select(
    scores: torch.Tensor,
    target: torch.Tensor,
    native: torch.Tensor,
    *,
    ratio: float,
    score_space: str,
    valid: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dispatched ids ``[T, K]``, replaced ``[T, K]`` bool) of the threshold policy.

    ``scores [T, E]``: what megatron-core hands the replay hook (``score_space`` says which:
    ``"logits"`` or ``"probs"``); ``target``: the replayed ids; ``native``: the router's own
    top-k, best first. Rows with ``valid`` False are left as ``target`` (the caller routes them
    natively) and never count as replaced."""
    if score_space not in SCORE_SPACES:
        raise ConfigError(f"score_space must be one of {list(SCORE_SPACES)}, got {score_space!r}")
    replayed_score = scores.gather(1, target).float()
    weakest = scores.gather(1, native).float().min(-1, keepdim=True).values
    if score_space == "logits":  # p_e / p_min = exp(logit_e - logit_min)
        keep = (replayed_score - weakest) >= math.log(ratio)
    else:
        keep = replayed_score >= ratio * weakest
    if valid is not None:
        keep |= ~valid.to(keep.device)[:, None]
    replaced = ~keep
    # native experts the row already keeps are not offered again; the rest, best first, fill
    # the replaced slots in slot order
    taken = ((native[:, :, None] == target[:, None, :]) & keep[:, None, :]).any(-1)
    offer_order = torch.sort(taken.to(torch.int8), dim=-1, stable=True).indices
    offered = native.gather(1, offer_order)
    slot_rank = (replaced.to(torch.int64).cumsum(-1) - 1).clamp(min=0)
    dispatched = torch.where(replaced, offered.gather(1, slot_rank), target)
    return dispatched, replaced


def router_log_ratio(train_weights: torch.Tensor, rollout_weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row ``sum_k mask * (log w_train - log w_rollout)`` (float32 ``[T]``) of one layer;
    see the module docstring for what the weights are."""
    train = train_weights.float().clamp_min(WEIGHT_FLOOR).log()
    rollout = rollout_weights.float().clamp_min(WEIGHT_FLOOR).log()
    return torch.where(mask.to(train.device), train - rollout, torch.zeros((), device=train.device)).sum(-1)

"""The replay policy rules of r3bridge/replay_policy.py on plain tensors (the Megatron path:
tests/megatron/test_replay_policy.py)."""

from __future__ import annotations

import math

import pytest
import torch

from r3bridge import ConfigError
from r3bridge.config import ReplayConfig
from r3bridge.replay_policy import router_log_ratio, threshold_select


def _case(rows=64, experts=8, topk=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, experts, generator=g)
    native = logits.topk(topk, dim=1).indices
    target = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(rows)])
    return logits, native, target


def test_threshold_keeps_by_gate_score_ratio_and_refills_from_native_in_order():
    logits, native, target = _case()
    probs = logits.softmax(-1)
    out, replaced = threshold_select(probs, target, native, ratio=0.4, score_space="probs")
    # logits hand the same decision (p_e / p_n = exp(logit_e - logit_n))
    same, same_replaced = threshold_select(logits, target, native, ratio=0.4, score_space="logits")
    assert torch.equal(out, same) and torch.equal(replaced, same_replaced)
    weakest = probs.gather(1, native).min(-1, keepdim=True).values
    assert torch.equal(~replaced, probs.gather(1, target) >= 0.4 * weakest)
    assert 0 < int(replaced.sum()) < replaced.numel()
    assert torch.equal(out[~replaced], target[~replaced])
    srt = out.sort(-1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all())  # K distinct ids in every row
    for r in range(out.shape[0]):  # refills: the best native experts the row does not hold yet
        kept = set(target[r][~replaced[r]].tolist())
        offered = [e for e in native[r].tolist() if e not in kept]
        assert out[r][replaced[r]].tolist() == offered[: int(replaced[r].sum())]


def test_threshold_limits_and_invalid_rows():
    logits, native, target = _case(seed=1)
    one, _ = threshold_select(logits, target, native, ratio=1.0, score_space="logits")
    assert torch.equal(one.sort(-1).values, native.sort(-1).values)
    tiny, replaced = threshold_select(logits, target, native, ratio=1e-30, score_space="logits")
    assert torch.equal(tiny, target) and not bool(replaced.any())
    valid = torch.arange(logits.shape[0]) % 2 == 0
    _, replaced = threshold_select(logits, target, native, ratio=1.0, score_space="logits", valid=valid)
    assert not bool(replaced[~valid].any()) and bool(replaced[valid].any())


def test_router_log_ratio_formula():
    train = torch.tensor([[0.6, 0.4], [0.5, 0.0]])
    rollout = torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=torch.float16)
    mask = torch.tensor([[True, True], [True, False]])
    got = router_log_ratio(train, rollout, mask)
    assert got[0].item() == pytest.approx(math.log(0.6 / 0.5) + math.log(0.4 / 0.5), rel=1e-5)
    assert got[1].item() == pytest.approx(math.log(2.0), rel=1e-5)  # the masked zero weight is left out
    assert math.isfinite(router_log_ratio(train, rollout, torch.ones(2, 2, dtype=torch.bool))[1].item())


@pytest.mark.parametrize(
    "option, message",
    [
        ({"replay_policy": "soft"}, "replay_policy must be one of"),
        ({"replay_policy": "threshold", "threshold_ratio": 0.0}, "threshold_ratio must be a number in (0, 1]"),
        ({"threshold_ratio": 1.5}, "threshold_ratio"),
        ({"threshold_ratio": True}, "threshold_ratio"),
        ({"router_log_ratio": "yes"}, "router_log_ratio must be true or false"),
    ],
)
def test_policy_options_are_validated(option, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        ReplayConfig(**option)
    assert ReplayConfig().replay_policy == "hard"

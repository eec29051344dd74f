"""The threshold replay policy (prime-rl #2703) and the router log-ratio (prime-rl #1406 / #1661,
RSPO) on a real CPU megatron-core model: r3bridge/replay_policy.py, r3bridge/megatron/policy_stats.py."""

from __future__ import annotations

import pytest
import torch
from policy_checks import run_policy_checks

from r3bridge.testing.harness.dist import spawn

PREFIX = "r3bridge/replay/"


@pytest.fixture(scope="module")
def runs():
    return spawn(run_policy_checks, world_size=1, timeout=600)[0]


def _same_dispatch(a, b) -> bool:
    return a["maps"].keys() == b["maps"].keys() and all(torch.equal(a["maps"][k], b["maps"][k]) for k in a["maps"])


def test_hard_replay_dispatches_the_targets_and_differs_from_native(runs):
    hard = runs["hard"]
    assert not _same_dispatch(hard, runs["native"])  # the routes differ from the trainer's own
    for lid, idx in hard["targets"].items():
        picked = hard["maps"][lid].nonzero()[:, 1].view(-1, idx.shape[1])
        valid = hard["valid"]
        assert torch.equal(picked[valid], idx[valid].sort(-1).values)
    assert f"{PREFIX}threshold_replaced_fraction" not in hard["metrics"]


def test_threshold_with_ratio_near_zero_is_hard_replay(runs):
    tiny = runs["tiny_ratio"]
    assert _same_dispatch(tiny, runs["hard"])
    assert tiny["metrics"][f"{PREFIX}threshold_replaced_fraction"] == 0.0
    assert torch.equal(tiny["log_ratio"], runs["hard"]["log_ratio"])


def test_threshold_with_ratio_one_replaces_every_disagreeing_expert_by_the_native_choice(runs):
    one = runs["ratio_one"]
    frac = one["metrics"][f"{PREFIX}threshold_replaced_fraction"]
    assert 0.0 < frac < 1.0
    # ratio 1 keeps a replayed expert only when the trainer's own top-k holds it, and refills the
    # rest from that top-k: every layer dispatches the native set, so the whole pass is native
    assert _same_dispatch(one, runs["native"])
    mid = runs["ratio_mid"]
    assert 0.0 < mid["metrics"][f"{PREFIX}threshold_replaced_fraction"] < frac


def test_router_log_ratio_equals_a_direct_computation_from_the_router_logits(runs):
    hard = runs["hard"]
    got, want = hard["log_ratio"].double(), hard["direct"]
    assert got.shape == want.shape and bool(hard["valid"].any())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not bool(got[~hard["valid"]].any())  # rows without a route contribute nothing
    pairs = int(hard["valid"].sum()) * len(hard["targets"])
    assert hard["metrics"][f"{PREFIX}router_log_ratio_mean"] == pytest.approx(float(want.sum()) / pairs, rel=1e-5)
    assert runs["native"]["log_ratio"] is None


def test_a_replay_step_sums_its_counts_in_one_all_reduce_per_metrics_group(runs):
    """The agreement counts and the policy's counts (threshold, router log-ratio) travel together:
    one collective per metrics group at the end of a REPLAY step, whatever the policy (was two:
    PolicyStats reduced its own, even under the hard policy with no weights)."""
    for name in ("hard", "ratio_mid"):
        assert runs[name]["metrics_groups"] >= 1
        assert runs[name]["all_reduces"] == runs[name]["metrics_groups"], (name, runs[name]["all_reduces"])
    assert runs["native"]["all_reduces"] == 0


def test_the_losss_per_token_log_ratio_reuses_the_plan_built_at_install():
    """``per_token`` runs inside the loss of every micro-batch: it reads the pack plan install built
    (a record whose packing fields could not even build one passes), never rebuilds it."""
    from r3bridge.megatron.installed import InstalledMicroBatch
    from r3bridge.megatron.policy_stats import per_token
    from r3bridge.parallel.layout import ParallelLayout
    from r3bridge.parallel.packing import PackPlan

    layout = ParallelLayout(2, 1)
    mb = InstalledMicroBatch(0, 0, 5, 5, [3, 2], {"format": "not a format"}, [0, 1],
                             plan=PackPlan.build(layout, [3, 2]))
    got = per_token(torch.arange(5.0), mb, layout, tp_rank=0, cp_rank=0, groups={})
    assert [t.tolist() for t in got] == [[0.0, 1.0, 2.0], [3.0, 4.0]]

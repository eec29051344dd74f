"""Routing-weights replay (``replay_weights``; docs/architecture.md, "Routing weights"): R3w
records the combine weights of the engine's ids in compute_log_prob and the updates replay ids
and weights with the router frozen, on a real CPU megatron-core model
(r3bridge/megatron/combine_weights.py, tests/megatron/weights_checks.py)."""

from __future__ import annotations

import pytest
import torch
from weights_checks import run_weights_checks

from r3bridge.testing.harness.dist import spawn

PREFIX = "r3bridge/"


@pytest.fixture(scope="module")
def runs():
    return spawn(run_weights_checks, world_size=1, timeout=600)[0]


def _real_rows(runs) -> torch.Tensor:
    """Router rows of real tokens (the packing's padding rows have no route in any pass)."""
    mask = torch.zeros(runs["cu"][-1], dtype=torch.bool)
    for start, n in zip(runs["cu"], runs["seq_lens"]):
        mask[start:start + n] = True
    return mask


def test_r3w_records_the_engines_ids_and_the_weights_the_router_gave_them(runs):
    rec, rollout = runs["r3w_record"]["recorded"], runs["rollout"]
    assert rec.route_kind == "recorded" and rec.weights is not None
    assert rec.rows_per_seq == runs["seq_lens"] and tuple(rec.weights.shape) == tuple(rec.routes.shape)
    real = _real_rows(runs)
    for lid, probs in runs["r3w_record"]["probs"].items():
        col = rec.layer_ids.index(lid)
        ids = rec.routes[:, col].long()
        # the recorded weights are the router's final probs at the recorded ids, as they are
        # (float32 in the recording process; to_bytes narrows them to the schema's float16)
        want = probs[real].gather(1, ids)
        assert rec.weights.dtype == torch.float32 and torch.equal(rec.weights[:, col], want)
        assert float(want.sum(-1).mean()) == pytest.approx(runs["scale"], rel=1e-5)   # after the scaling factor
    # the engine's ids where the rollout has a route (R3), ascending per row as sets
    row = 0
    for i, n in enumerate(runs["seq_lens"]):
        a, r = int(rollout._offsets[i]), rollout.rows_per_seq[i]
        got = rec.routes[row:row + r].long().sort(-1).values
        want = rollout.routes[a:a + r].long().sort(-1).values
        v = rollout.valid[a:a + r]
        assert torch.equal(got[v], want[v])
        row += n


def test_replayed_weights_make_the_moe_output_independent_of_the_router(runs):
    """(a) Ids and weights replayed: moving every router's weights changes no MoE layer's output
    on any real token (bit for bit), and the first MoE layer's output is the recorded weights
    applied to the recorded experts. Ids only: the same move changes the outputs."""
    real = _real_rows(runs)
    same, moved, ids_only = runs["update_w"]["moe"], runs["update_w_moved"]["moe"], runs["update_ids_moved"]["moe"]
    for lid in same:
        assert torch.equal(same[lid]["output"][real], moved[lid]["output"][real]), lid
        assert not torch.allclose(same[lid]["output"][real], ids_only[lid]["output"][real], atol=1e-4), lid
    assert torch.equal(runs["update_w"]["logits"][real], runs["update_w_moved"]["logits"][real])
    first, direct, valid = runs["direct_first_layer"]
    torch.testing.assert_close(moved[first]["output"][valid], direct[valid], rtol=1e-5, atol=1e-6)
    # and the update dispatched what compute_log_prob did, with exactly its weights: the same
    # MoE outputs and logits as compute_log_prob, whatever the router now says
    for lid, probs in runs["update_w_moved"]["probs"].items():
        assert torch.equal(runs["update_w_moved"]["maps"][lid][real], runs["r3w_record"]["maps"][lid][real])
        assert torch.equal(probs[real], runs["r3w_record"]["probs"][lid][real])
        assert torch.equal(moved[lid]["output"][real], runs["r3w_record"]["moe"][lid]["output"][real])


def test_router_log_ratio_reads_recorded_weights_as_the_routers_own(runs):
    """Recorded weights include the routed scaling factor (an engine's do not): replayed at
    theta_old, the trainer's weights are the recorded ones, so the router log-ratio is 0."""
    m = runs["update_w"]["metrics"]
    assert m[f"{PREFIX}replay/router_log_ratio_abs_mean"] == 0.0
    assert runs["update_w_moved"]["metrics"][f"{PREFIX}replay/router_log_ratio_abs_mean"] > 0.01


def test_no_gradient_reaches_the_router_through_replayed_weights(runs):
    """(b) The router's gradient from the combine path is zero under replay_weights (aux loss
    off in this model), non-zero with ids only."""
    for lid, grad in runs["update_w_moved"]["grads"].items():
        assert grad is None or not bool(grad.any()), lid
    for lid, grad in runs["update_ids_moved"]["grads"].items():
        assert grad is not None and float(grad.abs().sum()) > 0, lid
    # the aux loss (from the router's logits) still reaches it, and the outputs are unchanged
    real = _real_rows(runs)
    for lid, grad in runs["update_w_aux"]["grads"].items():
        assert grad is not None and float(grad.abs().sum()) > 0, lid
    assert torch.equal(runs["update_w_aux"]["logits"][real], runs["update_w_moved"]["logits"][real])


def test_r3w_through_the_phase_runner(runs):
    """ReplayConfig(replay_mode=R3, replay_weights=recorded) through the phase runner adapters use:
    compute_log_prob's result holds the recording with its weights (the same as the driver's), the
    update replays them and logs the counts under its phase tag."""
    r = runs["runner"]
    old_plan, update_plan = r["plans"]
    assert old_plan.record_weights and old_plan.route_kind == "rollout"
    assert update_plan.replay_weights and update_plan.route_kind == "recorded"
    direct = runs["r3w_record"]["recorded"]
    assert r["recorded"].equals(direct) and torch.equal(r["recorded"].weights, direct.weights)
    assert r["old"][f"{PREFIX}old_log_prob/coverage"] < 1.0          # the engine's routes: last tokens have none
    u = r["update"]
    assert u[f"{PREFIX}update/coverage"] == 1.0
    assert u[f"{PREFIX}update/weights/replayed_pairs"] == u[f"{PREFIX}update/replayed_pairs"] > 0
    assert u[f"{PREFIX}update/weights/live_pairs"] == 0


def test_recomputes_replay_the_weights_too(runs):
    """Full and MoE recompute (activation checkpointing) run the router again in the backward: the
    recompute gets the recorded weights too, so every gradient equals the run without recompute
    (with every router moved away from the recording), and the routers get none."""
    grads = runs["recompute"]
    plain = grads["None"]
    assert any("router" in n for n in plain) and any("experts" in n for n in plain)
    for mode in ("full", "moe"):
        assert grads[mode].keys() == plain.keys(), mode
        for name, grad in plain.items():
            assert torch.equal(grads[mode][name], grad), (mode, name)
            if name.endswith("router.weight"):
                assert not bool(grad.any()), name


def test_engine_weights_replayed_after_the_scaling_factor_rows_without_route_live(runs):
    """R3 with an engine's weights (replay_weights=rollout): each replayed (token, k) of a row
    with a route gets the engine's weight times moe_router_topk_scaling_factor; rows without a
    route keep the live router's weights; the counts say which."""
    t, w, plain = runs["engine_targets"], runs["r3_engine_w"], runs["r3_plain"]
    assert bool((~t.valid).any()) and bool(t.valid.any())
    for lid, probs in w["probs"].items():
        idx = t.indices[lid]
        got = probs.gather(1, idx)
        want = t.weights[lid].float() * runs["scale"]
        assert torch.equal(got[t.valid], want[t.valid].to(got.dtype)), lid
        assert torch.equal(w["maps"][lid], plain["maps"][lid])      # the same ids dispatched
    # the first MoE layer sees the same input in both passes: its rows without a route got the
    # live router's weights (later layers' inputs differ by the replayed weights before them)
    first = min(w["probs"])
    assert torch.equal(w["probs"][first][~t.valid], plain["probs"][first][~t.valid])
    assert not torch.equal(w["probs"][first][t.valid], plain["probs"][first][t.valid])
    m = w["metrics"]
    assert m[f"{PREFIX}weights/replayed_pairs"] == m[f"{PREFIX}replayed_pairs"] > 0
    assert m[f"{PREFIX}weights/live_pairs"] == m[f"{PREFIX}native_pairs"] > 0
    assert f"{PREFIX}weights/replayed_pairs" not in plain["metrics"]


def test_r2_records_its_own_weights_and_the_update_replays_them(runs):
    rec = runs["r2_record"]["recorded"]
    assert rec.route_kind == "recorded" and rec.weights is not None
    real = _real_rows(runs)
    for lid, probs in runs["r2_update_w"]["probs"].items():
        assert torch.equal(probs[real], runs["r2_record"]["probs"][lid][real])
    assert torch.equal(runs["r2_update_w"]["logits"][real], runs["r2_record"]["logits"][real])
    # over the wire the weights are the schema's float16
    wire = type(rec).from_bytes(rec.to_bytes())
    assert wire.weights.dtype == torch.float16
    torch.testing.assert_close(wire.weights.float(), rec.weights, rtol=1e-3, atol=1e-7)
    m = runs["r2_update_w"]["metrics"]
    assert m[f"{PREFIX}weights/replayed_pairs"] == m[f"{PREFIX}replayed_pairs"] > 0
    assert m[f"{PREFIX}weights/live_pairs"] == 0


def test_missing_or_misplaced_weights_are_refused_naming_the_samples(runs):
    """(c) replay_weights with routes that carry no weights, with rollout routes where the
    recording is due, or asked of a pass that cannot record or replay them: refused."""
    kind, msg = runs["err_no_weights"]
    assert kind == "RouteWeightsError" and "samples [0, 1, 2]" in msg and "carry none" in msg, msg
    assert "SGLang" in msg
    kind, msg = runs["err_recorded_without_weights"]
    assert kind == "RouteWeightsError" and "samples [0, 1, 2]" in msg and "record_weights" in msg, msg
    kind, msg = runs["err_rollout_for_recorded"]
    assert kind == "ConfigError" and "replay_weights=recorded" in msg, msg
    assert runs["err_record_in_update"][0] == "ConfigError"
    assert runs["err_weights_native"][0] == "ConfigError"


def test_a_configured_replayer_opens_passes_from_the_plan_only(runs):
    """Replayer.from_config with replay_weights set: a pass opened from the action alone would
    replay ids only, silently; it is refused, and the plan gives the pass its flags."""
    kind, msg = runs["err_action_only"]
    assert kind == "ConfigError" and "replay_weights='recorded'" in msg and "phase's plan" in msg, msg
    kind, msg = runs["err_plan_contradicted"]
    assert kind == "ConfigError" and "contradict the plan" in msg, msg
    assert runs["plan_pass"] == ("replay", "recorded", True, False)

"""Driver guards and the bugs peer frameworks shipped, on a real CPU megatron model."""
from __future__ import annotations

import pytest
from driver_checks import GUARDED_OPTIONS, run_driver_checks

from r3bridge.testing.harness.dist import spawn


@pytest.fixture(scope="module")
def checks():
    return spawn(run_driver_checks, world_size=1, timeout=900)[0]


def _raised(outcome, error: str, *words: str) -> None:
    assert not outcome["ok"], f"expected {error}, nothing was raised"
    assert error in outcome["mro"] and "ReplayError" in outcome["mro"], outcome["trace"]
    for w in words:
        assert w in outcome["message"], outcome["message"]


@pytest.mark.parametrize("name", sorted(GUARDED_OPTIONS))
def test_inexact_configs_are_refused(checks, name):
    field = GUARDED_OPTIONS[name][0]
    _raised(checks[f"guard_{name}"], "ConfigError", field)


def test_orphan_routers_are_never_touched(checks):
    o = checks["orphan"]
    assert not any(o["orphan_hooks"]), "a decoder built twice got replay hooks (verl #7340)"
    n = len(o["targets"])
    replayed = o["replayed_topk"][:n]
    for (lid, want), got in zip(sorted(o["targets"].items()), replayed):
        assert got[: len(want)] == want, f"layer {lid} did not replay its targets"
    # the orphan decoder routed natively: its choice differs from the random targets
    assert o["orphan_topk"][0][:10] != replayed[0][:10]
    assert o["unmanaged"] == 0


def test_forward_without_install_is_an_error(checks):
    _raised(checks["forward_without_install"], "ReplayStateError", "without install")


def test_install_twice_without_forward_is_an_error(checks):
    _raised(checks["install_twice"], "ReplayStateError", "never ran forward")


def test_row_count_mismatch_names_layer_and_rank(checks):
    _raised(checks["wrong_rows"], "ReplayStateError", "layer", "rows", "tp=0")


def test_r2_update_refuses_rollout_routes(checks):
    _raised(checks["r2_with_rollout_routes"], "ConfigError", "recorded")


def test_exception_mid_schedule_leaves_no_stale_target(checks):
    s = checks["stale_after_exception"]
    assert not s["first"]["ok"] and "data loader failed" in s["first"]["message"]
    assert s["state_clean"]
    # the next step replays its own routes, not the stale micro-batch of the failed step
    for (lid, want), got in zip(sorted(s["targets"].items()), s["next_topk"]):
        assert got[: len(want)] == want, f"layer {lid}: stale target replayed"
        assert got[: len(want)] != s["stale"][lid], f"layer {lid}: the failed step's target came back"


def test_float16module_wrapped_chunks_are_found_and_replayed(checks):
    o = checks["float16module"]
    assert o["layers"] == sorted(o["targets"])
    for (lid, want), got in zip(sorted(o["targets"].items()), o["replayed_topk"]):
        assert got[: len(want)] == want, f"layer {lid} behind Float16Module did not replay"
    assert 0.5 < o["coverage"] < 1.0


def test_rows_without_route_are_routed_natively(checks):
    r = checks["invalid_rows_native"]
    valid = r["valid_seq0"]
    for native, mixed in zip(r["native"], r["mixed"]):
        for row, ok in enumerate(valid):
            if not ok:
                assert mixed[row] == native[row], f"row {row} without a route was not routed natively"
    replayed_rows = [row for row, ok in enumerate(valid) if ok]
    assert any(m[row] != n[row] for m, n in zip(r["mixed"], r["native"]) for row in replayed_rows), \
        "rows with a route must be replayed, not routed natively"
    assert r["metrics"]["r3bridge/native_pairs"] > 0
    assert 0.3 < r["metrics"]["r3bridge/coverage"] < 0.7


def test_megatron_version_check_passes_on_016(checks):
    assert checks["version_ok"]["ok"]


def test_old_megatron_is_refused(monkeypatch):
    from megatron.core import package_info

    from r3bridge import ConfigError
    from r3bridge.megatron import check_megatron

    monkeypatch.setattr(package_info, "MINOR", 15)
    with pytest.raises(ConfigError, match="0.16"):
        check_megatron()


def test_invalid_rows_error_mode_refuses_rows_without_route(checks):
    _raised(checks["invalid_rows_error"], "CoverageError", "sequence 0", "row 0", "invalid_rows='error'")


def test_second_replayer_on_the_same_routers_is_refused(checks):
    _raised(checks["second_replayer"], "ConfigError", "another Replayer")


def test_min_coverage_counts_real_tokens(checks):
    # half the rows of micro-batch b0 have no route: 0.3 passes, 0.9 is refused with the numbers
    assert checks["min_coverage_low"]["ok"], checks["min_coverage_low"].get("trace")
    _raised(checks["min_coverage_high"], "CoverageError", "min_coverage=0.9", "token rows have a route")


def test_install_outside_the_step_is_refused(checks):
    # without `with`, every router would route natively and nothing would say so (peer bug 8.1)
    _raised(checks["install_not_entered"], "ReplayStateError", "not active")


def test_record_numbers_samples_across_micro_batches_by_default(checks):
    o = checks["record_default_ids"]
    assert o["ok"], o.get("trace")
    assert o["value"] == [13, 7, 20, 9, 15, 11]       # b0's then b1's sequences, one row per token


def test_layout_that_disagrees_with_the_model_is_refused(checks):
    # routers at layers 0..3, a layout saying only 0 and 2 are MoE (dense-layer shift, verl #5037)
    _raised(checks["layout_mismatch"], "LayerMappingError", "routers are at layers [0, 1, 2, 3]", "[0, 2]")


# ---- roles: only the actor replays (miles #2226, NeMo RL #4083 / #3903; r3bridge.megatron.roles)
def test_a_reference_model_cannot_get_a_replayer(checks):
    assert checks["role_declare_reference"]["ok"], checks["role_declare_reference"]
    _raised(checks["role_replayer_on_reference"], "RoleError", "reference", "actor")
    _raised(checks["role_replayer_for_teacher"], "RoleError", "teacher", "only the actor replays")


def test_the_actor_model_cannot_be_declared_another_role(checks):
    _raised(checks["role_actor_declared_critic"], "RoleError", "actor", "critic")


def test_the_role_guard_refuses_the_actor_in_the_adapters_words():
    from r3bridge.errors import RoleError
    from r3bridge.session.adapter_session import declared_session

    with pytest.raises(RoleError, match="^the actor replays through the adapter's actor engine$"):
        declared_session("fw", [], "actor", actor_refused="the actor replays through the adapter's actor engine")
    with pytest.raises(RoleError, match="unknown model role 'judge'"):
        declared_session("fw", [], "judge", actor_refused="unused")


def test_actor_routes_never_reach_the_reference_model(checks):
    _raised(checks["role_routes_to_reference"], "RoleError", "actor", "reference")


def test_a_reference_built_with_megatron_replay_is_refused(checks):
    _raised(checks["role_reference_megatron_replay"], "RoleError", "reference", "RouterReplay", "actor")


def test_another_build_replacing_the_actor_hook_is_caught_at_the_next_step(checks):
    _raised(checks["role_actor_hook_replaced"], "RoleError", "actor", "lost its replay hook")


def test_mtp_routers_are_draft_and_never_replayed(checks):
    mtp = checks["role_mtp"]
    assert mtp["layer_ids"] == [0, 1, 2, 3] and mtp["drafts"] == 1, mtp
    assert mtp["draft_roles"] == ["draft"] and mtp["draft_hooks"] == [False]
    _raised(checks["role_mtp_hooked"], "RoleError", "draft", "actor")


def test_replayed_experts_outside_the_native_topk_keep_score_and_gradient(checks):
    """ISEEKYAN/Megatron-LM #79: every replayed expert here is one the trainer's own top-k would not
    pick; each keeps a nonzero routing prob, and each one's row of the router weight gets a
    nonzero gradient (no aux loss: the replayed probs are the only path to the router)."""
    r = checks["off_topk_replay"]
    assert r["disjoint"], "the targets must all lie outside the native top-k"
    assert sorted(r["min_prob"]) == r["layers"] and sorted(r["grad_rows"]) == r["layers"]
    for layer, p in r["min_prob"].items():
        assert p > 0.0, f"layer {layer}: a replayed expert's routing prob is {p}"
    for layer, rows in r["grad_rows"].items():
        assert rows and all(g > 0 for g in rows.values()), f"layer {layer}: router grad rows {rows}"


def test_degenerate_routes_are_refused_or_counted_never_read_as_no_route(checks):
    """vLLM #54730 in a zero-row transport: an all-zero row inside a sample's captured rows."""
    _raised(checks["degenerate_refused"], "DegenerateRouteError", "sample 1, row 3 (token 3)", "duplicate expert ids")
    assert checks["degenerate_native"]["ok"], checks["degenerate_native"].get("trace")
    m = checks["degenerate_native"]["value"]
    assert (m["r3bridge/samples/replayed"], m["r3bridge/samples/refused"], m["r3bridge/samples/native"]) == (2, 1, 0)
    assert m["r3bridge/degenerate_pairs"] > 0 and m["r3bridge/native_pairs"] >= m["r3bridge/degenerate_pairs"]
    # the micro-batch was read through the one reader: one handed object, one row map
    assert m["read_stats"]["routes"] == m["read_stats"]["row_maps"] == 1
    assert m["read_stats"]["forms"] == {"packed/zero/rollout": 1}


def test_r3_coverage_floor_fails_a_pass_without_usable_routes(checks):
    """Every row zero: each sample reads as having no route at all; the default floor fails the pass."""
    _raised(checks["coverage_floor"], "CoverageError", "coverage_floor=0.1", "0 samples replayed, 3 with no route")


def test_one_degenerate_pair_is_counted_once(checks):
    """One (row, layer) pair whose ids repeat: the error says 1 pair, and so does ``degenerate_pairs``."""
    _raised(checks["degenerate_one_pair_refused"], "DegenerateRouteError", "sample 1, row 3 (token 3)",
            "1 bad (row, layer) pairs in total")
    m = checks["degenerate_one_pair_native"]["value"]
    assert m["r3bridge/degenerate_pairs"] == 1 and m["r3bridge/samples/refused"] == 1


def test_samples_without_routes_route_natively_and_are_counted_apart(checks):
    """A pass whose samples all came with 0 rows (aborted) passes min_coverage and the coverage floor,
    routes natively, counts them apart and says so once; one aborted sample among replayed ones
    leaves min_coverage=0.9 satisfied."""
    everyone = checks["aborted_all"]
    assert everyone["ok"], everyone.get("trace")
    m = everyone["value"]["metrics"]
    assert (m["r3bridge/samples/without_routes"], m["r3bridge/samples/replayed"], m["r3bridge/samples/native"],
            m["r3bridge/replayed_pairs"]) == (3, 0, 0, 0)
    assert everyone["value"]["topk"] == checks["invalid_rows_native"]["native"]
    said = [line for line in everyone["value"]["log"] if "without routes" in line]
    assert len(said) == 1 and "routed natively" in said[0], everyone["value"]["log"]
    one = checks["aborted_one"]
    assert one["ok"], one.get("trace")
    m = one["value"]["metrics"]
    assert (m["r3bridge/samples/without_routes"], m["r3bridge/samples/replayed"], m["r3bridge/samples/native"]) == (1, 2, 0)
    assert not [line for line in one["value"]["log"] if "without routes" in line]

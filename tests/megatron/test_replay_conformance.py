"""Conformance grid of the Megatron driver on real megatron-core (CPU, gloo, 2 or 4 ranks).

All cells of one world size run in one set of processes (spawning is the expensive part); each
cell's checks are reported by its own test. See tests/megatron/replay_grid.py for what a cell
does on every rank.
"""
from __future__ import annotations

import pytest
import replay_grid as grid

from r3bridge import ReplayBatch
from r3bridge.testing.harness.dist import spawn_layouts

CELLS = grid.default_cells()


@pytest.fixture(scope="module")
def grid_results() -> dict[str, tuple[list, list]]:
    out: dict[str, tuple[list, list]] = {}
    by_world: dict[int, list[grid.Cell]] = {}
    for c in CELLS:
        by_world.setdefault(grid.cell_world_size(c), []).append(c)
    for world, cells in sorted(by_world.items()):
        res = spawn_layouts(grid.grid_worker, world_size=world, layouts=grid.layouts_for(cells),
                            args=(cells,), timeout=1500)
        for i, c in enumerate(cells):
            out[c.name] = (res[2 * i], res[2 * i + 1])
    return out


def _ranks(grid_results, name):
    par, ser = grid_results[name]
    for r, o in enumerate(par + ser):
        assert "error" not in o, f"cell {name}, rank {r}:\n{o['error']}"
    return par, ser


@pytest.mark.parametrize("cell", [c.name for c in CELLS])
def test_r3_dispatches_exactly_the_targets(grid_results, cell):
    par, _ = _ranks(grid_results, cell)
    for r, o in enumerate(par):
        assert o["r3_errors"] == [], f"rank {r}: {o['r3_errors'][:5]}"
        # forward-only and training passes, every MoE layer of the rank, every micro-batch (a
        # dense pipeline stage has none: nothing to check there)
        assert o["r3_router_calls_checked"] >= 2 * len(grid.SEQ_LENS) * len(o["layers"])
        assert (o["r3_rows_checked"] > 0) == bool(o["layers"]) and o["r3_mismatching_rows"] == 0
        m = o["r3_metrics"]
        # micro-batch 1 has rows without a route and every sequence's last token has none
        assert 0.5 < m["r3bridge/coverage"] < 1.0
        assert m["r3bridge/native_pairs"] > 0
        # random targets rarely equal the native choice: agreement well below 1 proves replay acted
        assert m["r3bridge/agreement/mean"] < 0.6
        assert o["unmanaged_calls"] == 0


@pytest.mark.parametrize("cell", [c.name for c in CELLS])
def test_r2_record_replay_is_bit_exact_and_matches_serial(grid_results, cell):
    par, ser = _ranks(grid_results, cell)
    serial = ReplayBatch.from_bytes(ser[0]["recorded"])
    for r, o in enumerate(par):
        rec = ReplayBatch.from_bytes(o["recorded"])
        assert rec.route_kind == "recorded"
        assert rec.rows_per_seq == [n for lens in grid.SEQ_LENS for n in lens]
        assert rec.equals(serial), f"rank {r}: recorded routes differ from the TP=PP=CP=1 run"
        if o["r2_logits_compared"]:
            assert o["r2_logits_equal"], f"rank {r}: replaying the recorded routes changed the logits"
        assert o["r2_agreement"] == 1.0
        # the replay pass's router calls dispatched the recorded routes, row by row
        assert o["r2_errors"] == [], f"rank {r}: {o['r2_errors'][:5]}"
        assert (o["r2_rows_checked"] > 0) == bool(o["layers"]) and o["r2_mismatching_rows"] == 0


@pytest.mark.parametrize("cell", [c.name for c in CELLS if c.weights])
def test_r2_recorded_weights_gathered_and_replayed_row_for_row(grid_results, cell):
    """Routing weights under TP / SP, CP, PP and VPP: the combine weights recorded next to the ids
    are gathered into the serial run's rows (up to the layouts' float rounding), and replaying
    them gives every router call exactly the recorded weights."""
    import torch

    par, ser = _ranks(grid_results, cell)
    serial = ser[0]["recorded_weights"]
    for r, o in enumerate(par):
        assert o["recorded_weights"].dtype == torch.float32 and o["recorded_weights"].shape == serial.shape
        torch.testing.assert_close(o["recorded_weights"], serial, rtol=1e-4, atol=1e-6)
        assert len(o["r2w_probs_equal"]) == len(grid.SEQ_LENS) * len(o["layers"]) and all(o["r2w_probs_equal"]), r
        m = o["r2w_metrics"]
        assert m["r3bridge/weights/replayed_pairs"] == m["r3bridge/replayed_pairs"] > 0
        assert m["r3bridge/weights/live_pairs"] == m["r3bridge/native_pairs"]


@pytest.mark.parametrize("cell", [c.name for c in CELLS])
def test_no_state_left_after_steps(grid_results, cell):
    par, _ = _ranks(grid_results, cell)
    for o in par:
        assert o["state_clean"]
        if "tensor_growth" in o:
            assert o["tensor_growth"] <= 0, f"{o['tensor_growth']} tensors accumulated over replay steps"
            assert o["tensor_bytes_growth"] <= 0, f"{o['tensor_bytes_growth']} bytes accumulated over replay steps"


def test_layers_and_mtp_routers(grid_results):
    par, _ = _ranks(grid_results, "mtp")
    last = [o for o in par if o["mtp_routers"]]
    assert last, "the MTP block's router was not found on the last stage"
    assert all(o["mtp_calls"] > 0 for o in last), "MTP routers must still route (natively)"
    assert all(o["hooked_layers"] == o["layers"] for o in par), "a router hooked twice, or the MTP router hooked"
    par, _ = _ranks(grid_results, "pp4_uneven_dense_stage")
    assert [o["layers"] for o in par] == [[], [2, 3], [4, 5], [6, 7, 8]]
    par, _ = _ranks(grid_results, "int_freq_2")
    assert par[0]["layers"] == [0, 2]


def _grad_checked(grid_results, name):
    """Every run of the cell that ran the gradient check (the parallel layout; for some cells
    the TP=PP=CP=EP=1 reference run too)."""
    par, ser = _ranks(grid_results, name)
    return [o for o in par + ser if "grad" in o]


@pytest.mark.parametrize("cell", [c.name for c in CELLS])
def test_gradients_bit_equal_under_replay(grid_results, cell):
    """R2: the record replayed in the update gives the native step's gradients, loss and aux-loss
    terms bit for bit; R3: routes unlike the router's own give the gradients of the same routes
    forced without r3bridge (r3bridge.testing.harness.forced_routing)."""
    spec = {c.name: c for c in CELLS}[cell].spec
    runs = _grad_checked(grid_results, cell)
    assert len(runs) >= grid.cell_world_size({c.name: c for c in CELLS}[cell])
    assert any(o["grad"]["r2_vs_native"]["losses"] == len(grid.SEQ_LENS) for o in runs), "no rank compared losses"
    for r, o in enumerate(runs):
        g = o["grad"]
        assert g["state_clean"], f"run {r}: a router kept the forced reference's object, or a pass stayed open"
        assert g["native_route_errors"] == [], f"run {r}: the native step did not route as R2 recorded: {g['native_route_errors'][:3]}"
        for key in ("r2_vs_native", "r3_vs_forced"):
            x = g[key]
            assert x["grads_equal"], (f"run {r}, {key}: {len(x['differing'])} of {x['params']} gradients differ "
                                      f"(max |d| {x['grad_maxdiff']:.3g}): {x['differing'][:4]}; "
                                      f"on one side only: {x['only_one_side'][:4]}")
            assert x["losses_equal"], f"run {r}, {key}: losses differ"
            assert x["terms_equal"], f"run {r}, {key}: aux-loss terms differ"
            # a stage without MoE layers (pp4's first) logs none
            assert ("load_balancing_loss" in x["terms"]) == bool(o["layers"]), f"run {r}, {key}: {x['terms']}"
            assert x["grad_scale"] > 0
        # the forced routes are not the router's own: R3 vs its reference is not native vs native
        assert g["r3_differs_from_native"]
        names = g["r2_vs_native"]["param_names"]
        if o["layers"]:
            assert any(".router." in n for n in names) and any(".experts." in n for n in names), names
        if spec.attention == "real" and any(".decoder." in n for n in names):
            assert any(".self_attention." in n for n in names), names
        if spec.extra_config.get("moe_shared_expert_intermediate_size") and o["layers"]:
            assert any(".shared_experts." in n for n in names), names
        if spec.extra_config.get("moe_z_loss_coeff") and o["layers"]:
            assert "z_loss" in g["r2_vs_native"]["terms"], g["r2_vs_native"]["terms"]


def test_broken_backward_dispatch_is_caught(grid_results):
    """A replay step whose backward dispatch of the replayed tokens moves no payload (ROCm/mori
    #675, injected in the test): every forward-only check passes (routes dispatched, loss and
    aux-loss terms bit-equal to the native step, R2's replayed logits), the gradient check fails."""
    par, _ = _ranks(grid_results, "ep2_alltoall")
    for r, o in enumerate(par):
        g = o["grad"]
        b = g["broken_vs_native"]
        assert g["broken_route_errors"] == []
        assert b["losses_equal"] and b["terms_equal"]
        assert o["r2_logits_equal"] or not o["r2_logits_compared"]
        assert o["r2_errors"] == [] and o["r3_errors"] == []
        assert not b["grads_equal"], f"rank {r}: the broken backward went unnoticed"
        # upstream of the dispatch: attention, the router (through its input) and the embedding
        for part in (".router.", ".self_attention.", "embedding"):
            assert any(part in n for n in b["differing"]), f"rank {r}: no {part} gradient differs: {b['differing']}"

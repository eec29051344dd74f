"""Rows without a route stay out of aux loss and z-loss (stats_mask.py), on a real megatron model.

One R3 training step on a MoE-only model (rows never mix), a micro-batch with packing padding
and rows without a route; see tests/megatron/stats_checks.py.
"""
from __future__ import annotations

import pytest
from stats_checks import run_stats_checks

from r3bridge.testing.harness.dist import spawn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cases():
    return spawn(run_stats_checks, world_size=1, args=([13, 7, 20], 48, 3, {}), timeout=600)[0]


def test_unrouted_rows_do_not_move_aux_loss_or_z_loss(cases):
    a, b = cases[(True, False)], cases[(True, True)]
    assert a["routed_rows"] < a["rows"]
    assert a["aux_loss"] and a["z_loss"]
    assert a["aux_loss"] == b["aux_loss"]
    assert a["z_loss"] == b["z_loss"]
    assert "r3bridge/stats_unmasked_calls" not in a["metrics"]


def test_without_the_mask_unrouted_rows_move_the_losses(cases):
    # what the mask removes: the same step with it off follows the unrouted rows' tokens
    off, off_p = cases[(False, False)], cases[(False, True)]
    assert off["aux_loss"] != off_p["aux_loss"] and off["z_loss"] != off_p["z_loss"]
    assert off["aux_loss"] != cases[(True, False)]["aux_loss"]


def test_routes_are_replayed_alike_with_and_without_the_mask(cases):
    on, off = cases[(True, False)], cases[(False, False)]
    assert on["metrics"]["r3bridge/coverage"] == off["metrics"]["r3bridge/coverage"]


def test_expert_bias_routers_are_left_unmasked_and_counted(cases):
    # megatron's _apply_expert_bias cannot take a padding mask (it broadcasts [T, E] & [T]): the
    # step leaves those routers' statistics as they are and says so in its metrics
    eb = cases["expert_bias"]
    n_layers = len(eb["tokens_per_expert"])
    assert eb["metrics"]["r3bridge/stats_unmasked_calls"] == n_layers
    for lid, counts in eb["tokens_per_expert"].items():
        assert sum(counts) == eb["rows"] * 2                        # every row, top-2
        assert counts != eb["expected_routed_counts"][lid]


def test_the_mask_reaches_the_recompute(cases):
    a, b = cases["recompute"]
    assert a["aux_loss"] and a["aux_loss"] == b["aux_loss"] and a["z_loss"] == b["z_loss"]
    assert a["aux_loss"] == cases[(True, False)]["aux_loss"]

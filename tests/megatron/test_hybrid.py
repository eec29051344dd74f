"""Hybrid (Nemotron-H style) models: MoE layers found at their pattern index, fed engine routes.

A real megatron hybrid model (MambaModel on 0.16-0.17, HybridModel from 0.18) with MoE ("E") and
dense MLP ("-") layers; "M" needs Mamba kernels and "*" TE attention, neither exists on the CPU
harness (tests/megatron/hybrid.py).
"""
from __future__ import annotations

import types

import pytest
from hybrid import run_hybrid_check

from r3bridge.megatron.discovery import hybrid_pattern
from r3bridge.testing.harness.dist import spawn

pytestmark = pytest.mark.slow
PATTERN = "E-EE-E"
MOE = [0, 2, 3, 5]


@pytest.fixture(scope="module")
def hybrid():
    return spawn(run_hybrid_check, world_size=1, args=(PATTERN,), timeout=600)[0]


def test_routers_sit_at_the_pattern_index_engines_report(hybrid):
    assert [n - 1 for n in hybrid["router_layer_numbers"]] == MOE
    assert hybrid["layer_ids"] == MOE
    assert hybrid["calls"] == MOE


def test_engine_routes_are_replayed_exactly(hybrid):
    assert hybrid["errors"] == []
    assert hybrid["metrics"]["r3bridge/replayed_pairs"] == len(MOE) * sum(n - 1 for n in (13, 7, 20))
    assert hybrid["grads"]


def test_moe_layer_freq_cannot_describe_a_hybrid_model(hybrid):
    # the hybrid stack ignores moe_layer_freq; read from it, the layout would be refused
    assert "LayerMappingError" in hybrid["freq_layout_error"] and str(MOE) in hybrid["freq_layout_error"]


def test_pattern_drops_pipe_and_mtp_parts():
    assert hybrid_pattern(types.SimpleNamespace(hybrid_layer_pattern="ME*E|E-E/*E/*E")) == "ME*EE-E"
    assert hybrid_pattern(types.SimpleNamespace(hybrid_layer_pattern=None, hybrid_override_pattern="M-E")) == "M-E"
    assert hybrid_pattern(types.SimpleNamespace()) is None

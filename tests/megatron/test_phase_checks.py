"""The checks adapters call from the phase runner: route presence per plan and the R2 recording's
size. Every adapter words its framework's settings through ``provide``; the rule is the core's."""
from __future__ import annotations

import pytest

from r3bridge import ConfigError, ReplayBatch, ReplayStateError
from r3bridge.config import Action, Phase, ReplayConfig
from r3bridge.session.phase import PhaseResult, PhaseRunner

PROVIDE = {"rollout": "turn on engine routes", "recorded": "write R2 routes back", "off": "turn engine routes off"}


def _runner(mode: str) -> PhaseRunner:
    return PhaseRunner(None, ReplayConfig(replay_mode=mode))


@pytest.mark.parametrize("mode,phase,present,words", [
    ("R3", Phase.UPDATE, False, ["replay_mode=R3", "'routes'", "turn on engine routes", "micro-batch 2"]),
    ("R3", Phase.OLD_LOG_PROB, False, ["turn on engine routes"]),
    ("R2", Phase.UPDATE, False, ["replay_mode=R2", "write R2 routes back"]),
    ("R2", Phase.OLD_LOG_PROB, True, ["records routes in compute_log_prob", "turn engine routes off"]),
])
def test_check_routes_refuses_what_the_plan_cannot_use(mode, phase, present, words):
    r = _runner(mode)
    with pytest.raises(ConfigError) as e:
        r.check_routes(r.config.plan(phase), present, field="routes", where="micro-batch 2", provide=PROVIDE)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("mode,phase,present", [
    ("R3", Phase.UPDATE, True), ("R3", Phase.OLD_LOG_PROB, True), ("R2", Phase.UPDATE, True),
    ("R2", Phase.OLD_LOG_PROB, False)])
def test_check_routes_accepts_what_the_plan_needs(mode, phase, present):
    r = _runner(mode)
    r.check_routes(r.config.plan(phase), present, field="routes", provide=PROVIDE)


def test_recorded_for_checks_one_sequence_per_sample():
    rb = ReplayBatch.from_ragged([[[[0, 1]]], [[[1, 2]]]], num_experts=4, layer_ids=[1], route_kind="recorded")
    res = PhaseResult(Phase.OLD_LOG_PROB, Action.RECORD, recorded=rb)
    assert res.recorded_for(2) is rb
    with pytest.raises(ReplayStateError, match="R2 recorded 2 sequences for a batch of 3 samples"):
        res.recorded_for(3)
    with pytest.raises(ReplayStateError, match="R2 recorded None sequences"):
        PhaseResult(Phase.OLD_LOG_PROB, Action.RECORD).recorded_for(1)

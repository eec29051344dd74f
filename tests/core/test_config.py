"""`configs/r3bridge.yaml` == `ReplayConfig()` defaults; phase_plan semantics; config errors."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import omegaconf
import pytest

from r3bridge import ConfigError
from r3bridge.config import Action, Phase, ReplayConfig, ReplayMode, phase_plan

YAML = Path(__file__).resolve().parents[2] / "configs" / "r3bridge.yaml"


def test_yaml_equals_dataclass_defaults():
    cfg = omegaconf.OmegaConf.load(YAML)
    section = omegaconf.OmegaConf.to_container(cfg["r3bridge"], resolve=True)
    assert set(section) == {f.name for f in fields(ReplayConfig)}
    assert ReplayConfig.from_mapping(section) == ReplayConfig()
    # value by value, as the yaml spells them (catches a default changed on one side only)
    defaults = ReplayConfig().as_dict()
    for key, value in section.items():
        assert value == defaults[key], key


def test_yaml_values_roundtrip_through_from_mapping():
    cfg = ReplayConfig.from_mapping({"replay_mode": "r3", "min_coverage": 0.5, "invalid_rows": "error"})
    assert cfg.replay_mode is ReplayMode.R3 and cfg.min_coverage == 0.5
    assert ReplayConfig.from_mapping(cfg.as_dict()) == cfg
    assert ReplayConfig.from_mapping(None) == ReplayConfig()


@pytest.mark.parametrize("mode, phase, action, source", [
    ("off", "compute_log_prob", Action.NATIVE, None),
    ("off", "update", Action.NATIVE, None),
    ("R2", "compute_log_prob", Action.RECORD, None),
    ("R2", "update", Action.REPLAY, "recorded"),
    ("R3", "compute_log_prob", Action.REPLAY, "rollout"),
    ("R3", "update", Action.REPLAY, "rollout"),
    ("R2", "ref_log_prob", Action.NATIVE, None),
    ("R3", "ref_log_prob", Action.NATIVE, None),
    ("off", "ref_log_prob", Action.NATIVE, None),
])
def test_phase_plan(mode, phase, action, source):
    plan = phase_plan(mode, phase)
    assert plan.action is action and plan.source == source
    assert ReplayConfig(replay_mode=mode).plan(Phase(phase)) == plan


def test_mode_parsing_is_case_insensitive():
    assert ReplayMode.parse("r2") is ReplayMode.R2 and ReplayMode.parse(" OFF ") is ReplayMode.OFF


@pytest.mark.parametrize("bad, match", [
    ({"replay_mod": "R3"}, "unknown r3bridge option"),
    ({"replay_mode": "R4"}, "replay_mode must be one of"),
    ({"min_coverage": 1.5}, "min_coverage"),
    ({"invalid_rows": "skip"}, "invalid_rows"),
])
def test_bad_config_raises_config_error(bad, match):
    with pytest.raises(ConfigError, match=match):
        ReplayConfig.from_mapping(bad)


def test_unknown_phase_raises_config_error():
    with pytest.raises(ConfigError, match="unknown phase"):
        phase_plan("R3", "rollout")


@pytest.mark.parametrize("bad, match", [
    ({"trace_dir": ""}, "trace_dir must be a folder path"),
    ({"trace_dir": 3}, "trace_dir must be a folder path"),
    ({"trace_every": 0}, "trace_every must be an integer >= 1"),
    ({"trace_every": 1.5}, "trace_every must be an integer >= 1"),
    ({"trace_max_bytes": 0}, "trace_max_bytes must be an integer >= 1"),
    ({"trace_max_bytes": True}, "trace_max_bytes must be an integer >= 1"),
])
def test_bad_trace_options_raise_config_error(bad, match):
    with pytest.raises(ConfigError, match=match):
        ReplayConfig.from_mapping(bad)


def test_tracing_is_off_by_default_and_one_key_turns_it_on(monkeypatch):
    assert ReplayConfig().trace_dir is None
    cfg = ReplayConfig.from_mapping({"replay_mode": "R3", "trace_dir": "/tmp/run1"})
    assert cfg.trace_dir == "/tmp/run1" and cfg.trace_every == 1 and cfg.trace_max_bytes == 1 << 30
    # the section reaches framework workers through R3BRIDGE_CONFIG (verl, SkyRL Ray workers)
    monkeypatch.setenv("R3BRIDGE_CONFIG", '{"replay_mode": "R3", "trace_dir": "/tmp/run1", "trace_every": 5}')
    env = ReplayConfig.from_env()
    assert env.trace_dir == "/tmp/run1" and env.trace_every == 5
    assert ReplayConfig.from_mapping(env.as_dict()) == env

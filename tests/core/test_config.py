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


@pytest.mark.parametrize("mode, phase, action, route_kind", [
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
def test_phase_plan(mode, phase, action, route_kind):
    plan = phase_plan(mode, phase)
    assert plan.action is action and plan.route_kind == route_kind
    assert ReplayConfig(replay_mode=mode).plan(Phase(phase)) == plan


def test_mode_parsing_is_case_insensitive():
    assert ReplayMode.parse("r2") is ReplayMode.R2 and ReplayMode.parse(" OFF ") is ReplayMode.OFF


@pytest.mark.parametrize("bad, match", [
    ({"replay_mod": "R3"}, "unknown r3bridge option"),
    ({"replay_mode": "R4"}, "replay_mode must be one of"),
    ({"min_coverage": 1.5}, "min_coverage"),
    ({"invalid_rows": "skip"}, "invalid_rows"),
    ({"provenance_check": "warn"}, "provenance_check must be one of refuse, count, off"),
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


# ----------------------------------------------------------------------- one "off", OmegaConf
@pytest.mark.parametrize("spelling", ["off", "OFF", "disabled", "Disabled", "false", "False", False])
def test_every_spelling_of_off_means_off(spelling):
    assert ReplayMode.parse(spelling) is ReplayMode.OFF
    assert ReplayConfig(replay_mode=spelling).replay_mode is ReplayMode.OFF


def test_unquoted_yaml_off_reads_as_off():
    # YAML 1.1 reads an unquoted `off` as the boolean False (OmegaConf's loader does too)
    section = omegaconf.OmegaConf.create("replay_mode: off\nmin_coverage: 0.5")
    assert section.replay_mode is False
    cfg = ReplayConfig.from_mapping(omegaconf.OmegaConf.to_container(section))
    assert cfg.replay_mode is ReplayMode.OFF and cfg.min_coverage == 0.5


@pytest.mark.parametrize("yaml_text, mode", [("replay_mode: off", ReplayMode.OFF),
                                             ("replay_mode: disabled", ReplayMode.OFF),
                                             ("replay_mode: R3\nmin_coverage: 0.25", ReplayMode.R3),
                                             ("replay_mode: r2", ReplayMode.R2)])
def test_replay_config_is_an_omegaconf_structured_config(yaml_text, mode):
    schema = omegaconf.OmegaConf.structured(ReplayConfig)
    assert schema.replay_mode == "off"
    merged = omegaconf.OmegaConf.merge(schema, omegaconf.OmegaConf.create(yaml_text))
    cfg = omegaconf.OmegaConf.to_object(merged)
    assert isinstance(cfg, ReplayConfig) and cfg.replay_mode is mode


def test_structured_config_refuses_unknown_keys_and_bad_modes():
    schema = omegaconf.OmegaConf.structured(ReplayConfig)
    with pytest.raises(omegaconf.errors.ConfigKeyError):
        omegaconf.OmegaConf.merge(schema, omegaconf.OmegaConf.create("replay_mod: R3"))
    merged = omegaconf.OmegaConf.merge(schema, omegaconf.OmegaConf.create("replay_mode: R4"))
    with pytest.raises(ConfigError, match="replay_mode must be one of"):
        omegaconf.OmegaConf.to_object(merged)


def test_resolve_with_origin_names_where_the_section_came_from(monkeypatch):
    monkeypatch.delenv("R3BRIDGE_CONFIG", raising=False)
    monkeypatch.delenv("R3BRIDGE_REPLAY_MODE", raising=False)
    monkeypatch.delenv("R3BRIDGE_CONFIG_FROM", raising=False)
    assert ReplayConfig.resolve_with_origin(None) == (ReplayConfig(), "default")
    assert ReplayConfig.resolve_with_origin({"replay_mode": "R2"})[1] == "config"
    monkeypatch.setenv("R3BRIDGE_REPLAY_MODE", "R3")
    cfg, origin = ReplayConfig.resolve_with_origin(None)
    assert cfg.replay_mode is ReplayMode.R3 and origin == "environment (R3BRIDGE_REPLAY_MODE)"
    monkeypatch.setenv("R3BRIDGE_CONFIG", '{"replay_mode": "R3", "min_coverage": 0.5}')
    assert ReplayConfig.resolve_with_origin(None)[1] == "environment (R3BRIDGE_CONFIG)"


def test_the_environment_is_merged_with_the_section_or_refused(monkeypatch, tmp_path):
    """R3BRIDGE_CONFIG / R3BRIDGE_REPLAY_MODE next to a job's section: the environment fills the
    keys the section leaves unset, a key set differently in both is refused, a launcher's forward
    is read by workers and not merged again (issue 39: the environment was dropped silently)."""
    for var in ("R3BRIDGE_CONFIG", "R3BRIDGE_REPLAY_MODE", "R3BRIDGE_CONFIG_FROM"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    env = {"R3BRIDGE_CONFIG": '{"trace_dir": "routes", "replay_mode": "R3"}'}
    cfg, origin = ReplayConfig.resolve_with_origin({"replay_mode": "R3"}, env)
    assert cfg.trace_dir == str(tmp_path / "routes") and cfg.replay_mode is ReplayMode.R3   # absolute here
    assert origin == "config + environment (R3BRIDGE_CONFIG): trace_dir"
    # a typed section (SkyRL's trainer.r3bridge, AReaL's r3bridge:): an unset key holds its default
    cfg, origin = ReplayConfig.resolve_with_origin(ReplayConfig(replay_mode="R3", min_coverage=0.5), env)
    assert (cfg.min_coverage, cfg.trace_dir) == (0.5, str(tmp_path / "routes")) and origin.endswith(": trace_dir")
    assert ReplayConfig.resolve_with_origin({"replay_mode": "R2"}, {"R3BRIDGE_REPLAY_MODE": "R2"}) == \
        (ReplayConfig(replay_mode="R2"), "config")
    with pytest.raises(ConfigError, match=r"trace_dir='/a' in trainer.r3bridge and trace_dir='/b' in R3BRIDGE_CONFIG"):
        ReplayConfig.resolve_with_origin({"trace_dir": "/a"}, {"R3BRIDGE_CONFIG": '{"trace_dir": "/b"}'},
                                         section_name="trainer.r3bridge")
    with pytest.raises(ConfigError, match=r"replay_mode='off' in .* and replay_mode='R3' in R3BRIDGE_REPLAY_MODE"):
        ReplayConfig.resolve_with_origin({"replay_mode": "off"}, {"R3BRIDGE_REPLAY_MODE": "r3"})
    with pytest.raises(ConfigError, match="unknown r3bridge option"):
        ReplayConfig.resolve_with_origin({"replay_mode": "R3"}, {"R3BRIDGE_CONFIG": '{"trace_dri": "/b"}'})
    forwarded = {"R3BRIDGE_CONFIG": '{"replay_mode": "R3", "trace_dir": "/b"}', "R3BRIDGE_CONFIG_FROM": "verl launcher"}
    assert ReplayConfig.resolve_with_origin(None, forwarded) == \
        (ReplayConfig(replay_mode="R3", trace_dir="/b"), "environment (R3BRIDGE_CONFIG from the verl launcher)")
    assert ReplayConfig.resolve_with_origin({"replay_mode": "R2"}, forwarded) == (ReplayConfig(replay_mode="R2"), "config")


def test_announce_says_off_by_default_and_the_mode_in_force(monkeypatch, caplog):
    import logging

    from r3bridge.announce import announce, replay_mode_metric

    with caplog.at_level(logging.INFO, logger="r3bridge"):
        line = announce(ReplayConfig(), "default", "test")
        assert "replay_mode=off (from default)" in line and "OFF" in line
        assert any(r.levelno == logging.WARNING and "replay_mode=off" in r.getMessage() for r in caplog.records)
        caplog.clear()
        line = announce(ReplayConfig(), "config", "test")   # asked for (cpu_step --mode off): still a WARNING
        assert "replay_mode=off (from config); routing replay is OFF" in line
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        line = announce(ReplayConfig(replay_mode="R3"), "config", "test")
        assert "replay_mode=R3 (from config)" in line
    assert replay_mode_metric(ReplayConfig()) == {"r3bridge/replay_mode": 0.0}
    assert replay_mode_metric(ReplayConfig(replay_mode="R2", metrics_prefix="x/")) == {"x/replay_mode": 2.0}


def test_announce_reaches_a_root_handler_left_at_warning():
    """verl's workers configure only the root logger (a handler, level WARNING): the R3 startup line
    must still reach that handler, not be dropped by the inherited level (seen in a fresh verl
    virtualenv: scripts/guides_fresh_venv.sh)."""
    import logging

    from r3bridge.announce import announce, logger

    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    root = logging.getLogger()
    old_level, old_r3_level = root.level, logger.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logger.setLevel(logging.NOTSET)
    try:
        announce(ReplayConfig(replay_mode="R3"), "config", "verl engine")
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        logger.setLevel(old_r3_level)
    assert [r.getMessage() for r in seen if "replay_mode=R3 (from config)" in r.getMessage()], seen

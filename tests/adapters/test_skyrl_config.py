"""The r3bridge section on SkyRL 0.3's own command line, parsed by SkyRL's own parser."""
from __future__ import annotations

import pytest

from r3bridge.adapters.skyrl.config import parse_cli, prepare_skyrl_config, replay_config_from_skyrl
from r3bridge.config import ReplayConfig, ReplayMode
from r3bridge.errors import ConfigError

R3_LINE = ["trainer.override_entrypoint=r3bridge.adapters.skyrl.main", "trainer.strategy=megatron",
           "trainer.r3bridge.replay_mode=R3", "trainer.r3bridge.min_coverage=0.5",
           "trainer.policy.megatron_config.tensor_model_parallel_size=2",
           "generator.inference_engine.enable_return_routed_experts=true",
           "generator.inference_engine.distributed_executor_backend=mp"]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("R3BRIDGE_CONFIG", raising=False)
    monkeypatch.delenv("R3BRIDGE_REPLAY_MODE", raising=False)


def test_section_on_skyrls_command_line():
    cfg = parse_cli(R3_LINE)
    assert cfg.trainer.r3bridge == ReplayConfig(replay_mode="R3", min_coverage=0.5)
    assert cfg.trainer.policy.megatron_config.tensor_model_parallel_size == 2     # SkyRL's own keys still parse
    assert replay_config_from_skyrl(cfg) == (ReplayConfig(replay_mode="R3", min_coverage=0.5), "config")


def test_skyrls_check_passes_without_moe_enable_routing_replay():
    """The user no longer writes moe_enable_routing_replay=true: SkyRL's own validate_cfg passes."""
    from r3bridge.adapters.skyrl._compat import import_skyrl

    utils = import_skyrl("skyrl.train.utils.utils")
    cfg = parse_cli(R3_LINE)
    assert cfg.trainer.policy.megatron_config.moe_enable_routing_replay is False
    with pytest.raises(AssertionError, match="moe_enable_routing_replay must be True"):
        utils.validate_inference_engine_cfg(parse_cli(R3_LINE))       # SkyRL's own check, unprepared
    assert prepare_skyrl_config(cfg).replay_mode is ReplayMode.R3
    assert cfg.trainer.policy.megatron_config.moe_enable_routing_replay is True
    utils.validate_inference_engine_cfg(cfg)
    utils.validate_megatron_cfg(cfg)


@pytest.mark.parametrize("line, needle", [
    (["trainer.r3bridge.replay_mode=R3"], "enable_return_routed_experts=true"),
    (["trainer.r3bridge.replay_mode=R2", "generator.inference_engine.enable_return_routed_experts=true"],
     "enable_return_routed_experts=true asks vLLM"),
    (["trainer.r3bridge.replay_mode=R2", "trainer.policy.megatron_config.moe_enable_routing_replay=true"],
     "two replays at once"),
])
def test_contradictions_name_both_keys(line, needle):
    with pytest.raises(ConfigError, match=needle) as ei:
        prepare_skyrl_config(parse_cli(line))
    assert "trainer.r3bridge.replay_mode" in str(ei.value)


def test_mistyped_keys_and_modes_are_refused():
    with pytest.raises(ValueError, match="replay_mod"):
        parse_cli(["trainer.r3bridge.replay_mod=R3"])
    with pytest.raises(ConfigError, match="replay_mode must be one of"):
        parse_cli(["trainer.r3bridge.replay_mode=R4"])


def test_environment_is_the_fallback(monkeypatch):
    cfg = parse_cli(["trainer.strategy=megatron"])
    assert replay_config_from_skyrl(cfg) == (ReplayConfig(), "default")
    monkeypatch.setenv("R3BRIDGE_REPLAY_MODE", "R2")
    rc, source = replay_config_from_skyrl(cfg)
    assert rc.replay_mode is ReplayMode.R2 and source == "environment (R3BRIDGE_REPLAY_MODE)"
    # the environment fills what the command line leaves unset; a key set differently in both (an
    # explicit "off" included, which the command line tells) is refused, never dropped (issue 39)
    argv = ["trainer.r3bridge.min_coverage=0.5"]
    assert replay_config_from_skyrl(parse_cli(argv), argv) == \
        (ReplayConfig(replay_mode="R2", min_coverage=0.5), "config + environment (R3BRIDGE_REPLAY_MODE): replay_mode")
    argv = ["trainer.r3bridge.replay_mode=off"]
    with pytest.raises(ConfigError, match=r"replay_mode='off' in trainer.r3bridge \(command line\) and replay_mode='R2'"):
        replay_config_from_skyrl(parse_cli(argv), argv)


def test_a_replaying_reference_is_refused_on_the_command_line():
    """Roles (NeMo RL #4083): SkyRL's reference worker replays rollout routes when its own
    megatron_config asks for megatron's replay; only the actor replays."""
    from r3bridge.errors import RoleError

    with pytest.raises(RoleError, match="trainer.ref.megatron_config.moe_enable_routing_replay=true.*only the actor"):
        prepare_skyrl_config(parse_cli(R3_LINE + ["trainer.ref.megatron_config.moe_enable_routing_replay=true"]))
    assert prepare_skyrl_config(parse_cli(R3_LINE)).replay_mode is ReplayMode.R3


def test_a_moe_only_layer_axis_is_refused():
    """SkyRL rolls out with vLLM only (every hidden layer): a layer_axis it cannot honour is refused,
    never ignored."""
    with pytest.raises(ConfigError, match="layer_axis=moe_only"):
        prepare_skyrl_config(parse_cli(R3_LINE + ["trainer.r3bridge.layer_axis=moe_only"]))


@pytest.mark.parametrize("setting", ["generator.inference_engine.speculative_config={method:mtp,num_speculative_tokens:1}",
                                     "trainer.mtp.enabled=true"])
def test_r3_with_speculative_decoding_needs_a_fixed_vllm(setting, monkeypatch):
    """vLLM #48622: before vLLM 0.26.0 the draft's layer 0 overwrote the target's layer-0 routes."""
    monkeypatch.delenv("SKYRL_DISABLE_SPEC", raising=False)
    key = setting.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}=.* on vLLM 0.25.1 \(r3bridge.engine_version\): before vLLM 0.26.0"):
        prepare_skyrl_config(parse_cli(R3_LINE + [setting, "trainer.r3bridge.engine_version='0.25.1'"]))
    with pytest.raises(ConfigError, match="vLLM is not installed in the trainer's environment"):
        prepare_skyrl_config(parse_cli(R3_LINE + [setting]))
    assert prepare_skyrl_config(parse_cli(R3_LINE + [setting, "trainer.r3bridge.engine_version='0.26.0'"])
                                ).engine_version == "0.26.0"


@pytest.mark.parametrize("setting", ["generator.inference_engine.enable_pd=true",
                                     "generator.inference_engine.engine_init_kwargs.kv_transfer_config="
                                     "{kv_connector:NixlConnector,kv_role:kv_both}"])
def test_r3_refuses_rollouts_served_through_kv_transfer(setting):
    """Prefill / decode disaggregation or a KV connector: the decode node never runs the prompt
    forward, so the prompt's route rows are whatever the capture buffer held (llm-d-router #1473).
    R3 is refused naming the setting; R2 (the trainer's own routes) is not affected."""
    with pytest.raises(ConfigError, match="KV connector / prefill-decode disaggregation"):
        prepare_skyrl_config(parse_cli(R3_LINE + [setting]))
    r2 = [a.replace("replay_mode=R3", "replay_mode=R2") for a in R3_LINE]
    r2 = [a for a in r2 if "enable_return_routed_experts" not in a]
    assert prepare_skyrl_config(parse_cli(r2 + [setting])).replay_mode.value == "R2"


# ------------------------------------------------------------------ the launcher's refusals come first (issue 50 item 7)
_HIDDEN_IMPORTS = r"""
import runpy, sys
for name in ("aiohttp", "torchdata"):     # a virtualenv without them, as the guide's CPU block made: not importable
    sys.modules[name] = None
sys.argv = ["r3bridge.adapters.skyrl.main", *sys.argv[1:]]
try:
    runpy.run_module("r3bridge.adapters.skyrl.main", run_name="__main__")
finally:
    print("SKYRL-MODULES", sorted(m for m in sys.modules if m == "skyrl" or m.startswith("skyrl.")), file=sys.stderr)
"""


def test_the_launchers_refusals_come_before_skyrls_imports(tmp_path):
    """Without aiohttp / torchdata, no WANDB key and no r3bridge setting: the mode line at WARNING
    level, then one line naming everything the job lacks (SkyRL's imports, the WANDB key, Python 3.12
    and Megatron-Bridge for its workers) before any SkyRL module is imported."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("R3BRIDGE_", "WANDB_"))}
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run([sys.executable, "-c", _HIDDEN_IMPORTS, "trainer.strategy=megatron"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    off = [x for x in lines if "r3bridge (SkyRL launcher, pid " in x]
    assert off and "r3bridge WARNING: " in off[0] and "replay_mode=off (from default)" in off[0], lines
    (error,) = [x for x in lines if x.startswith("error: ")]
    assert error.startswith("error: SkyRL's Megatron job cannot start here: "), error
    for needle in ("imports aiohttp, which is not installed", "imports torchdata, which is not installed",
                   "WANDB_API_KEY", 'pip install "skyrl[megatron]" aiohttp torchdata'):
        assert needle in error, (needle, error)
    if sys.version_info < (3, 12):
        assert "Python 3.11" in error and "megatron.bridge" in error
    assert lines[-1] == "SKYRL-MODULES []", lines[-1]          # refused before SkyRL was imported


@pytest.mark.parametrize("argv, env, want", [
    (["trainer.r3bridge.replay_mode=R3"], {"R3BRIDGE_REPLAY_MODE": "R4"},
     "error: ConfigError: environment (R3BRIDGE_REPLAY_MODE='R4'): replay_mode must be one of off, R2, R3"),
    ([], {"R3BRIDGE_CONFIG": '{"min_coverage": 2}'},
     "error: ConfigError: environment (R3BRIDGE_CONFIG='{\"min_coverage\": 2}'): min_coverage must be in [0, 1]"),
    (["trainer.r3bridge.replay_mod=R3"], {},
     "error: ConfigError: trainer.r3bridge.replay_mod is not an r3bridge option; valid keys: replay_mode, agreement, "),
])
def test_a_bad_setting_is_refused_naming_where_it_was_set(argv, env, want, monkeypatch, capsys):
    """A bad environment setting names the variable, not trainer.r3bridge; a mistyped key lists the valid ones."""
    import sys

    from r3bridge.adapters.skyrl import main as launcher

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["main", "trainer.strategy=megatron", *argv])
    with pytest.raises(SystemExit) as exit_:
        launcher.main()
    assert exit_.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert line.startswith(want), line
    assert "trainer.r3bridge:" not in line


def test_replay_off_is_announced_with_its_warning_level_in_a_bare_process():
    """A Ray worker configures no logging: the 'replay is OFF' line still carries its level."""
    import subprocess
    import sys

    code = ("from r3bridge.announce import announce; from r3bridge.config import ReplayConfig; "
            "announce(ReplayConfig(), 'default', 'SkyRL policy worker')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    (line,) = [x for x in proc.stderr.splitlines() if "replay_mode=off" in x]
    assert " r3bridge WARNING: r3bridge (SkyRL policy worker, pid " in line, proc.stderr

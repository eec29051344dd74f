"""r3bridge's AReaL launcher (``python3 -m r3bridge.adapters.areal.launch``): AReaL's own parser and
config, its own platform detection and allocation parser; what it refuses before AReaL's launcher
starts anything, and how it watches AReaL's wait for inference servers.

The guide's command line itself runs, as written, in tests/adapters/test_guide_commands.py."""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from testlab.areal_env import _keep_logging, import_areal

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "areal"
LINE = [str(EXAMPLE / "gsm8k_r3bridge.py"), "--config", str(EXAMPLE / "gsm8k_megatron.yaml")]


@pytest.fixture(scope="module")
def launch():
    # AReaL's modules the launcher imports, through the test lab's importer (keeps pytest's logging tree)
    for name in ("areal.api.cli_args", "areal.api.alloc_mode", "areal.infra.platforms"):
        import_areal(name)
    from r3bridge.adapters.areal import launch
    return launch


def _config(launch, argv):
    from r3bridge.adapters.areal.config import grpo_config_class, parse_cli
    with _keep_logging():
        config = parse_cli(argv, grpo_config_class())
        raw, _ = import_areal("areal.api.cli_args").parse_cli_args(argv)
    return config, raw


def test_what_areals_launcher_would_fail_on_is_named_one_line_each(launch, tmp_path):
    config, raw = _config(launch, LINE)
    gpu = SimpleNamespace(device_control_env_var="CUDA_VISIBLE_DEVICES", device_name="CUDA")
    sglang_installed = launch.importlib.util.find_spec("sglang") is not None
    assert launch.problems(config, raw, "sglang", platform=gpu) == ([] if sglang_installed else [
        "allocation_mode starts sglang servers (areal.experimental.inference_service.sglang.launch_server), but "
        "the 'sglang' package is not installed here: AReaL's launcher would wait 1200 s for servers that never start"])
    # this machine: AReaL's own platform detection (no accelerator) and the guide's YAML without its sglang: section
    platform = import_areal("areal.infra.platforms").current_platform
    text = (EXAMPLE / "gsm8k_megatron.yaml").read_text()
    start = text.index("\nsglang:")
    (tmp_path / "no_sglang.yaml").write_text(text[:start] + text[text.index("\ntrain_dataset:"):])
    argv = ["--config", str(tmp_path / "no_sglang.yaml"), "rollout.return_routed_experts=false"]
    config, raw = _config(launch, argv)
    found = launch.problems(config, raw, "sglang", platform=platform)
    assert found[0].startswith("r3bridge.replay_mode=R3 replays SGLang's routes, but rollout.return_routed_experts")
    assert "'=0 stdbuf -oL torchrun ...'" in found[1] and "CPU platform" in found[1]
    assert "no 'sglang:' section" in found[2] and "Key 'sglang' is not in struct" in found[2]
    assert all("\n" not in line for line in found)
    # the folders AReaL's launcher requires, created when missing (as AReaL structures its cluster section)
    _, raw = _config(launch, LINE + [f"cluster.fileroot={tmp_path}/root",
                                     f"cluster.name_resolve.nfs_record_root={tmp_path}/nr"])
    cli_args = import_areal("areal.api.cli_args")
    launch._folders(cli_args.to_structured_cfg(raw.get("cluster", {}), cli_args.ClusterSpecConfig))
    assert (tmp_path / "root").is_dir() and (tmp_path / "nr").is_dir()


def test_a_missing_section_is_announced_at_launch_and_a_typo_refused_in_one_line(launch, tmp_path, caplog, capsys,
                                                                                monkeypatch):
    monkeypatch.delenv("R3BRIDGE_CONFIG", raising=False)
    monkeypatch.delenv("R3BRIDGE_REPLAY_MODE", raising=False)
    text = (EXAMPLE / "gsm8k_megatron.yaml").read_text()
    (tmp_path / "plain.yaml").write_text(text[:text.index("\nr3bridge:")] + "\n")
    with caplog.at_level(logging.INFO, logger="r3bridge"), _keep_logging(), pytest.raises(SystemExit) as exit_:
        launch.main(["--config", str(tmp_path / "plain.yaml"), "rollout.return_routed_experts=false"])
    assert exit_.value.code == 2                       # this CPU machine: no accelerator, no sglang
    off = [r for r in caplog.records if "r3bridge (AReaL launcher, pid" in r.getMessage()]
    assert off and off[0].levelno == logging.WARNING, caplog.text
    assert "replay_mode=off (from default); no r3bridge setting was found" in off[0].getMessage()
    # a script whose own config class has more keys than GRPOConfig: its section is the actor's to check
    (tmp_path / "own.yaml").write_text(text + "my_workflow_option: 3\n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="r3bridge"), _keep_logging(), pytest.raises(SystemExit) as exit_:
        launch.main(["--config", str(tmp_path / "own.yaml")])
    assert exit_.value.code == 2
    (note,) = [r.getMessage() for r in caplog.records if "r3bridge (AReaL launcher)" in r.getMessage()]
    assert "the config is not GRPOConfig + r3bridge" in note and "my_workflow_option" in note, note
    capsys.readouterr()
    with _keep_logging(), pytest.raises(SystemExit) as exit_:
        launch.main(LINE + ["r3bridge.replay_mode=R4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: ConfigError: r3bridge: replay_mode must be one of off, R2, R3"), err


def test_the_wait_for_inference_servers_says_what_it_waits_for_and_stops_when_they_died():
    from r3bridge.adapters.areal.launch import SERVER_MODULES, server_wait

    now = [0.0]
    running = {"areal.infra.launcher.sglang_server": 0, SERVER_MODULES["sglang"]: 0}
    registered = [3]                                   # left over from an earlier run: not counted before the wrapper
    wait = server_wait("sglang", 1, lambda: registered[0], "/f/llm_server.log", running=running.get, clock=lambda: now[0])
    assert wait.poll() is None and not wait.done
    running["areal.infra.launcher.sglang_server"] = 1
    registered[0] = 0
    now[0] = 30.0
    assert wait.poll() is None
    running[SERVER_MODULES["sglang"]] = 1
    now[0] = 61.0
    line = wait.poll()
    assert line.startswith("waiting 61 s for 1 sglang server(s) to register (1 server process(es) running")
    assert "gives up after 1200 s" in line and "/f/llm_server.log" in line
    running[SERVER_MODULES["sglang"]] = 0         # the server died; AReaL's wrapper polls it forever
    now[0] = 70.0
    assert wait.poll() is None and not wait.failed      # the wrapper is still there
    running["areal.infra.launcher.sglang_server"] = 0
    line = wait.poll()
    assert wait.failed and line.startswith("the sglang server process(es) exited before registering (70 s")
    ok = server_wait("sglang", 2, lambda: 2, "/f/llm_server.log", running=lambda module: 1, clock=lambda: 5.0)
    assert ok.poll() == "2 sglang server(s) registered after 0 s" and ok.done

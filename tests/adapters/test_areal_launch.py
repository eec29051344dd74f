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
    assert launch.job_check(config).problems == [        # the section against AReaL's settings: SkyRL's words
        "rollout.return_routed_experts=false: R3 replays the rollout engine's routes: set "
        "rollout.return_routed_experts=true so SGLang return them"]
    assert "'=0 stdbuf -oL torchrun ...'" in found[0] and "CPU platform" in found[0]
    assert "no 'sglang:' section" in found[1] and "Key 'sglang' is not in struct" in found[1]
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
    assert "the config has a key GRPOConfig lacks" in note and "my_workflow_option" in note, note
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


def _refusal(launch, argv, capsys) -> list[str]:
    capsys.readouterr()
    with _keep_logging(), pytest.raises(SystemExit) as exit_:
        launch.main(argv)
    assert exit_.value.code == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith(("error: ", "  - "))]


@pytest.mark.parametrize("extra, want", [
    (["r3bridge.replay_mode=R2"],       # the guide's YAML returns SGLang's routes
     "  - rollout.return_routed_experts=true: R2 records the trainer's own routes, but rollout.return_routed_experts="
     "true asks SGLang for rollout routes, which would collide with them: set it to false (or use replay_mode=R3)"),
    (["r3bridge.replay_mode=R2", "rollout.return_routed_experts=false", "actor.recompute_logprob=false"],
     "  - actor.recompute_logprob=false, actor.use_decoupled_loss=false, actor.prox_logp_method=recompute: R2 records "
     "the trainer's own routes in compute_logp, which AReaL skips with these settings"),
])
def test_the_r2_conflicts_are_refused_at_areals_launcher_as_at_skyrls(launch, extra, want, capsys, monkeypatch):
    """R2 with returned routes, or without a log-prob recompute: refused before AReaL's launcher, a
    ConfigError in the words SkyRL's launcher uses (r3bridge.job_check.JobCheck), not found in the actor."""
    monkeypatch.delenv("R3BRIDGE_CONFIG", raising=False)
    monkeypatch.delenv("R3BRIDGE_REPLAY_MODE", raising=False)
    lines = _refusal(launch, LINE + extra, capsys)
    assert lines[0] == "error: ConfigError: r3bridge.replay_mode=R2 cannot run with this AReaL config:", lines
    assert any(line.startswith(want) for line in lines[1:]), lines


def test_bad_settings_and_parse_failures_are_refused_in_one_line_naming_what_and_where(launch, tmp_path, capsys,
                                                                                      monkeypatch):
    monkeypatch.delenv("R3BRIDGE_CONFIG", raising=False)
    monkeypatch.delenv("R3BRIDGE_REPLAY_MODE", raising=False)
    valid = "valid keys: replay_mode, agreement, min_coverage, "
    # a mistyped key, on the command line (as hydra's override or its +) and in the YAML: every valid key
    for extra in (["r3bridge.replay_mod=R3"], ["+r3bridge.replay_mod=R3"]):
        (line,) = _refusal(launch, LINE + extra, capsys)
        assert line.startswith("error: r3bridge.replay_mod is not an r3bridge option; " + valid), line
    text = (EXAMPLE / "gsm8k_megatron.yaml").read_text()
    (tmp_path / "typo.yaml").write_text(text.replace("  replay_mode: R3", "  replay_mod: R3"))
    (line,) = _refusal(launch, [LINE[0], "--config", str(tmp_path / "typo.yaml")], capsys)
    assert line.startswith("error: r3bridge.replay_mod is not an r3bridge option; " + valid), line
    # a valid key the YAML lacks: hydra's ++ named
    (line,) = _refusal(launch, LINE + ["r3bridge.trace_dir=/tmp/x"], capsys)
    assert "write ++r3bridge.trace_dir=..." in line, line
    # a parse failure that is not about keys GRPOConfig lacks: AReaL's parser's words, no GRPOConfig guess
    (tmp_path / "broken.yaml").write_text(text + "actor:\n  nonsense: [\n")
    (line,) = _refusal(launch, [LINE[0], "--config", str(tmp_path / "broken.yaml")], capsys)
    assert line.startswith("error: AReaL's parser cannot read this job config: ParserError: "), line
    assert "GRPOConfig" not in line
    # the environment's setting is named as such
    monkeypatch.setenv("R3BRIDGE_REPLAY_MODE", "R4")
    (line,) = _refusal(launch, LINE, capsys)
    assert line.startswith("error: ConfigError: environment (R3BRIDGE_REPLAY_MODE='R4'): replay_mode must be one of"), line


def test_the_launch_line_works_from_any_folder(launch, tmp_path, capsys, monkeypatch):
    """SCRIPT and --config relative to the current folder (as AReaL's own launcher reads them), handed on
    absolute; a path that is not there is refused naming the folder it was looked for in."""
    monkeypatch.delenv("R3BRIDGE_CONFIG", raising=False)
    monkeypatch.delenv("R3BRIDGE_REPLAY_MODE", raising=False)
    (tmp_path / "job").mkdir()
    for name in ("gsm8k_r3bridge.py", "gsm8k_megatron.yaml"):
        (tmp_path / "job" / name).write_text((EXAMPLE / name).read_text())
    monkeypatch.chdir(tmp_path)
    argv = ["job/gsm8k_r3bridge.py", "--config", "job/gsm8k_megatron.yaml", "r3bridge.replay_mode=R3"]
    assert launch.absolute_paths(argv) == [str(tmp_path / "job/gsm8k_r3bridge.py"), "--config",
                                           str(tmp_path / "job/gsm8k_megatron.yaml"), "r3bridge.replay_mode=R3"]
    lines = _refusal(launch, argv, capsys)            # parsed from here: only this machine's own refusals
    assert lines and all(line.startswith("error: AReaL's local launcher needs an accelerator") or
                         line.startswith("error: allocation_mode starts sglang servers") for line in lines), lines
    monkeypatch.chdir(tmp_path / "job")
    lines = _refusal(launch, argv, capsys)
    assert lines == [f"error: {p} does not exist (relative paths are taken from the current folder, {tmp_path / 'job'}; "
                     "the guide's example files are in r3bridge's checkout: $R3BRIDGE/examples/areal/)"
                     for p in argv[0:3:2]], lines

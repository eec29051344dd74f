"""Validation of the ``r3bridge`` section against verl 0.9.1's real composed Megatron config."""
from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace

import pytest
import verl  # noqa: E402,F401  (installed by `make install`: never skipped)
from omegaconf import OmegaConf, open_dict  # noqa: E402

from r3bridge.adapters.verl import config as vc  # noqa: E402
from r3bridge.adapters.verl.main_ppo import section_overrides  # noqa: E402
from r3bridge.config import ENV_CONFIG, ENV_FROM, ENV_MODE, ReplayConfig, ReplayMode  # noqa: E402
from r3bridge.errors import ConfigError  # noqa: E402

MOE_HF = {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
          "mlp_only_layers": []}
DENSE_HF = {"num_hidden_layers": 4, "intermediate_size": 64}


@pytest.fixture(scope="module")
def base_cfg():
    import verl.trainer.main_ppo as m
    from hydra import compose, initialize_config_dir

    d = os.path.join(os.path.dirname(m.__file__), "config")
    with initialize_config_dir(config_dir=d, version_base=None):
        return compose(config_name="ppo_megatron_trainer")


def job(base, mode, **overrides):
    """verl's default Megatron config + an r3bridge section + dotted overrides."""
    cfg = copy.deepcopy(base)
    with open_dict(cfg):
        cfg.r3bridge = {"replay_mode": mode}
        if mode == "R3":
            cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay = True
        for k, v in overrides.items():
            OmegaConf.update(cfg, k, v, force_add=True)
    return cfg


def test_defaults_are_valid_for_r2_and_r3(base_cfg):
    assert vc.validate_verl_config(job(base_cfg, "R3"), hf_config=MOE_HF).replay_mode is ReplayMode.R3
    assert vc.validate_verl_config(job(base_cfg, "R2"), hf_config=MOE_HF).replay_mode is ReplayMode.R2
    assert vc.validate_verl_config(base_cfg).replay_mode is ReplayMode.OFF     # no section: off


@pytest.mark.parametrize("mode, overrides, needle", [
    ("R3", {"actor_rollout_ref.rollout.enable_rollout_routing_replay": False}, "enable_rollout_routing_replay=False"),
    ("R2", {"algorithm.rollout_correction.bypass_mode": True}, "bypass_mode=True"),
    ("R2", {"actor_rollout_ref.rollout.enable_rollout_routing_replay": True}, "would collide"),
    ("R3", {"actor_rollout_ref.actor.megatron.router_replay.mode": "R3"}, "two replays at once"),
    ("R2", {"actor_rollout_ref.actor.megatron.router_replay.mode": "R2"}, "two replays at once"),
    ("R3", {"actor_rollout_ref.ref.megatron.router_replay.mode": "R3"}, "reference model never replays"),
    ("R3", {"actor_rollout_ref.model.use_remove_padding": False}, "use_remove_padding=False"),
    ("R2", {"actor_rollout_ref.actor.megatron.pad_to_length": True}, "pad_to_length=True"),
    ("R3", {"actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_fusion": True},
     "fused router"),
    ("R3", {"actor_rollout_ref.actor.megatron.dynamic_context_parallel": True}, "dynamic CP"),
    ("R3", {"actor_rollout_ref.actor.strategy": "fsdp"}, "Megatron only"),
])
def test_each_config_error(base_cfg, mode, overrides, needle):
    with pytest.raises(ConfigError, match=needle) as ei:
        vc.validate_verl_config(job(base_cfg, mode, **overrides), hf_config=MOE_HF)
    assert f"replay_mode={mode}" in str(ei.value)


def test_dense_model_is_refused(base_cfg):
    with pytest.raises(ConfigError, match="not MoE"):
        vc.validate_verl_config(job(base_cfg, "R3"), hf_config=DENSE_HF)


def test_every_problem_is_listed_at_once(base_cfg):
    cfg = job(base_cfg, "R2", **{"algorithm.rollout_correction.bypass_mode": True,
                                 "actor_rollout_ref.model.use_remove_padding": False})
    with pytest.raises(ConfigError) as ei:
        vc.validate_verl_config(cfg, hf_config=DENSE_HF)
    msg = str(ei.value)
    assert "bypass_mode" in msg and "use_remove_padding" in msg and "not MoE" in msg


def test_off_never_complains(base_cfg):
    cfg = job(base_cfg, "off", **{"actor_rollout_ref.model.use_remove_padding": False})
    assert vc.validate_verl_config(cfg, hf_config=DENSE_HF).replay_mode is ReplayMode.OFF


def test_bad_section(base_cfg):
    with pytest.raises(ConfigError, match="replay_mode must be one of"):
        vc.validate_verl_config(job(base_cfg, "R4"))
    with pytest.raises(ConfigError, match="unknown r3bridge option"):
        vc.validate_verl_config(job(base_cfg, "R3", **{"r3bridge.replay_modes": "R3"}))


def test_prepare_forwards_section_to_workers(base_cfg, monkeypatch):
    for var in (ENV_CONFIG, ENV_FROM):      # recorded, so prepare()'s os.environ writes are undone
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    cfg = job(base_cfg, "R3", **{"r3bridge.min_coverage": 0.5})
    got = vc.prepare_verl_config(cfg, hf_config=MOE_HF)
    assert got == ReplayConfig(replay_mode="R3", min_coverage=0.5)
    payload = cfg.ray_kwargs.ray_init.runtime_env.env_vars[ENV_CONFIG]
    assert json.loads(payload) == got.as_dict() and os.environ[ENV_CONFIG] == payload
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars[ENV_FROM] == os.environ[ENV_FROM] == "verl launcher"
    assert cfg.ray_kwargs.ray_init.runtime_env.py_executable is None          # verl's own keys kept
    assert cfg.actor_rollout_ref.model.external_lib == "r3bridge.adapters.verl"
    assert cfg.r3bridge.agreement is True                                      # defaults filled in
    assert ReplayConfig.from_env() == got                                      # what a worker reads


def test_prepare_merges_the_users_environment_or_refuses_a_clash(base_cfg, monkeypatch, tmp_path):
    """The documented trace recipe (R3BRIDGE_CONFIG in the environment) next to the guide's
    ``r3bridge.replay_mode=R3``: merged, announced, forwarded; the same key set twice differently
    is refused naming both places (issue 39: it was dropped silently)."""
    for var in (ENV_CONFIG, ENV_FROM):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setenv(ENV_CONFIG, json.dumps({"trace_dir": str(tmp_path / "routes"), "trace_every": 2}))
    cfg = job(base_cfg, "R3")
    got = vc.prepare_verl_config(cfg, hf_config=MOE_HF)
    assert (got.replay_mode, got.trace_dir, got.trace_every) == (ReplayMode.R3, str(tmp_path / "routes"), 2)
    assert json.loads(cfg.ray_kwargs.ray_init.runtime_env.env_vars[ENV_CONFIG]) == got.as_dict()
    # the forwarded section is not merged a second time in this process
    assert vc.prepare_verl_config(job(base_cfg, "R2", **{"actor_rollout_ref.rollout.enable_rollout_routing_replay":
                                                         False}), hf_config=MOE_HF).trace_dir is None
    monkeypatch.delenv(ENV_FROM)
    monkeypatch.setenv(ENV_CONFIG, '{"replay_mode": "R2"}')
    with pytest.raises(ConfigError, match=r"replay_mode='R3' in the job's r3bridge section .* and "
                                          r"replay_mode='R2' in R3BRIDGE_CONFIG"):
        vc.prepare_verl_config(job(base_cfg, "R3"), hf_config=MOE_HF)


def test_a_job_that_would_wait_forever_for_ray_cpu_slots_is_refused(base_cfg, monkeypatch):
    """What verl 0.9.1 holds for the whole job, counted as it will request it: TransferQueue's
    controller + 8 storage actors (one slot each) and one {CPU: 3, GPU: 1} bundle per GPU of the
    global pool (8 GPUs: 24), so 33. A local cluster with fewer (the machine's cores, or
    ``ray_init.num_cpus``) would wait forever: refused before Ray starts, with the numbers."""
    from r3bridge.adapters.verl.placement import check_local_ray_slots, held_cpu_slots

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert sum(n for _, n in held_cpu_slots(job(base_cfg, "R3"))) == 33
    with pytest.raises(ConfigError, match=r"verl would hold 33 Ray CPU slots .*9 for TransferQueue.*num_data_storage_"
                                          r"units=8.*; 24 for the global pool .*n_gpus_per_node=8 x trainer.nnodes=1.*"
                                          r"gets 16 from this machine's 16 cores .*ray_kwargs.ray_init.num_cpus=33"):
        check_local_ray_slots(job(base_cfg, "R3"), cpus=16)
    check_local_ray_slots(job(base_cfg, "R3"), cpus=64)
    # issue 50: the CPU rehearsal's shape (1 GPU, 1 storage unit) with num_cpus=2 passed the old check
    # (TransferQueue's 2 slots) and hung on the worker group's bundle
    rehearsal = {"trainer.n_gpus_per_node": 1, "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1}
    with pytest.raises(ConfigError, match=r"verl would hold 5 Ray CPU slots .* gets 2 from ray_kwargs.ray_init.num_cpus"):
        check_local_ray_slots(job(base_cfg, "off", **rehearsal, **{"ray_kwargs.ray_init.num_cpus": 2}), cpus=64)
    check_local_ray_slots(job(base_cfg, "off", **rehearsal, **{"ray_kwargs.ray_init.num_cpus": 5}), cpus=2)
    # the reward model's own pool and the remote reward manager's compute workers hold slots too
    more = job(base_cfg, "off", **rehearsal, **{"reward.reward_model.enable_resource_pool": True,
                                               "reward.reward_model.n_gpus_per_node": 2, "reward.reward_model.nnodes": 1,
                                               "reward.reward_manager.name": "remote", "reward.num_workers": 2})
    assert dict((what.split(":")[0], n) for what, n in held_cpu_slots(more)) == {
        "TransferQueue": 2, "the global pool (actor, rollout, reference)": 3, "the reward model pool": 6,
        "the remote reward manager": 4}
    check_local_ray_slots(job(base_cfg, "R3", **{"ray_kwargs.ray_init.address": "auto"}), cpus=2)  # not ours


def test_prepare_keeps_the_users_external_lib(base_cfg, monkeypatch):
    # verl's HFModelConfig.external_lib takes a list; the adapter must still load with plugins off
    for var in (ENV_CONFIG, ENV_FROM):      # recorded, so prepare()'s os.environ writes are undone
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    cfg = job(base_cfg, "R2", **{"actor_rollout_ref.model.external_lib": "my_models",
                                 "actor_rollout_ref.rollout.enable_rollout_routing_replay": False})
    vc.prepare_verl_config(cfg, hf_config=MOE_HF)
    assert list(cfg.actor_rollout_ref.model.external_lib) == ["my_models", "r3bridge.adapters.verl"]
    vc.prepare_verl_config(cfg, hf_config=MOE_HF)                    # idempotent
    assert list(cfg.actor_rollout_ref.model.external_lib) == ["my_models", "r3bridge.adapters.verl"]


def test_env_parsing():
    assert ReplayConfig.from_env({}) == ReplayConfig()
    assert ReplayConfig.from_env({ENV_MODE: "r2"}).replay_mode is ReplayMode.R2
    assert ReplayConfig.from_env({ENV_CONFIG: '{"replay_mode": "R3", "agreement": false}'}) == \
        ReplayConfig(replay_mode="R3", agreement=False)
    with pytest.raises(ConfigError, match="not valid JSON"):
        ReplayConfig.from_env({ENV_CONFIG: "{R3"})
    with pytest.raises(ConfigError, match="disagree"):
        ReplayConfig.from_env({ENV_CONFIG: '{"replay_mode": "R3"}', ENV_MODE: "R2"})


def test_engine_side_checks_with_verl_dataclass(base_cfg):
    from verl.utils.config import omega_conf_to_dataclass

    r3 = ReplayConfig(replay_mode="R3")
    ok = omega_conf_to_dataclass(base_cfg.actor_rollout_ref.actor.megatron)
    vc.check_engine_config(r3, ok, hf_config=MOE_HF, tf_config=SimpleNamespace(moe_router_fusion=False),
                           cp_layout="zigzag")
    bad = copy.deepcopy(base_cfg.actor_rollout_ref.actor.megatron)
    bad.router_replay.mode = "R3"
    bad.use_remove_padding = False
    bad.pad_to_length = True
    bad = omega_conf_to_dataclass(bad)
    with pytest.raises(ConfigError) as ei:
        vc.check_engine_config(r3, bad, hf_config=DENSE_HF, tf_config=SimpleNamespace(moe_router_fusion=True),
                               cp_layout="contiguous")
    msg = str(ei.value)
    for needle in ("two replays", "use_remove_padding", "pad_to_length", "fused router", "contiguous", "not MoE"):
        assert needle in msg
    vc.check_engine_config(ReplayConfig(), bad, hf_config=DENSE_HF)          # off: nothing to check


def test_launcher_passes_r3bridge_overrides_with_double_plus():
    assert section_overrides(["r3bridge.replay_mode=R3", "+r3bridge.agreement=false", "++r3bridge.min_coverage=0.5",
                              "trainer.n=1", "+trainer.x=1"]) == \
        ["++r3bridge.replay_mode=R3", "++r3bridge.agreement=false", "++r3bridge.min_coverage=0.5",
         "trainer.n=1", "+trainer.x=1"]


@pytest.mark.parametrize("existing", [[], ["+r3bridge={replay_mode: 'off', min_coverage: 0.1}"]],
                         ids=["no-section", "section-already-composed"])
def test_rewritten_overrides_compose_with_hydra_with_or_without_a_section(existing):
    """Hydra's own composition of verl's config: ``++`` adds the section or overrides the one there
    (a single ``+`` fails on an existing key, which the old launcher produced)."""
    import verl.trainer.main_ppo as m
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    d = os.path.join(os.path.dirname(m.__file__), "config")
    with initialize_config_dir(config_dir=d, version_base=None):
        cfg = compose(config_name="ppo_megatron_trainer",
                      overrides=existing + section_overrides(["r3bridge.replay_mode=R3", "r3bridge.min_coverage=0.5"]))
        assert vc.resolve_verl_options(cfg)[0] == ReplayConfig(replay_mode="R3", min_coverage=0.5)
        if existing:
            with pytest.raises(ConfigCompositionException):
                compose(config_name="ppo_megatron_trainer", overrides=existing + ["+r3bridge.replay_mode=R3"])


@pytest.mark.parametrize("spelling", ["off", "disabled", False])
def test_every_off_spelling_is_off_in_a_verl_config(base_cfg, spelling):
    assert vc.validate_verl_config(job(base_cfg, spelling)).replay_mode is ReplayMode.OFF


def test_two_replay_switches_are_refused_naming_both_keys(base_cfg):
    with pytest.raises(ConfigError) as ei:
        vc.validate_verl_config(job(base_cfg, "R3", **{"actor_rollout_ref.actor.megatron.router_replay.mode": "R3"}),
                                hf_config=MOE_HF)
    msg = str(ei.value)
    assert "r3bridge.replay_mode=R3" in msg and "actor_rollout_ref.actor.megatron.router_replay.mode='R3'" in msg
    # verl's own replay alone (r3bridge off) is verl's business: nothing to refuse
    own = job(base_cfg, "off", **{"actor_rollout_ref.actor.megatron.router_replay.mode": "R3"})
    assert vc.validate_verl_config(own).replay_mode is ReplayMode.OFF


def test_a_ray_start_failure_is_explained_from_the_raylets_log(tmp_path, monkeypatch):
    """Ray says only "The current node timed out during startup"; the launcher adds the raylet's own
    FATAL line (Ray #65983: a loaded machine starts the dashboard agent too slowly)."""
    from r3bridge.adapters.verl.watch import ray_start_failure

    logs = tmp_path / "session_latest" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text(
        "[2026-11-27 09:43:24,532 I 24050 24050] (raylet) grpc_server.cc:144: NodeManager server started\n"
        "[2026-11-27 09:43:40,588 C 24050 24050] (raylet) node_manager.cc:3576:  An unexpected system state "
        "has occurred. Check failed: statussetor3576.has_value() Timed out waiting for file /tmp/x/metrics_agent_port\n")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    why = ray_start_failure(Exception("The current node timed out during startup. This could happen because ..."))
    assert "Timed out waiting for file /tmp/x/metrics_agent_port" in why and "Ray #65983" in why
    assert ray_start_failure(ValueError("something else")) is None


@pytest.mark.parametrize("engine, settings, needle", [
    ("sglang", {"actor_rollout_ref.rollout.disaggregation.enabled": True},
     r"SGLang: disaggregation_mode='actor_rollout_ref.rollout.disaggregation.enabled=True, transfer_backend=nixl'"),
    ("vllm", {"actor_rollout_ref.rollout.engine_kwargs.vllm.kv_transfer_config": {"kv_connector": "NixlConnector"}},
     r"vLLM: kv_transfer_config=\{'kv_connector': 'NixlConnector'\}"),
])
def test_r3_refuses_rollouts_served_through_kv_transfer(base_cfg, engine, settings, needle):
    """Prefill / decode disaggregation or a KV connector: the decode node never runs the prompt
    forward, so the prompt's route rows are whatever the capture buffer held (llm-d-router #1473).
    R3 is refused naming the setting; R2 replays the trainer's own routes and is not affected."""
    cfg = job(base_cfg, "R3", **{"actor_rollout_ref.rollout.name": engine}, **settings)
    with pytest.raises(ConfigError, match=needle):
        vc.validate_verl_config(cfg, hf_config=MOE_HF)
    r2 = job(base_cfg, "R2", **{"actor_rollout_ref.rollout.name": engine}, **settings)
    assert vc.validate_verl_config(r2, hf_config=MOE_HF).replay_mode is ReplayMode.R2


@pytest.mark.parametrize("engine, settings, version, needle", [
    # verl's MTP draft on vLLM: refused before vLLM 0.26.0 (vLLM #48622), naming both settings and the version
    ("vllm", {"actor_rollout_ref.model.mtp.enable": True, "actor_rollout_ref.model.mtp.enable_rollout": True},
     "0.25.1", r"mtp.enable=True, actor_rollout_ref.model.mtp.enable_rollout=True\) on vLLM 0.25.1 "
               r"\(r3bridge.engine_version\): before vLLM 0.26.0"),
    ("vllm", {"actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config": {"method": "eagle3"}}, "0.24.0",
     r"engine_kwargs.vllm.speculative_config=\{'method': 'eagle3'\}\) on vLLM 0.24.0"),
    ("sglang", {"actor_rollout_ref.rollout.engine_kwargs.sglang.speculative_algorithm": "EAGLE"}, "0.5.12",
     r"on SGLang 0.5.12 .*before SGLang 0.5.15 .*SGLang #26980"),
    # vLLM not installed here and no engine_version: said, never assumed fixed
    ("vllm", {"actor_rollout_ref.model.mtp.enable": True, "actor_rollout_ref.model.mtp.enable_rollout": True},
     None, r"vLLM is not installed in the trainer's environment and r3bridge.engine_version is not set"),
])
def test_r3_with_speculative_decoding_on_an_engine_without_the_fix_is_refused(base_cfg, engine, settings, version,
                                                                             needle):
    cfg = job(base_cfg, "R3", **{"actor_rollout_ref.rollout.name": engine}, **settings)
    with open_dict(cfg):
        cfg.r3bridge.engine_version = version
    with pytest.raises(ConfigError, match=needle):
        vc.validate_verl_config(cfg, hf_config=MOE_HF)
    cfg.r3bridge.engine_version = {"vllm": "0.26.0", "sglang": "0.5.15"}[engine]      # fixed releases pass
    assert vc.validate_verl_config(cfg, hf_config=MOE_HF).replay_mode is ReplayMode.R3
    r2 = job(base_cfg, "R2", **{"actor_rollout_ref.rollout.name": engine}, **settings)
    vc.validate_verl_config(r2, hf_config=MOE_HF)           # R2 replays the trainer's own routes: no engine routes


def test_routes_by_reference_get_one_run_id_and_a_store_verl_can_use(base_cfg, monkeypatch, tmp_path):
    """route_transport: handles: the launcher hands every worker one fresh run id (the rollout
    writes and the trainer reads under it) after removing what killed runs left in the store;
    Ray's object store is refused before Ray starts (verl's TransferQueue pickles outside Ray)."""
    import time

    from r3bridge.adapters.verl.route_handles import RUN_ENV, STALE_RUN_AGE_S

    for var in (ENV_CONFIG, ENV_FROM):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    store = tmp_path / "store"
    (store / "killedrun" / "3").mkdir(parents=True)
    (store / "killedrun" / "3" / "s.routes").write_bytes(b"x")
    (store / "liverun" / "1").mkdir(parents=True)
    (store / "liverun" / "1" / "s.routes").write_bytes(b"x")
    old = time.time() - STALE_RUN_AGE_S - 60
    os.utime(store / "killedrun" / "3" / "s.routes", (old, old))
    cfg = job(base_cfg, "R3", **{"r3bridge.route_transport": "handles", "r3bridge.route_store": str(store)})
    got = vc.prepare_verl_config(cfg, hf_config=MOE_HF)
    assert got.route_transport == "handles" and got.route_store == str(store)
    env = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    run = env[RUN_ENV]
    assert len(run) == 16 and sorted(os.listdir(store)) == ["liverun"]         # the killed run's folder removed
    vc.prepare_verl_config(job(base_cfg, "R3", **{"r3bridge.route_transport": "handles",
                                                   "r3bridge.route_store": str(store)}), hf_config=MOE_HF)
    inline = job(base_cfg, "R3")
    vc.prepare_verl_config(inline, hf_config=MOE_HF)
    assert RUN_ENV not in inline.ray_kwargs.ray_init.runtime_env.env_vars       # inline routes: no run id
    with pytest.raises(ConfigError, match="route_store=ray: verl's agent loops hand their outputs to verl's"):
        vc.validate_verl_config(job(base_cfg, "R3", **{"r3bridge.route_transport": "handles",
                                                        "r3bridge.route_store": "ray"}), hf_config=MOE_HF)
    with pytest.raises(ConfigError, match="route_store must be a folder path or 'ray'"):
        vc.validate_verl_config(job(base_cfg, "R3", **{"r3bridge.route_store": ""}), hf_config=MOE_HF)

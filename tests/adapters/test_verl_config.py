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
from r3bridge.adapters.verl.main_ppo import rewrite_overrides  # noqa: E402
from r3bridge.config import ReplayConfig, ReplayMode  # noqa: E402
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
    monkeypatch.setenv(vc.ENV_VAR, "")     # recorded, so prepare()'s os.environ write is undone
    monkeypatch.delenv(vc.ENV_VAR)
    cfg = job(base_cfg, "R3", **{"r3bridge.min_coverage": 0.5})
    got = vc.prepare_verl_config(cfg, hf_config=MOE_HF)
    assert got == ReplayConfig(replay_mode="R3", min_coverage=0.5)
    payload = cfg.ray_kwargs.ray_init.runtime_env.env_vars[vc.ENV_VAR]
    assert json.loads(payload) == got.as_dict() and os.environ[vc.ENV_VAR] == payload
    assert cfg.ray_kwargs.ray_init.runtime_env.py_executable is None          # verl's own keys kept
    assert cfg.actor_rollout_ref.model.external_lib == "r3bridge.adapters.verl"
    assert cfg.r3bridge.agreement is True                                      # defaults filled in
    assert vc.replay_config_from_env() == got                                  # what a worker reads


def test_prepare_keeps_the_users_external_lib(base_cfg, monkeypatch):
    # verl's HFModelConfig.external_lib takes a list; the adapter must still load with plugins off
    monkeypatch.setenv(vc.ENV_VAR, "")     # recorded, so prepare()'s os.environ write is undone
    monkeypatch.delenv(vc.ENV_VAR)
    cfg = job(base_cfg, "R2", **{"actor_rollout_ref.model.external_lib": "my_models",
                                 "actor_rollout_ref.rollout.enable_rollout_routing_replay": False})
    vc.prepare_verl_config(cfg, hf_config=MOE_HF)
    assert list(cfg.actor_rollout_ref.model.external_lib) == ["my_models", "r3bridge.adapters.verl"]
    vc.prepare_verl_config(cfg, hf_config=MOE_HF)                    # idempotent
    assert list(cfg.actor_rollout_ref.model.external_lib) == ["my_models", "r3bridge.adapters.verl"]


def test_env_parsing():
    assert vc.replay_config_from_env({}) == ReplayConfig()
    assert vc.replay_config_from_env({vc.ENV_MODE: "r2"}).replay_mode is ReplayMode.R2
    assert vc.replay_config_from_env({vc.ENV_VAR: '{"replay_mode": "R3", "agreement": false}'}) == \
        ReplayConfig(replay_mode="R3", agreement=False)
    with pytest.raises(ConfigError, match="not valid JSON"):
        vc.replay_config_from_env({vc.ENV_VAR: "{R3"})
    with pytest.raises(ConfigError, match="disagree"):
        vc.replay_config_from_env({vc.ENV_VAR: '{"replay_mode": "R3"}', vc.ENV_MODE: "R2"})


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
    assert rewrite_overrides(["r3bridge.replay_mode=R3", "+r3bridge.agreement=false", "++r3bridge.min_coverage=0.5",
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
                      overrides=existing + rewrite_overrides(["r3bridge.replay_mode=R3", "r3bridge.min_coverage=0.5"]))
        assert vc.replay_config_from_verl(cfg) == ReplayConfig(replay_mode="R3", min_coverage=0.5)
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

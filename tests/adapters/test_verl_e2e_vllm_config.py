"""verl's whole job with verl's own vLLM rollout (``R3E2E_ROLLOUT=vllm``; SGLang's likewise,
``R3E2E_ROLLOUT=sglang``), checked on CPU up to the engine itself: the command line composes into verl 0.9.1's config, passes r3bridge's whole-job
validation, and gives verl's ``RolloutConfig`` the engine settings the GPU run needs; the job's
environment puts the vLLM wheel set first. The run itself is ``scripts/gpu/verl_e2e.sh`` on the
device (docs/gpu.md, "Real vLLM on the device"); the recording and checking code it uses runs in
the HF-backend job of ``tests/adapters/test_verl_e2e.py``.
"""
from __future__ import annotations

import os

import pytest

from testlab import verl_e2e as E


def _compose(cmd: list[str]):
    import verl.trainer.main_ppo as verl_main
    from hydra import compose, initialize_config_dir

    from r3bridge.adapters.verl.main_ppo import section_overrides

    assert cmd[1:3] == ["-m", "r3bridge.adapters.verl.main_ppo"] and cmd[3].startswith("--config-name=")
    from hydra.core.global_hydra import GlobalHydra

    config_dir = os.path.join(os.path.dirname(verl_main.__file__), "config")
    GlobalHydra.instance().clear()      # a test before it in this worker may have left hydra initialised
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name=cmd[3].split("=", 1)[1], overrides=section_overrides(cmd[4:]))


def test_vllm_job_composes_into_verls_rollout_config(monkeypatch, tmp_path):
    from verl.utils.config import omega_conf_to_dataclass

    from r3bridge.adapters.verl.config import prepare_verl_config

    monkeypatch.setenv("R3E2E_ROLLOUT", "vllm")
    monkeypatch.setenv("R3E2E_PREFIX_CACHE", "0")
    for var in ("R3BRIDGE_CONFIG", "R3BRIDGE_CONFIG_FROM"):     # recorded: prepare()'s os.environ writes are undone
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    paths = {k: str(tmp_path / k) for k in ("root", "model", "train", "reward", "agent", "tools", "logs",
                                           "agent_calls", "metrics", "lab")}
    cfg = _compose(E.job_command(paths, "R3"))
    prepare_verl_config(cfg, announce_where="test")
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert rollout.name == "vllm" and rollout.mode == "async"
    assert rollout.enable_rollout_routing_replay is True
    assert rollout.enable_prefix_caching is False
    monkeypatch.setenv("R3E2E_PREFIX_CACHE", "1")
    assert "actor_rollout_ref.rollout.enable_prefix_caching=True" in E.rollout_overrides("R3")
    assert E.run_tag("R3", "first") == "vllm_R3_first_pc1"
    monkeypatch.setenv("R3E2E_PREFIX_CACHE", "0")
    assert rollout.enable_chunked_prefill is True and rollout.max_num_batched_tokens == 32
    assert rollout.max_num_batched_tokens >= rollout.max_num_seqs      # vLLM's SchedulerConfig rule
    assert rollout.free_cache_engine is True and rollout.enable_sleep_mode is True    # verl's colocated defaults
    assert rollout.load_format == "dummy" and rollout.enforce_eager is False
    assert 0 < rollout.gpu_memory_utilization <= 0.3
    assert cfg.r3bridge.replay_mode == "R3"
    env = E.job_env(paths, gpu=True)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == E.VLLM_SITE and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert env["R3E2E_AGENT_LOG_DIR"] == paths["agent_calls"]
    assert E.run_tag("R3", "first") == "vllm_R3_first_pc0"


def test_hf_job_keeps_its_backend(monkeypatch, tmp_path):
    monkeypatch.delenv("R3E2E_ROLLOUT", raising=False)
    # job_env starts from this process's environment: another test's vLLM import may have set it
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    paths = {k: str(tmp_path / k) for k in ("root", "model", "train", "reward", "agent", "tools", "logs",
                                           "agent_calls", "metrics", "lab")}
    cmd = E.job_command(paths, "R2")
    assert "actor_rollout_ref.rollout.name=hf_r3" in cmd and not any("gpu_memory_utilization" in a for a in cmd)
    assert E.job_env(paths).get("VLLM_USE_FLASHINFER_SAMPLER") is None and E.run_tag("R2", "first") == "R2_first"
    monkeypatch.setenv("R3E2E_ROLLOUT", "trtllm")
    with pytest.raises(ValueError, match="one of hf, vllm, sglang"):
        E.rollout_backend()


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_sglang_job_composes_into_verls_rollout_config(monkeypatch, tmp_path, mode):
    """``R3E2E_ROLLOUT=sglang``: verl's own rollout name ``sglang``, SGLang's settings through verl's
    ``engine_kwargs.sglang`` as the direct SGLang 0.5.12 run needed them, the one route path r3bridge
    reads (``skip_tokenizer_init``), the SGLang wheel set first for every process of the job."""
    from verl.utils.config import omega_conf_to_dataclass

    from r3bridge.adapters.verl.config import prepare_verl_config
    from r3bridge.adapters.verl.sglang_routes import check_sglang_rollout

    monkeypatch.setenv("R3E2E_ROLLOUT", "sglang")
    monkeypatch.setenv("R3E2E_PREFIX_CACHE", "1")
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    for var in ("R3BRIDGE_CONFIG", "R3BRIDGE_CONFIG_FROM"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    paths = {k: str(tmp_path / k) for k in ("root", "model", "train", "reward", "agent", "tools", "logs",
                                           "agent_calls", "metrics", "lab")}
    cfg = _compose(E.job_command(paths, mode))
    prepare_verl_config(cfg, announce_where="test")
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert rollout.name == "sglang" and rollout.mode == "async"
    assert rollout.enable_rollout_routing_replay is (mode == "R3")
    assert rollout.skip_tokenizer_init is True
    check_sglang_rollout(rollout)
    # verl's SGLangHttpServer.launch_server reads these (async_sglang_server.py:276-340): engine_kwargs.sglang
    # goes to SGLang's ServerArgs as it is, gpu_memory_utilization is mem_fraction_static, enforce_eager
    # disable_cuda_graph, max_num_seqs max_running_requests
    assert dict(rollout.engine_kwargs["sglang"]) == {"attention_backend": "triton", "sampling_backend": "pytorch",
                                                     "chunked_prefill_size": 32, "disable_radix_cache": False}
    assert 0 < rollout.gpu_memory_utilization <= 0.3 and rollout.enforce_eager is True
    assert rollout.max_num_seqs == 16 and rollout.load_format == "dummy" and rollout.free_cache_engine is True
    assert cfg.r3bridge.replay_mode == mode
    env = E.job_env(paths, gpu=True)
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [E.SGLANG_VERL_SITE, E.SGLANG_SITE]
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in env
    assert E.run_tag(mode, "first") == f"sglang_{mode}_first_rc1"
    monkeypatch.setenv("R3E2E_PREFIX_CACHE", "0")
    assert "++actor_rollout_ref.rollout.engine_kwargs.sglang.disable_radix_cache=True" in E.rollout_overrides(mode)
    assert E.run_tag(mode, "last") == f"sglang_{mode}_last_rc0"

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


def _job_paths(monkeypatch, tmp_path, rollout: str, prefix_cache: str) -> dict[str, str]:
    """The rollout settings verl_e2e.sh reads, and the job's folders."""
    monkeypatch.setenv("R3E2E_ROLLOUT", rollout)
    monkeypatch.setenv("R3E2E_PREFIX_CACHE", prefix_cache)
    for var in ("R3BRIDGE_CONFIG", "R3BRIDGE_CONFIG_FROM"):     # recorded: prepare()'s os.environ writes are undone
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    return {k: str(tmp_path / k) for k in ("root", "model", "train", "reward", "agent", "tools", "logs",
                                          "agent_calls", "metrics", "lab")}


def test_vllm_job_composes_into_verls_rollout_config(monkeypatch, tmp_path):
    from verl.utils.config import omega_conf_to_dataclass

    from r3bridge.adapters.verl.config import prepare_verl_config

    paths = _job_paths(monkeypatch, tmp_path, "vllm", "0")
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

    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    paths = _job_paths(monkeypatch, tmp_path, "sglang", "1")
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


def _fake_vllm_site(path, version: str) -> str:
    """A folder holding what ``pip install --target`` leaves for the ``vllm`` distribution's metadata
    (its ``dist-info``), so the job's version check reads a real installed-package record."""
    info = path / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return str(path)


def test_vllm026_is_chosen_by_release(monkeypatch, tmp_path):
    """``R3E2E_VLLM_RELEASE=0.26.0``: the same verl job (verl's ``rollout.name=vllm``, R3's routes on),
    the vllm026 set's site first, the output tag ``vllm026_...``, and a model with heads of 64
    (0.26.0's first forward never returned with the default 8); heads narrower than 64 and unknown
    releases are refused before anything runs; 0.24.0 stays the default, unchanged."""
    from verl.utils.config import omega_conf_to_dataclass

    from r3bridge.adapters.verl.config import prepare_verl_config
    from testlab.mbridge_spec import DEFAULT_HEAD_DIM

    monkeypatch.delenv("R3E2E_HEAD_DIM", raising=False)
    monkeypatch.delenv("R3E2E_VLLM_SITE", raising=False)
    monkeypatch.delenv("R3E2E_VLLM_RELEASE", raising=False)
    paths = _job_paths(monkeypatch, tmp_path, "vllm", "1")
    # the default: 0.24.0 as before (its set, its tag, the model's own heads)
    assert E.vllm_release().version == "0.24.0" and E.model_head_dim() is None
    assert E.run_tag("R3", "first") == "vllm_R3_first_pc1"
    assert E.job_env(paths, gpu=True)["PYTHONPATH"].split(os.pathsep)[0] == E.VLLM_SITE

    monkeypatch.setenv("R3E2E_VLLM_RELEASE", "0.26.0")
    cfg = _compose(E.job_command(paths, "R3"))
    prepare_verl_config(cfg, announce_where="test")
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert rollout.name == "vllm" and rollout.enable_rollout_routing_replay is True and rollout.load_format == "dummy"
    assert E.run_tag("R3", "first") == "vllm026_R3_first_pc1"
    env = E.job_env(paths, gpu=True)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == "/tmp/site-vllm026" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setenv("R3E2E_VLLM_SITE", str(tmp_path / "elsewhere"))     # an explicit site still wins
    assert E.job_env(paths, gpu=True)["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "elsewhere")
    E.write_model(paths["model"])
    import json
    with open(os.path.join(paths["model"], "config.json")) as f:
        assert json.load(f)["head_dim"] == 64 != DEFAULT_HEAD_DIM

    monkeypatch.setenv("R3E2E_HEAD_DIM", "8")
    with pytest.raises(ValueError, match=r"R3E2E_HEAD_DIM=8 with vLLM 0\.26\.0: its first forward never returns"):
        E.run_tag("R3", "first")
    monkeypatch.setenv("R3E2E_HEAD_DIM", "128")
    assert E.model_head_dim() == 128 and E.vllm_release().version == "0.26.0"
    monkeypatch.setenv("R3E2E_VLLM_RELEASE", "0.25.1")
    with pytest.raises(ValueError, match=r"R3E2E_VLLM_RELEASE='0\.25\.1': one of 0\.24\.0, 0\.26\.0"):
        E.job_env(paths, gpu=True)


def test_installed_vllm_is_the_release_asked_for(monkeypatch, tmp_path):
    """The job's processes must import the release asked for: the ``vllm`` distribution first on
    their path is read in a child process and compared (the wrong set, or none, is named)."""
    monkeypatch.setenv("R3E2E_ROLLOUT", "vllm")
    monkeypatch.setenv("R3E2E_VLLM_RELEASE", "0.26.0")
    monkeypatch.delenv("R3E2E_HEAD_DIM", raising=False)
    paths = {k: str(tmp_path / k) for k in ("root", "model", "train", "reward", "agent", "tools", "logs",
                                           "agent_calls", "metrics", "lab")}
    monkeypatch.setenv("R3E2E_VLLM_SITE", _fake_vllm_site(tmp_path / "v26", "0.26.0"))
    assert E.installed_vllm_problem(E.job_env(paths, gpu=True)) is None
    monkeypatch.setenv("R3E2E_VLLM_SITE", _fake_vllm_site(tmp_path / "v24", "0.24.0"))
    problem = E.installed_vllm_problem(E.job_env(paths, gpu=True))
    assert "would import vLLM 0.24.0" in problem and str(tmp_path / "v24") in problem and "set vllm026" in problem
    monkeypatch.setenv("R3E2E_VLLM_SITE", str(tmp_path / "empty"))     # nothing installed there (nor here)
    assert "would import vLLM none" in E.installed_vllm_problem(E.job_env(paths, gpu=True))
    monkeypatch.setenv("R3E2E_ROLLOUT", "hf")
    assert E.installed_vllm_problem(E.job_env(paths, gpu=True)) is None


def test_verl_e2e_sh_dry_run_on_vllm026(tmp_path):
    """``scripts/gpu/verl_e2e.sh run`` as the device runs it, with ``R3E2E_DRY_RUN=1``: the job is
    written (model with heads of 64 and its weights), the command and environment composed, the
    installed-release check made; nothing started. The wrong release first on the path ends the
    call with rc 3 and the reason, before any job."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("R3E2E_", "R3BRIDGE_"))}
    base.update(PATH=os.path.dirname(sys.executable) + os.pathsep + base.get("PATH", ""), OMP_NUM_THREADS="1",
                R3E2E_ROLLOUT="vllm", R3E2E_VLLM_RELEASE="0.26.0", R3E2E_DRY_RUN="1",
                R3E2E_WORK=str(tmp_path / "work"), OUT=str(tmp_path / "out"))

    def run(mode: str, site: str) -> tuple[int, dict]:
        got = subprocess.run(["bash", os.path.join(root, "scripts", "gpu", "verl_e2e.sh"), "run", mode],
                             env={**base, "R3E2E_VLLM_SITE": site}, capture_output=True, text=True, timeout=300)
        lines = [ln for ln in got.stdout.splitlines() if ln.startswith("{")]
        assert lines, got.stdout[-2000:] + got.stderr[-2000:]
        return got.returncode, json.loads(lines[-1])

    rc, out = run("R3", _fake_vllm_site(tmp_path / "v26", "0.26.0"))
    assert rc == 0 and out["error"] is None and out["tag"] == "vllm026_R3_first_pc1"
    assert out["vllm_release"] == "0.26.0" and out["head_dim"] == 64
    assert out["pythonpath"][0] == str(tmp_path / "v26")
    assert "actor_rollout_ref.rollout.name=vllm" in out["command"]
    assert "actor_rollout_ref.rollout.enable_rollout_routing_replay=True" in out["command"]
    assert os.path.exists(tmp_path / "work" / "verl_e2e_vllm026_R3_first_pc1" / "model" / "model.safetensors")
    rc, out = run("R2", _fake_vllm_site(tmp_path / "v24", "0.24.0"))
    assert rc == 3 and out["tag"] == "vllm026_R2_first_pc1" and "would import vLLM 0.24.0" in out["error"]


def test_stacks_after_dumps_every_job_process(monkeypatch, tmp_path):
    """``R3E2E_STACKS_AFTER=S``: the job's environment makes each Python process write its threads'
    stacks to the job's ``stacks`` folder every S seconds and run on (a hung device job then shows
    where it stood); unset, the environment is as before; a value that is not a positive number is
    refused."""
    import subprocess
    import sys

    monkeypatch.setenv("R3E2E_ROLLOUT", "vllm")
    monkeypatch.setenv("R3E2E_VLLM_RELEASE", "0.26.0")
    monkeypatch.delenv("R3E2E_HEAD_DIM", raising=False)
    monkeypatch.delenv("R3E2E_VLLM_SITE", raising=False)
    monkeypatch.delenv("R3E2E_STACKS_AFTER", raising=False)
    paths = {k: str(tmp_path / k) for k in ("root", "model", "train", "reward", "agent", "tools", "logs",
                                           "agent_calls", "metrics", "lab")}
    plain = E.job_env(paths, gpu=True)
    assert E.STACKS_FOLDER not in plain["PYTHONPATH"] and "R3E2E_STACKS_DIR" not in plain
    monkeypatch.setenv("R3E2E_STACKS_AFTER", "1")
    env = E.job_env(paths, gpu=True)
    path = env["PYTHONPATH"].split(os.pathsep)
    assert path[0] == "/tmp/site-vllm026" and path[-1] == E.STACKS_FOLDER
    # one process that waits past S (dumps, then finishes its work: rc 0) and one that ends first (no dump)
    waits = ("import time\ndef waiting_for_the_engine():\n    time.sleep(3.5)\nwaiting_for_the_engine()\n"
             "print('still running')")
    got = subprocess.run([sys.executable, "-c", waits], env=env, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and "still running" in got.stdout, got.stderr
    assert subprocess.run([sys.executable, "-c", "pass"], env=env, timeout=60).returncode == 0
    dumps = E.stack_dumps(os.path.join(paths["root"], "stacks"))
    assert len(dumps) == 1 and len(os.listdir(os.path.join(paths["root"], "stacks"))) == 2
    (text,) = dumps.values()
    assert text.count('File "<string>", line 3 in waiting_for_the_engine') >= 2, text     # at 1, 2, 3 s
    for bad in ("0", "soon"):
        monkeypatch.setenv("R3E2E_STACKS_AFTER", bad)
        with pytest.raises(ValueError, match="R3E2E_STACKS_AFTER"):
            E.job_env(paths, gpu=True)


def test_each_vllm_release_names_the_wheel_set_that_carries_it():
    """Each release's site is where ``scripts/gpu/bundle.sh install`` puts a wheel set
    (``/tmp/site-SET``), and that set's list pins exactly that vLLM release."""
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for version, release in E.VLLM_RELEASES.items():
        assert release.version == version and os.path.dirname(release.site) == "/tmp"
        name = os.path.basename(release.site).removeprefix("site-")
        with open(os.path.join(root, "scripts", "gpu", "wheels", f"{name}.txt")) as f:
            pins = re.findall(r"^vllm==(\S+)", f.read(), flags=re.M)
        assert pins == [version], (name, pins)

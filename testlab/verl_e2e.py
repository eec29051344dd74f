"""verl 0.9.1's whole job on CPU: ``python -m r3bridge.adapters.verl.main_ppo`` with Ray, verl's
agent loop, the HF rollout backend, reward, compute_log_prob, reference, GRPO update (tests only).

:func:`write_job` writes everything the job reads into one directory (a tiny first-k-dense
Qwen3-MoE's ``config.json`` and a word-level Qwen-style tokenizer, train / val parquet made here,
the reward function, the agent loop and tool configs); :func:`job_command` is the user's command
line (verl's overrides plus ``r3bridge.replay_mode``) and :func:`job_env` the environment (verl's
own extension hooks: ``VERL_USE_EXTERNAL_MODULES`` / ``VERL_PLATFORM`` for the gloo platform,
``external_lib`` for the shims and the backend). After the run, :func:`read_run` collects the
rollout server's calls, the router calls of the actor and reference models, and verl's logged
metrics; :func:`check_dispatch` compares them per (sample, token, layer) through
:mod:`testlab.dispatch_records`.

The rollout backend is chosen by ``R3E2E_ROLLOUT`` (:func:`rollout_backend`): ``hf`` (default,
:mod:`testlab.verl_hf_rollout`, which logs its own calls), ``vllm`` or ``sglang`` (verl's own
vLLM / SGLang server, agent loop and weight sync; :func:`rollout_overrides`, :func:`rollout_env`;
vLLM's release by ``R3E2E_VLLM_RELEASE``, :func:`vllm_release`;
SGLang's routes read by r3bridge's :mod:`r3bridge.adapters.verl.sglang_routes` inside verl's
server), whose returned routes are logged by the agent loops
(:class:`testlab.verl_e2e_agent.CallRecorder`) and checked the same way.

Samples are told apart by their tokens: each rollout call is logged with its prompt and output,
a trajectory's calls are the ones whose tokens it continues, and a packed trainer sequence is the
trajectory whose tokens it holds. A sample id is the index of its trajectory in the run's sorted
list of trajectories (the same on both sides), the per-step "uid" the records are keyed by.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from testlab.verl_e2e_parallel import Parallel, apply_overrides, by_process, rank_rows, resolve_lengths

# the first layer dense (mlp_only_layers); R3E2E_DENSE=none: every layer MoE (the GPU recipe: mbridge
# 0.15.1 cannot build dense-first Qwen3-MoE layers with its own TE spec)
NUM_LAYERS, NUM_EXPERTS, TOPK = 4, 32, 4
DENSE: tuple[int, ...] = () if os.environ.get("R3E2E_DENSE") == "none" else (0,)
MOE_LAYERS = [i for i in range(NUM_LAYERS) if i not in DENSE]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<tool_response>", "</tool_response>"]
WORDS = ["\n", "system", "user", "assistant", "tool"]
VOCAB = 64
PROMPT_LEN, RESPONSE_LEN = 24, 40
PROMPTS, BATCH, N = 8, 4, 2        # 8 prompts, 4 per step, 2 samples per prompt (GRPO), 2 steps
MULTI_TURN = (1, 2, 5, 6)         # prompts whose samples use the tool agent loop (2 per step)

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_tokenizer(path: str) -> Any:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL + WORDS + [f"w{i}" for i in range(VOCAB - len(SPECIAL) - len(WORDS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    # "\n" is one token of its own (verl's Qwen continuous-token builder requires it)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("[ \t]+"), behavior="removed"),
                                                 pre_tokenizers.Split(Regex("\n"), behavior="isolated")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<unk>", additional_special_tokens=SPECIAL[1:2] + SPECIAL[4:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def write_model(path: str, *, save_weights: bool = False) -> None:
    """``config.json`` + tokenizer; ``save_weights``: also the HF weights the rollout engine uses
    (for a trainer whose bridge loads a checkpoint: the GPU recipe; the CPU harness bridge seeds
    its own weights)."""
    from testlab.mbridge_spec import tiny_qwen3_moe

    os.makedirs(path, exist_ok=True)
    tok = write_tokenizer(path)
    cfg = tiny_qwen3_moe(num_layers=NUM_LAYERS, dense=DENSE, num_experts=NUM_EXPERTS, topk=TOPK, vocab=VOCAB,
                         max_positions=256, head_dim=model_head_dim())
    cfg.pad_token_id = tok.pad_token_id
    cfg.eos_token_id = tok.eos_token_id
    cfg.bos_token_id = None
    cfg.save_pretrained(path)
    if save_weights:
        from r3bridge.demo.hf_engine import build_hf_model

        build_hf_model(cfg, seed=1234).save_pretrained(path)


REWARD_PY = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    words = solution_str.split()
    return float(sum(w == ground_truth for w in words)) / max(1, len(words))
'''


def write_data(path: str, multi_turn: bool) -> None:
    import pandas as pd

    from testlab.verl_e2e_agent import SINGLE_TURN, TOOL_AGENT

    rows = []
    for i in range(PROMPTS):
        words = " ".join(f"w{(7 * i + 3 * j) % 50}" for j in range(3 + i % 3))
        agent = TOOL_AGENT if (multi_turn and i in MULTI_TURN) else SINGLE_TURN
        rows.append({"data_source": "r3e2e", "prompt": [{"role": "user", "content": words}], "ability": "echo",
                     "reward_model": {"style": "rule", "ground_truth": f"w{i}"}, "agent_name": agent,
                     "extra_info": {"index": i, "split": "train"}})
    pd.DataFrame(rows).to_parquet(path)


def write_job(root: str, *, multi_turn: bool = True, first_seen: bool = True) -> dict[str, str]:
    """The job's files under ``root`` (model, data, reward, agent loop and tool configs) and
    ``root/lab/testlab``, a link to this checkout's ``testlab``: the job's ``PYTHONPATH`` names that
    folder, never the checkout, whose ``r3bridge/`` folder would hide the installed package (and
    its ``r3bridge.adapters``, which only the installed mapping provides)."""
    from testlab import verl_e2e_agent

    root = os.path.abspath(root)
    paths = {"root": root, "model": os.path.join(root, "model"), "train": os.path.join(root, "train.parquet"),
             "reward": os.path.join(root, "reward.py"), "agent": os.path.join(root, "agent_loops.yaml"),
             "tools": os.path.join(root, "tools.yaml"), "logs": os.path.join(root, "logs"),
             "agent_calls": os.path.join(root, "logs", "agent_calls"), "metrics": os.path.join(root, "metrics.jsonl"),
             "lab": os.path.join(root, "lab")}
    os.makedirs(paths["lab"], exist_ok=True)
    link = os.path.join(paths["lab"], "testlab")
    if not os.path.lexists(link):
        os.symlink(os.path.dirname(os.path.abspath(__file__)), link)
    write_model(paths["model"], save_weights=os.environ.get("R3E2E_SAVE_WEIGHTS") == "1")
    write_data(paths["train"], multi_turn)
    with open(paths["reward"], "w") as f:
        f.write(REWARD_PY)
    with open(paths["agent"], "w") as f:
        f.write(verl_e2e_agent.agent_loop_yaml(first_seen))
    with open(paths["tools"], "w") as f:
        f.write(verl_e2e_agent.tool_config_yaml())
    return paths


def job_command(paths: dict[str, str], mode: str, *, steps: int = 2) -> list[str]:
    """The command line a user runs (verl's overrides plus the r3bridge section)."""
    a, meg, tok = "actor_rollout_ref", "actor_rollout_ref.actor.megatron", 160
    cmd = [sys.executable, "-m", "r3bridge.adapters.verl.main_ppo", "--config-name=ppo_megatron_trainer",
            "algorithm.adv_estimator=grpo",
            f"data.train_files={paths['train']}", f"data.val_files={paths['train']}",
            f"data.train_batch_size={BATCH}", f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={RESPONSE_LEN}", "data.shuffle=False", "data.dataloader_num_workers=0",
            f"{a}.model.path={paths['model']}", f"{a}.model.external_lib=testlab.verl_e2e_worker",
            f"{a}.model.use_remove_padding=True",
            # R3E2E_BRIDGE=megatron-bridge: verl's default builder (GPU; docs/gpu.md, "verl on GPUs")
            f"{meg}.vanilla_mbridge={os.environ.get('R3E2E_BRIDGE', 'mbridge') == 'mbridge'}",
            f"{meg}.override_transformer_config.attention_backend=auto",
            f"{a}.actor.ppo_mini_batch_size={BATCH}", f"{a}.actor.use_dynamic_bsz=True",
            f"{a}.actor.ppo_max_token_len_per_gpu={tok}", f"{a}.actor.optim.lr=1e-3",
            f"{a}.actor.use_kl_loss=True", f"{a}.actor.kl_loss_coef=0.01",
            f"{a}.rollout.log_prob_use_dynamic_bsz=True", f"{a}.rollout.log_prob_max_token_len_per_gpu={tok}",
            f"{a}.ref.log_prob_use_dynamic_bsz=True", f"{a}.ref.log_prob_max_token_len_per_gpu={tok}",
            *rollout_overrides(mode),
            f"{a}.rollout.agent.num_workers=1", f"{a}.rollout.agent.agent_loop_config_path={paths['agent']}",
            f"{a}.rollout.multi_turn.format=r3e2e", f"{a}.rollout.multi_turn.tool_config_path={paths['tools']}",
            f"{a}.rollout.multi_turn.max_assistant_turns=2",
            f"reward.custom_reward_function.path={paths['reward']}", "reward.num_workers=1",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.logger=[console,file]",
            f"trainer.total_training_steps={steps}", "trainer.total_epochs=1", "trainer.val_before_train=False",
            "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.project_name=r3e2e",
            f"trainer.experiment_name={mode}", f"trainer.default_local_dir={paths['root']}/ckpt",
            "+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=8",
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
            f"r3bridge.replay_mode={mode}"]
    # the trainer's parallel layout and GPU count (R3E2E_GPUS, R3E2E_TP, ...: testlab.verl_e2e_parallel)
    return apply_overrides(cmd, Parallel.from_env().overrides())


# ------------------------------------------------------------------------------------ rollout backend
VLLM_SITE = "/tmp/site-vllm"      # scripts/gpu/bundle.sh installs the vLLM 0.24.0 wheel set there
SGLANG_SITE = "/tmp/site-sglang"  # ... and the SGLang one there,
SGLANG_VERL_SITE = "/tmp/site-sglang_verl"   # and what verl needs over it (transformers 5.9.0), first
ROLLOUTS = ("hf", "vllm", "sglang")


@dataclass(frozen=True)
class VllmRelease:
    """A vLLM release verl's job runs on (``R3E2E_VLLM_RELEASE``): its wheel set's site (``bundle.sh
    install`` puts set SET into ``/tmp/site-SET``), the engine name in the output tag, and the
    narrowest attention head the release serves (``None``: any; the model's default is
    :data:`testlab.mbridge_spec.DEFAULT_HEAD_DIM`)."""

    version: str
    site: str
    tag: str
    min_head_dim: Optional[int] = None


VLLM_RELEASES = {
    "0.24.0": VllmRelease("0.24.0", VLLM_SITE, "vllm"),          # verl 0.9.1's pin; set `vllm`
    # set `vllm026`. Heads of 8 (the tiny model's default) never come back from the first forward on
    # 0.26.0 (FA3 and FA2; docs/gpu-results/vllm-0.26.0), heads of 64 do, as in the SGLang runs
    "0.26.0": VllmRelease("0.26.0", "/tmp/site-vllm026", "vllm026", min_head_dim=64),
}


def vllm_release() -> VllmRelease:
    """``R3E2E_VLLM_RELEASE`` (default 0.24.0) for ``R3E2E_ROLLOUT=vllm``; an unknown release, or a
    model head (``R3E2E_HEAD_DIM``) narrower than the release serves, is refused here, before any
    device time is spent on a job that cannot return."""
    release = _named_release()
    head = model_head_dim()
    if release.min_head_dim is not None and head is not None and head < release.min_head_dim:
        raise ValueError(f"R3E2E_HEAD_DIM={head} with vLLM {release.version}: its first forward never returns with "
                         f"attention heads narrower than {release.min_head_dim} (docs/gpu-results/vllm-0.26.0); leave "
                         f"R3E2E_HEAD_DIM unset (the job then uses {release.min_head_dim}) or set it to >= "
                         f"{release.min_head_dim}")
    return release


def _named_release() -> VllmRelease:
    name = os.environ.get("R3E2E_VLLM_RELEASE", "0.24.0")
    if name not in VLLM_RELEASES:
        raise ValueError(f"R3E2E_VLLM_RELEASE={name!r}: one of {', '.join(VLLM_RELEASES)}")
    return VLLM_RELEASES[name]


def model_head_dim() -> Optional[int]:
    """The job model's attention head width: ``R3E2E_HEAD_DIM`` when set, else the chosen vLLM
    release's narrowest (``R3E2E_ROLLOUT=vllm``), else ``None`` (the model's default, 8)."""
    if os.environ.get("R3E2E_HEAD_DIM"):
        return int(os.environ["R3E2E_HEAD_DIM"])
    return _named_release().min_head_dim if rollout_backend() == "vllm" else None


def installed_vllm_problem(env: dict[str, str]) -> Optional[str]:
    """Whether the job's processes (environment ``env``) import the chosen vLLM release: the
    version of the ``vllm`` distribution first on their path (read from its metadata in a child
    process, nothing imported), ``None`` when it is the one asked for. A missing or wrong site
    (the wrong set installed, an old ``/tmp/site-vllm`` first) is told before the job starts."""
    import subprocess

    if rollout_backend() != "vllm":
        return None
    want = vllm_release()
    probe = ("import importlib.metadata as m\ntry:\n    print(m.version('vllm'))\n"
             "except m.PackageNotFoundError:\n    print('none')")
    got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    found = got.stdout.strip() or f"unknown ({got.stderr.strip()[-200:]})"
    if found == want.version:
        return None
    site = env.get("PYTHONPATH", "").split(os.pathsep)[0]
    return (f"R3E2E_VLLM_RELEASE={want.version}: the job's processes would import vLLM {found} (PYTHONPATH starts with "
            f"{site}); install the wheel set of {want.version} there (scripts/gpu/bundle.sh install, "
            f"set {os.path.basename(want.site).removeprefix('site-')}) or point R3E2E_VLLM_SITE at it")


def rollout_backend() -> str:
    """``R3E2E_ROLLOUT``: ``hf`` (default), ``vllm`` or ``sglang`` (verl's own servers; the device only)."""
    name = os.environ.get("R3E2E_ROLLOUT", "hf")
    if name not in ROLLOUTS:
        raise ValueError(f"R3E2E_ROLLOUT={name!r}: one of {', '.join(ROLLOUTS)}")
    return name


def rollout_overrides(mode: str) -> list[str]:
    """verl's rollout overrides for the chosen backend. vLLM: verl's own async server and weight
    sync (``load_format=dummy``: the engine serves only what the trainer synced), sleep mode and
    ``free_cache_engine`` as verl sets them, a memory share that leaves room for the trainer on
    the same GPU (``R3E2E_VLLM_GPU_MEM``, default 0.3), prefix caching per ``R3E2E_PREFIX_CACHE``
    (default 1), chunked prefill on with a 32-token budget so the prompts (up to 24 tokens, 60 with
    a second turn) are prefilled in chunks, CUDA graphs at vLLM's default (``enforce_eager=False``)."""
    a = "actor_rollout_ref.rollout"
    common = [f"{a}.mode=async", f"{a}.n={N}", f"{a}.tensor_model_parallel_size=1", f"{a}.calculate_log_probs=True",
              f"{a}.enable_rollout_routing_replay={mode == 'R3'}"]
    if rollout_backend() == "hf":
        return [f"{a}.name=hf_r3", *common]
    prefix = os.environ.get("R3E2E_PREFIX_CACHE", "1") == "1"
    if rollout_backend() == "sglang":
        return sglang_overrides(common, prefix)
    return [f"{a}.name=vllm", *common, f"{a}.gpu_memory_utilization={os.environ.get('R3E2E_VLLM_GPU_MEM', '0.3')}",
            f"{a}.enable_prefix_caching={prefix}", f"{a}.enable_chunked_prefill=True",
            f"{a}.max_num_batched_tokens=32", f"{a}.max_num_seqs=16", f"{a}.free_cache_engine=True",
            f"{a}.enforce_eager=False", f"{a}.load_format=dummy"]


def sglang_overrides(common: list[str], radix_cache: bool) -> list[str]:
    """verl's SGLang rollout as the direct SGLang 0.5.12 run needed it (docs/gpu-results/sglang-0.5.12):
    SGLang's own settings through verl's ``engine_kwargs.sglang`` (``attention_backend=triton``,
    ``sampling_backend=pytorch``: the wheel set carries no flashinfer cubins; ``chunked_prefill_size=32``,
    the vLLM arm's 32-token budget, so the prompts of up to 60 tokens are prefilled in chunks;
    ``disable_radix_cache`` for ``R3E2E_PREFIX_CACHE=0``); verl's own keys for the rest:
    ``gpu_memory_utilization`` is SGLang's ``mem_fraction_static`` (``R3E2E_SGLANG_GPU_MEM``, default
    0.3: SGLang takes 0.88 by default and the trainer shares the GPU), ``enforce_eager`` its
    ``disable_cuda_graph`` (eager, as the direct run), ``max_num_seqs`` its ``max_running_requests``,
    ``load_format=dummy`` (the engine serves only what verl's weight sync sent), ``skip_tokenizer_init``
    verl's default (the one path r3bridge reads: :func:`r3bridge.adapters.verl.sglang_routes.check_sglang_rollout`)."""
    a, kw = "actor_rollout_ref.rollout", "actor_rollout_ref.rollout.engine_kwargs.sglang"
    return [f"{a}.name=sglang", *common,
            f"{a}.gpu_memory_utilization={os.environ.get('R3E2E_SGLANG_GPU_MEM', '0.3')}",
            f"{a}.max_num_seqs=16", f"{a}.free_cache_engine=True", f"{a}.enforce_eager=True",
            f"{a}.load_format=dummy", f"{a}.skip_tokenizer_init=True",
            f"++{kw}.attention_backend=triton", f"++{kw}.sampling_backend=pytorch",
            f"++{kw}.chunked_prefill_size=32", f"++{kw}.disable_radix_cache={not radix_cache}"]


def rollout_env(env: dict[str, str]) -> dict[str, str]:
    """The backend's environment: its wheel set's site first on ``PYTHONPATH``. vLLM (the site of
    :func:`vllm_release`, or ``R3E2E_VLLM_SITE``): fastapi 0.136 over verl's 0.165 (vLLM 0.24.0 and
    0.26.0 pin < 0.137) and ``VLLM_USE_FLASHINFER_SAMPLER=0`` (neither set carries flashinfer; vLLM's
    sampler imports it unguarded at the default). SGLang: its set
    (fastapi 0.136, uvicorn, sglang-kernel, soundfile, ...: scripts/gpu/wheels/sglang.txt) behind
    ``sglang_verl`` (transformers 5.9.0: verl 0.9.1 excludes the sglang set's 5.6.0;
    scripts/gpu/wheels/sglang_verl.txt), for every process of the job (verl's trainer workers import
    SGLang's weight-sync client too)."""
    backend = rollout_backend()
    if backend == "hf":
        return env
    sites = ([os.environ.get("R3E2E_VLLM_SITE", vllm_release().site)] if backend == "vllm" else
             [os.environ.get("R3E2E_SGLANG_VERL_SITE", SGLANG_VERL_SITE), os.environ.get("R3E2E_SGLANG_SITE", SGLANG_SITE)])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sites]
    out = {**env, "PYTHONPATH": os.pathsep.join([*sites, *parts])}
    if backend == "vllm":
        out["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return out


def run_tag(mode: str, variant: str) -> str:
    """The output name of one job: the HF runs keep their names; vLLM / SGLang runs carry the
    prefix-cache arm (SGLang: its radix cache)."""
    backend = rollout_backend()
    if backend == "hf":
        return f"{mode}_{variant}"
    arm = "pc" if backend == "vllm" else "rc"
    engine = vllm_release().tag if backend == "vllm" else backend
    return f"{engine}_{mode}_{variant}_{arm}{os.environ.get('R3E2E_PREFIX_CACHE', '1')}"


def stand_in_env(paths: dict[str, str], *, gpu: bool = False) -> dict[str, str]:
    """What the job's environment adds (the guide's ``cpu.env``, testlab/verl_cpu_job.py): ``testlab``
    importable (``paths["lab"]`` only: r3bridge and verl come from the virtualenv), verl's file
    logger's path; on CPU also verl's NVIDIA platform with gloo (:mod:`testlab.verl_e2e_platform`,
    through verl's own ``VERL_USE_EXTERNAL_MODULES`` / ``VERL_PLATFORM``) and one thread per process."""
    env = {"PYTHONPATH": paths["lab"], "VERL_FILE_LOGGER_PATH": paths["metrics"]}
    if not gpu:
        env.update(VERL_USE_EXTERNAL_MODULES="testlab.verl_e2e_platform", VERL_PLATFORM="r3bridge_cpu",
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    return env


def job_env(paths: dict[str, str], *, gpu: bool = False) -> dict[str, str]:
    """The job's whole environment: this process's (CPU: without ``CUDA_VISIBLE_DEVICES``),
    :func:`stand_in_env` (``PYTHONPATH`` in front of the one given), the probe's log folder."""
    env = dict(os.environ) if gpu else {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    add = stand_in_env(paths, gpu=gpu)
    add["PYTHONPATH"] = os.pathsep.join([add["PYTHONPATH"], env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(add)
    env.update(R3E2E_LOG_DIR=paths["logs"], R3E2E_AGENT_LOG_DIR=paths["agent_calls"], RAY_DEDUP_LOGS="0",
               HYDRA_FULL_ERROR="1")
    return stacks_env(rollout_env(env), os.path.join(paths["root"], "stacks"))


# a sitecustomize: each Python process of the job writes its threads' stacks every R3E2E_STACKS_AFTER s
STACKS_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stacks")


def stacks_env(env: dict[str, str], stacks_dir: str) -> dict[str, str]:
    """``R3E2E_STACKS_AFTER=S``: every Python process of the job appends all its threads' stacks to
    ``stacks_dir/<pid>.txt`` every S seconds of its life and keeps running (``testlab/stacks``, last
    on ``PYTHONPATH``). For a device call whose job might hang: a failed job then leaves the frames
    each process last stood in (``verl_e2e.sh`` puts them into ``$OUT``), not only a timeout.
    Unset: nothing added."""
    after = os.environ.get("R3E2E_STACKS_AFTER")
    if not after:
        return env
    try:
        ok = float(after) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"R3E2E_STACKS_AFTER={after!r}: every how many seconds the job's processes write their "
                         f"stacks (a number > 0)")
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != STACKS_FOLDER]
    return {**env, "PYTHONPATH": os.pathsep.join([*parts, STACKS_FOLDER]), "R3E2E_STACKS_AFTER": after,
            "R3E2E_STACKS_DIR": stacks_dir}


def stack_dumps(stacks_dir: str) -> dict[str, str]:
    """The stacks the job's processes wrote (``{pid file: text}``), empty files (processes that
    ended before the dump) left out."""
    out = {}
    for f in sorted(glob.glob(os.path.join(stacks_dir, "*.txt"))):
        with open(f, errors="replace") as fh:
            text = fh.read()
        if text.strip():
            out[os.path.basename(f)] = text
    return out


# ------------------------------------------------------------------------------------ after the run
@dataclass
class Call:
    prompt: list[int]
    output: list[int]
    routes: np.ndarray            # [len(prompt) + len(output) - 1, NUM_LAYERS, TOPK]
    order: int

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Trajectory:
    tokens: list[int]
    calls: list[Call] = field(default_factory=list)

    def routes(self, first_seen: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(routes ``[len(tokens), NUM_LAYERS, TOPK]``, valid rows) this trajectory's tokens were
        routed with at rollout: first-seen (the call that first fed each token) or last call."""
        out = np.zeros((len(self.tokens), NUM_LAYERS, TOPK), dtype=np.int64)
        valid = np.zeros(len(self.tokens), dtype=bool)
        calls = self.calls if first_seen else self.calls[-1:]
        for c in calls:
            if c.routes.size == 0:        # no routes returned (R2 / off: the rollout is asked for none)
                continue
            n = min(len(c.routes), len(self.tokens))
            new = ~valid[:n]
            out[:n][new] = c.routes[:n][new]
            valid[:n] = True
        return out, valid


def read_calls(log_dir: str) -> list[Call]:
    """The calls logged in ``log_dir`` (the HF server's own log, or the agent loops'
    ``agent_calls``), in time order."""
    calls = []
    for i, f in enumerate(sorted(glob.glob(os.path.join(log_dir, "call_*.pt")), key=lambda p: int(p.split("_")[-2]))):
        d = torch.load(f)
        calls.append(Call(list(d["prompt_ids"]), list(d["output_ids"]), d["routed_experts"].numpy(), i))
    return calls


def trajectories(trainer_seqs: list[list[int]], calls: list[Call]) -> list[Trajectory]:
    """Each distinct trainer sequence with the rollout calls it continues (prompt order)."""
    out = []
    for seq in sorted({tuple(s) for s in trainer_seqs}):
        t = Trajectory(list(seq))
        for c in calls:
            n = min(len(c.tokens), len(seq))
            if len(c.prompt) <= len(seq) and list(seq[:n]) == c.tokens[:n]:
                t.calls.append(c)
        t.calls.sort(key=lambda c: (len(c.prompt), c.order))
        out.append(t)
    return out


def read_dispatch(log_dir: str) -> list[dict]:
    recs = [torch.load(f) for f in glob.glob(os.path.join(log_dir, "dispatch", "*.pt"))]
    return sorted(recs, key=lambda r: (r["pid"], r["time"]))


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def router_rows(batch: dict) -> tuple[list[int], list[int]]:
    """(sequence index, token position) of every router row of a micro-batch on the record's rank
    (THD, each sequence padded to its packed length; the rank's sequence-parallel slice), -1 on
    padding rows (:func:`testlab.verl_e2e_parallel.rank_rows`)."""
    return rank_rows(batch)


def group_passes(recs: list[dict]) -> list[tuple[str, bool, list[dict]]]:
    """Consecutive router calls of one (role, grad mode) form a pass (compute_log_prob, ref,
    update mini-batches); a pass ends when another kind of call comes."""
    out: list[tuple[str, bool, list[dict]]] = []
    for r in recs:
        key = (r["role"], bool(r["grad"]))
        if out and (out[-1][0], out[-1][1]) == key:
            out[-1][2].append(r)
        else:
            out.append((key[0], key[1], [r]))
    return out


def dispatch_log(recs: list[dict], sample_of: dict[tuple, int], *, framework: str, step_of: dict[int, int],
                 which: str = "dispatched") -> Any:
    """The router calls ``recs`` as :class:`testlab.dispatch_records.DispatchRecords`, keyed
    (step, phase, grad, sample, token, layer); ``which``: ``dispatched`` or ``native`` ids. One log
    per rank (process), merged: a key several ranks routed (TP without sequence parallelism) must
    carry the same ids on each."""
    from testlab.dispatch_records import DispatchLog, DispatchRecords

    logs = []
    for pid_recs in by_process(recs).values():
        log = DispatchLog(framework)
        for r in pid_recs:
            seqs = [tuple(s) for s in r["batch"]["seqs"]]
            seq_idx, pos = router_rows(r["batch"])
            samples = torch.tensor([sample_of[seqs[i]] if i >= 0 else -1 for i in seq_idx], dtype=torch.int64)
            tokens = torch.tensor(pos, dtype=torch.int64)
            if not bool((samples >= 0).any()):     # this rank's slice of the call holds padding only
                continue
            step = step_of[int(samples[samples >= 0][0])]
            log.add(step=step, phase="update" if r["grad"] else "compute_log_prob", grad=bool(r["grad"]),
                    layer=int(r["layer"]), topk=r[which], sample=samples, token=tokens)
        logs.append(log.records())
    return DispatchRecords.merge(logs) if logs else DispatchRecords(framework)


@dataclass
class RunResult:
    rc: int
    calls: list[Call]
    trajs: list[Trajectory]
    dispatch: list[dict]
    metrics: list[dict]
    output: str = ""
    agent_calls: list[Call] = field(default_factory=list)    # the agent loops' log of the same calls

    def sample_of(self) -> dict[tuple, int]:
        return {tuple(t.tokens): i for i, t in enumerate(self.trajs)}


def read_run(paths: dict[str, str], rc: int, output: str = "") -> RunResult:
    """The run's logs. The routes to check are the ones the rollout server handed back: the HF
    server logs its own calls; verl's vLLM and SGLang servers do not, and the agent loops' log is read."""
    agent = read_calls(paths["agent_calls"])
    calls = read_calls(paths["logs"]) if rollout_backend() == "hf" else agent
    recs = read_dispatch(paths["logs"])
    tokens = [c.tokens for c in calls]
    for r in recs:    # padded-only sequences of a first pipeline stage at TP > 1 (verl_e2e_parallel)
        resolve_lengths(r["batch"], tokens)
    seqs = [s for r in recs for s in r["batch"]["seqs"]]
    return RunResult(rc, calls, trajectories(seqs, calls), recs, read_metrics(paths["metrics"]), output, agent)


def expected_batch(trajs: list[Trajectory], *, first_seen: bool = True, sample_ids: Optional[list[int]] = None) -> Any:
    """The rollout's routes of ``trajs`` as a ReplayBatch (MoE layers, rows the engine fed)."""
    from r3bridge.batch.schema import ReplayBatch

    ids = list(range(len(trajs))) if sample_ids is None else sample_ids
    per = [trajs[i].routes(first_seen) for i in ids]
    routes = torch.cat([torch.from_numpy(r[:, MOE_LAYERS]) for r, _ in per])
    valid = torch.cat([torch.from_numpy(v) for _, v in per])
    return ReplayBatch.from_packed(routes, [len(r) for r, _ in per], num_experts=NUM_EXPERTS, layer_ids=MOE_LAYERS,
                                   valid=valid, route_kind="rollout")


# ------------------------------------------------------------------------------------ checks
@dataclass
class StepCheck:
    step: int
    samples: int
    multi_turn: int                         # samples with more than one rollout call
    errors: list[str] = field(default_factory=list)
    compared: dict[str, int] = field(default_factory=dict)   # pass -> (sample, token, layer) rows compared
    ref_native: tuple[int, int] = (0, 0)    # (rows where the reference dispatched its own top-k, rows)
    ref_equal_rollout: tuple[int, int] = (0, 0)   # R3: (ref rows equal to the rollout route, valid rows)
    # R3: (compute_log_prob rows whose trainer-native top-k equals the engine's route, rows compared)
    native_vs_rollout: tuple[int, int] = (0, 0)
    reprefill: tuple[int, int] = (0, 0)     # (re-prefilled rows whose route differs from first-seen, re-prefilled rows)


def _per_step(res: RunResult) -> list[tuple[int, list[dict], list[dict], list[dict]]]:
    """(step, compute_log_prob records, reference records, update records) in run order, over all
    ranks: each rank's (process's) calls are split into steps on their own, then step ``i`` of every
    rank is merged."""
    merged: dict[int, tuple[list[dict], list[dict], list[dict]]] = {}
    for recs in by_process(res.dispatch).values():
        for step, *kinds in _per_step_of(recs):
            for into, part in zip(merged.setdefault(step, ([], [], [])), kinds):
                into.extend(part)
    return [(step, *merged[step]) for step in sorted(merged)]


def _per_step_of(recs: list[dict]) -> list[tuple[int, list[dict], list[dict], list[dict]]]:
    """One rank's records (call order) as (step, compute_log_prob, reference, update) records."""
    out, step = [], -1
    cur: dict[str, list[dict]] = {}
    for role, grad, calls in group_passes(recs):
        kind = "update" if grad else "ref" if role == "ref" else "old"
        if kind == "old":
            if cur:
                out.append((step, cur.get("old", []), cur.get("ref", []), cur.get("update", [])))
            step, cur = step + 1, {}
        cur.setdefault(kind, []).extend(calls)
    if cur:
        out.append((step, cur.get("old", []), cur.get("ref", []), cur.get("update", [])))
    return out


def _native_records(recs: list[dict], framework: str, step: int, sample_of: dict[tuple, int]) -> Any:
    return dispatch_log(recs, sample_of, framework=framework, step_of={s: step for s in sample_of.values()},
                        which="native")


def check_run(res: RunResult, mode: str, *, first_seen: bool = True) -> list[StepCheck]:
    """Every router call of the actor against the routes it must dispatch, keyed (sample, token,
    layer); the reference model against its own native top-k."""
    from testlab.dispatch_records import DispatchRecords, compare_dispatch

    out = []
    for step, old, ref, upd in _per_step(res):
        seqs = sorted({tuple(s) for r in old for s in r["batch"]["seqs"]})
        by_tokens = {tuple(t.tokens): t for t in res.trajs}
        trajs = [by_tokens[s] for s in seqs]
        sample_of = {s: i for i, s in enumerate(seqs)}
        lens = [len(s) for s in seqs]
        chk = StepCheck(step, len(seqs), sum(len(t.calls) > 1 for t in trajs))
        step_of = {i: step for i in range(len(seqs))}
        old_rec = dispatch_log(old, sample_of, framework="verl", step_of=step_of)
        upd_rec = dispatch_log(upd, sample_of, framework="verl", step_of=step_of)
        if mode == "R3":
            expected = expected_batch(trajs, first_seen=first_seen)
        elif mode == "R2":    # the update replays what compute_log_prob's routers chose
            expected = _recorded_batch(old_rec, lens)
        else:
            expected = None
        for name, rec in (("compute_log_prob", old_rec), ("update", upd_rec)):
            if expected is None or (mode == "R2" and name == "compute_log_prob"):
                want = _native_records([r for r in (old if name == "compute_log_prob" else upd)], "verl", step,
                                       sample_of)
                agree = compare_dispatch({"verl": rec, "native": DispatchRecords.relabel(want, "native")},
                                         _recorded_batch(want, lens), lens)
            else:
                agree = compare_dispatch({"verl": rec}, expected, lens)
            chk.errors += [f"step {step} {name}: {e}" for e in agree.errors]
            chk.compared[name] = agree.compared
        # the reference model: no hook, its own native top-k on every row
        nat = [int((r["dispatched"] == r["native"]).all(-1).sum()) for r in ref]
        rows = [int(r["dispatched"].shape[0]) for r in ref]
        chk.ref_native = (sum(nat), sum(rows))
        hooks = {r["hook"] for r in ref}
        if hooks != {None}:
            chk.errors.append(f"step {step}: reference routers carry a replay hook {sorted(map(str, hooks))}")
        if mode == "R3":
            roll = expected_batch(trajs, first_seen=True)
            chk.ref_equal_rollout = _equal_rows(dispatch_log(ref, sample_of, framework="ref", step_of=step_of), roll)
            chk.native_vs_rollout = _equal_rows(_native_records(old, "verl", step, sample_of), roll)
        dis = ov = 0
        for t in trajs:
            if len(t.calls) > 1:
                a, va = t.routes(first_seen=True)
                b, vb = t.routes(first_seen=False)
                both = va & vb
                lay = np.asarray(MOE_LAYERS)
                first = t.calls[0]
                both[len(first.routes):] = False      # rows only the later calls fed
                ov += int(both.sum())
                dis += int((np.sort(a[both][:, lay], -1) != np.sort(b[both][:, lay], -1)).any((1, 2)).sum())
        chk.reprefill = (dis, ov)
        out.append(chk)
    return out


def _equal_rows(records: Any, roll: Any) -> tuple[int, int]:
    """(rows of ``records`` whose ids equal the rollout's route, rows with a rollout route)."""
    same = total = 0
    for key, ids in records.table().items():
        s, t, layer = key[3:]
        r_routes, r_valid = roll.sequence(s)
        if t < r_valid.numel() and bool(r_valid[t]):
            total += 1
            same += bool(torch.equal(ids, r_routes[t, MOE_LAYERS.index(layer)].to(torch.int64).sort().values))
    return same, total


def _recorded_batch(rec: Any, lens: list[int]) -> Any:
    """A pass's dispatched ids as a ReplayBatch over samples ``0..len(lens)-1`` (every row)."""
    from r3bridge.batch.schema import ReplayBatch

    routes = [torch.zeros(n, len(MOE_LAYERS), TOPK, dtype=torch.int64) for n in lens]
    valid = [torch.zeros(n, dtype=torch.bool) for n in lens]
    for key, ids in rec.table().items():
        s, t, layer = key[3:]
        routes[s][t, MOE_LAYERS.index(layer)] = ids
        valid[s][t] = True
    return ReplayBatch.from_packed(torch.cat(routes), lens, num_experts=NUM_EXPERTS, layer_ids=MOE_LAYERS,
                                   valid=torch.cat(valid), route_kind="recorded")


def r3bridge_metrics(res: RunResult) -> list[dict[str, float]]:
    """verl's logged metrics of each step, the r3bridge ones only."""
    return [{k: v for k, v in m.get("data", m).items() if "r3bridge" in k} for m in res.metrics]

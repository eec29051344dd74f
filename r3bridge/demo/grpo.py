"""One arm of the evidence run: GRPO on the addition task, megatron-core trainer, a real engine.

Per step (verl's order; weights synced every step, so the engine never lags):

1. **weight sync**: the trainer's weights, converted to HF names, into the engine as bf16
   (vLLM: verl's ``load_weights`` path, :mod:`r3bridge.demo.vllm_engine`; HF: ``load_state_dict``);
2. **rollout**: ``prompts`` problems x ``group`` samples at temperature 1; the engine reports each
   sampled token's log-prob and the routes (``routed_experts``), which reach the trainer only
   through ``ReplayBatch.from_vllm``; reward = exact match (:mod:`r3bridge.demo.task`),
   advantage = (reward - group mean) / (group std + 1e-6) (GRPO);
3. **compute_log_prob** (weights theta_old) over ``logprob_micro_batches`` packed micro-batches in
   sample order, routed per :func:`r3bridge.config.phase_plan`: native (off), record (R2),
   replay the engine's routes (R3), replay them and record their combine weights (R3w: R3 with
   ``replay_weights=recorded``, the updates then replay the ids and those weights, router frozen);
4. **updates**: the samples shuffled into ``mini_batches`` mini-batches (4: the off-policy stress
   of arXiv 2512.01374, where R3 beat R2), each one forward+backward with the PPO-clip loss
   (ratio against step 3's log-probs, clip 0.2, token mean), gradient clipping at 1.0 and one Adam
   step (``bf16`` trainer: bf16 parameters with fp32 main weights and Adam state, as Megatron's
   mixed precision keeps them).

Engine ``self`` is the noise floor: the trainer's own megatron forward samples (no KV cache: one
forward per decoded token), then one forward over the finished samples in compute_log_prob's
packing records the routes and log-probs it reports. Under R3, compute_log_prob then repeats that
very computation (same weights, kernels, shapes and routes): its mismatch is what the metric reads
when nothing differs but the GPU's run-to-run nondeterminism (exactly 0 on CPU).

Every step appends one line to ``logs/<arm>.jsonl`` in verl's file-logger format
(``{"step": N, "data": {key: value}}``, flushed per step; keys in docs/evidence.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

import numpy as np
import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.config import Action, Phase, PhasePlan, phase_plan
from r3bridge.demo import task as task_mod
from r3bridge.demo.evidence_config import Arm, GRPOOptions, RunConfig, wait_for_gate, wait_for_warm_start
from r3bridge.demo.hf_engine import Completion, HFEngine
from r3bridge.demo.hf_to_mcore import (
    from_te_names,
    hf_to_mcore,
    mcore_to_hf,
    packed_from_tokens,
    spec_from_hf,
    to_te_names,
)
from r3bridge.demo.job import batch_to, count_agreement
from r3bridge.demo.warmstart import WarmStartOptions, margins_of
from r3bridge.hf import moe_layer_ids_from_hf_config
from r3bridge.metrics import logprob_mismatch_sums, mismatch_from_sums
from r3bridge.testing.harness.data import local_inputs, packed_causal_mask, packed_seq_params
from r3bridge.testing.harness.dist import RankContext
from r3bridge.testing.harness.models import build_model_chunks, gather_full_state, load_reference_state
from r3bridge.testing.harness.probe import RoutingProbe, find_routers
from r3bridge.testing.harness.schedule import make_forward_step, run_schedule


# ----------------------------------------------------------------------------------- engines
class Engine(Protocol):
    num_layers: int
    moe_layer_ids: list[int]
    num_experts: int
    topk: int

    def load_hf_state(self, hf_state: dict[str, torch.Tensor]) -> None: ...

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, seed: int, eos_token_id: int,
                 temperature: float = 1.0) -> list[Completion]: ...


class HFRollout:
    """:class:`r3bridge.demo.hf_engine.HFEngine` behind the run's engine calls: bf16 weights;
    bf16 compute on a GPU, fp32 compute on the CPU (bf16 matmuls there are slow, not different)."""

    def __init__(self, hf_config: Any, device: str) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        if device == "cuda":
            model = model.to(torch.bfloat16)
        self.engine = HFEngine(model.to(device).eval())
        e = self.engine
        self.num_layers, self.moe_layer_ids = e.num_layers, e.moe_layer_ids
        self.num_experts, self.topk = e.num_experts, e.topk

    def load_hf_state(self, hf_state: dict[str, torch.Tensor]) -> None:
        self.engine.load_state_dict({k: v.to(torch.bfloat16) for k, v in hf_state.items()})

    def generate(self, prompts, *, max_new_tokens, seed, eos_token_id, temperature=1.0):
        return self.engine.generate(prompts, max_new_tokens=max_new_tokens, seed=seed,
                                    temperature=temperature, eos_token_id=eos_token_id)


def _vllm_rollout(run_dir: Path, hf_config: Any, opts: GRPOOptions, seed: int, n: int, max_len: int) -> Any:
    from r3bridge.demo.vllm_engine import VLLMEngine

    return VLLMEngine(str(run_dir / "model"), hf_config, seed=seed, max_num_seqs=n, max_model_len=max_len,
                      kv_cache_bytes=opts.vllm_kv_cache_mb << 20)


# the evidence modes that are a replay mode plus a routing-weights setting (ReplayConfig.replay_weights)
WEIGHTS_MODES = {"R3w": ("R3", "recorded")}


def arm_plan(mode: str, phase: Phase) -> PhasePlan:
    """The phase plan of an arm's mode: ``off`` / ``R2`` / ``R3`` as :func:`phase_plan` says, ``R3w``
    as R3 with ``replay_weights=recorded``."""
    replay_mode, weights = WEIGHTS_MODES.get(mode, (mode, "off"))
    return phase_plan(replay_mode, phase, weights)


# ------------------------------------------------------------------------------ optimizer
class MainWeightsAdam:
    """Adam on fp32 main weights: for bf16 model parameters, an fp32 copy takes the gradients, is
    clipped and stepped, and is copied back (Megatron's Float16Optimizer); fp32 parameters are
    their own main weights. :meth:`step` returns the gradient norm before clipping."""

    def __init__(self, params: Sequence[torch.nn.Parameter], lr: float, grad_clip: float) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.main = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
                     for p in self.params]
        self.grad_clip = grad_clip
        self.adam = torch.optim.Adam(self.main, lr=lr, betas=(0.9, 0.999), eps=1e-8)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> float:
        for p, m in zip(self.params, self.main):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_([m for m in self.main if m.grad is not None], self.grad_clip)
        self.adam.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.main):
                if m is not p:
                    p.copy_(m)
        return float(norm)

    def state_dict(self) -> dict[str, Any]:
        return {"adam": self.adam.state_dict(), "main": [m.detach().clone() for m in self.main]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.main, state["main"]):
                m.copy_(saved)
                if m is not p:
                    p.copy_(saved)
        self.adam.load_state_dict(state["adam"])


# ---------------------------------------------------------------------------- the step's data
@dataclass
class Samples:
    """One step's rollout: per sample its prompt, response, engine log-probs, reward, advantage."""

    prompts: list[list[int]]
    responses: list[list[int]]
    rollout_lp: list[torch.Tensor]
    rewards: np.ndarray
    advantages: np.ndarray
    routes: Optional[ReplayBatch] = None

    def __len__(self) -> int:
        return len(self.prompts)


def _advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    r = rewards.reshape(-1, group)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)


def _pack(s: Samples, ids: Sequence[int], device: str):
    b = packed_from_tokens([s.prompts[i] + s.responses[i] for i in ids], loss_from=[len(s.prompts[i]) for i in ids])
    return batch_to(b, device)


def _response_slices(s: Samples, ids: Sequence[int], batch) -> list[slice]:
    """Where each sample's response log-probs sit in the packed stream (label positions)."""
    out, offset = [], 0
    for i, padded in zip(ids, batch.padded_lens):      # host lists: no device sync per sample
        start = offset + len(s.prompts[i]) - 1
        out.append(slice(start, start + len(s.responses[i])))
        offset += padded
    return out


def _per_token(s: Samples, ids: Sequence[int], batch, per_sample: Sequence[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(batch.total, dtype=torch.float32)
    for sl, i in zip(_response_slices(s, ids, batch), ids):
        out[sl] = per_sample[i]
    return out.to(batch.input_ids.device)


def _logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)


def _install(step, inner, routes_of, ids_of):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        step.install(model, routes_of.get(id(batch)), batch.seq_lens, cu_seqlens_padded=batch.cu_seqlens_padded,
                     sample_ids=ids_of[id(batch)])
        return inner(iter([batch]), model)
    return forward_step


def _ppo_forward_step(thd: bool, per_batch: dict[int, dict[str, torch.Tensor]], clip: float, out: list):
    """megatron forward_step for an update: logits -> fp32 log-probs of the sampled tokens -> the
    PPO-clip loss, token mean over the micro-batch's response tokens."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        loc = local_inputs(batch, 1, 0)
        mask = None if thd else packed_causal_mask(batch).to(loc["input_ids"].device)
        logits = model(loc["input_ids"], loc["position_ids"], mask,
                       packed_seq_params=packed_seq_params(batch) if thd else None)
        t = per_batch[id(batch)]

        def loss_func(output: torch.Tensor):
            logp = _logprobs(output.reshape(-1, output.shape[-1]), batch.labels)
            m = t["mask"]
            n = m.sum().clamp(min=1.0)
            log_ratio = logp - t["old_lp"]
            ratio = torch.exp(log_ratio)
            pg1 = -t["adv"] * ratio
            pg2 = -t["adv"] * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
            loss_sum = (torch.maximum(pg1, pg2) * m).sum()
            out.append({"logp": logp.detach(), "loss": float(loss_sum.detach() / n),
                        "clipfrac": float(((pg2 > pg1).float() * m).sum() / n),
                        "ppo_kl": float((-log_ratio.detach() * m).sum() / n)})
            # run_schedule reports loss_sum / n_global per micro-batch
            return loss_sum / n, {"loss_sum": loss_sum.detach(), "n_global": n}

        return logits, loss_func

    return forward_step


class RouterInputs:
    """Forward pre-hooks keeping what each of the trainer's routers was given in a pass: the
    router margins (:func:`r3bridge.demo.warmstart.margins_of`) at theta_old are its logits,
    recomputed in fp32 from it (the routing probe keeps only the chosen experts' scores)."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        self.routers = [r for r in find_routers(chunks) if not r.mtp]
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "RouterInputs":
        for ref in self.routers:
            self._handles.append(ref.module.register_forward_pre_hook(self._hook(ref.layer_id)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer_id: int):
        def hook(_module: torch.nn.Module, args: tuple) -> None:
            self.inputs.setdefault(layer_id, []).append(args[0].detach())
        return hook

    @torch.no_grad()
    def margins(self, topk: int) -> dict[str, Any]:
        logits, layer_ids = [], []
        for ref in self.routers:
            calls = self.inputs.get(ref.layer_id, [])
            if calls:
                w = ref.module.weight.float()
                x = torch.cat([c.reshape(-1, c.shape[-1]) for c in calls]).float()
                logits.append(x @ w.t())
                layer_ids.append(ref.layer_id)
        return margins_of(logits, layer_ids, int(topk))


# ------------------------------------------------------------------------------------ the log
def _compact(x: float) -> float:
    return float(f"{x:.5g}")


class StepLog:
    """``logs/<arm>.jsonl``, verl's file-logger format, one flushed line per step. On resume the
    lines of steps not covered by the checkpoint are dropped first."""

    def __init__(self, path: Path, start: int) -> None:
        self.path = path
        if start and path.exists():
            keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] < start]
            path.write_text("".join(line + "\n" for line in keep))
        elif path.exists():
            path.unlink()
        self.fp = open(path, "a")

    def write(self, step: int, data: dict[str, float]) -> None:
        self.fp.write(json.dumps({"step": step, "data": {k: _compact(v) for k, v in data.items()}},
                                 separators=(",", ":")) + "\n")
        self.fp.flush()

    def close(self) -> None:
        self.fp.close()


def trainer_router_losses(warm: WarmStartOptions, hf_config: Any, scale: float = 1.0) -> tuple[float, Optional[float]]:
    """megatron's ``moe_aux_loss_coeff`` and ``moe_z_loss_coeff`` that give the GRPO trainer's routers
    the warm start's router losses times ``scale`` (GRPOOptions.router_losses).

    The z-loss is the same per MoE layer on both sides (mean logsumexp^2, summed over layers). The
    load-balancing loss is not: HF's ``load_balancing_loss_func`` is one switch loss over the tokens
    of every MoE layer concatenated, whose gradient on a token's router probability is
    ``aux * top_k * load / (tokens * moe_layers)`` (``load``: the expert's share of all layers'
    routing); megatron's is one switch loss per layer, ``coeff * load_of_the_layer / tokens``. So
    ``coeff = aux * top_k / moe_layers`` pulls against an imbalance the layers share as the warm start
    did (one layer's own imbalance harder)."""
    moe_layers = len(moe_layer_ids_from_hf_config(hf_config))
    aux = scale * warm.aux_loss * hf_config.num_experts_per_tok / max(1, moe_layers)
    z = scale * warm.router_z_loss
    return aux, (z if z > 0 else None)


def _take_router_losses(m: dict[str, float], updates: int, moe_layers: int) -> None:
    """The update passes' router losses from megatron's aux-loss tracker (each pass adds its value
    per layer, before the coefficient), as means per MoE layer and update; then cleared for the
    next step. Nothing is logged when no router loss is on (the tracker stays empty)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    for name, entry in get_moe_layer_wise_logging_tracker().items():
        m[f"actor/router/{name}"] = float(entry["values"].sum()) / max(1, updates * moe_layers)
    clear_aux_losses_tracker()


# ------------------------------------------------------------------------------------- the arm
class ArmRunner:
    """Builds the trainer from the warm start and runs the arm's steps."""

    def __init__(self, ctx: RankContext, run_dir: Path, arm: Arm, opts: GRPOOptions, shape: Any,
                 task: task_mod.AdditionTask, engine: Optional[Engine], warm: Optional[WarmStartOptions] = None) -> None:
        from r3bridge.megatron import Replayer

        self.ctx, self.run_dir, self.arm, self.opts, self.task = ctx, run_dir, arm, opts, task
        self.cfg = shape.hf_config()
        self.hf_ref = torch.load(run_dir / "warmstart" / "state.pt", map_location="cpu", weights_only=True)
        self.te = opts.layer_spec == "te"
        bf16 = opts.trainer_dtype == "bf16"
        spec = spec_from_hf(self.cfg)
        aux, z = 0.0, None
        if opts.router_losses > 0:
            if warm is None:
                raise ValueError("router_losses > 0 needs the warm start's options")
            aux, z = trainer_router_losses(warm, self.cfg, opts.router_losses)
        extra = {**spec.extra_config, "moe_aux_loss_coeff": aux, "moe_z_loss_coeff": z}
        if bf16:
            extra.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
        spec = dataclasses.replace(spec, layer_spec=opts.layer_spec, extra_config=extra, moe_aux_loss_coeff=aux)
        chunks = build_model_chunks(spec, ctx)
        reference = hf_to_mcore(self.hf_ref, self.cfg)
        load_reference_state(chunks, to_te_names(reference) if self.te else reference, ctx)
        self.trainer = [c.to(opts.device, dtype=torch.bfloat16 if bf16 else torch.float32) for c in chunks]
        self.rep = Replayer(self.trainer, expect_moe_layer_ids=[i for i, f in enumerate(spec.moe_layer_freq) if f])
        self.optim = MainWeightsAdam([p for c in self.trainer for p in c.parameters()], opts.lr, opts.grad_clip)
        self.fwd_logits = make_forward_step(ctx, thd=self.te, collect_logits=True)
        self.engine = engine
        self.mini_batches = opts.mini_batches if arm.mini_batches is None else arm.mini_batches
        self.gpu_util_unavailable: Optional[str] = None
        self.num_experts = int(self.cfg.num_experts)
        self.moe_ids = list(self.rep.layout.moe_layer_ids)

    # -------------------------------------------------------------------------- checkpoints
    @property
    def ckpt_path(self) -> Path:
        return self.run_dir / "ckpt" / f"{self.arm.name}.pt"

    def save(self, step: int) -> None:
        self.ckpt_path.parent.mkdir(exist_ok=True)
        tmp = self.ckpt_path.with_suffix(".tmp")
        torch.save({"step": step, "trainer": [c.state_dict() for c in self.trainer],
                    "optim": self.optim.state_dict()}, tmp)
        os.replace(tmp, self.ckpt_path)

    def restore(self) -> int:
        """The step to start from: after the checkpoint's, or 0 without one."""
        if not self.ckpt_path.exists():
            return 0
        state = torch.load(self.ckpt_path, map_location=self.opts.device, weights_only=False)
        for c, s in zip(self.trainer, state["trainer"]):
            c.load_state_dict(s, strict=False)
        self.optim.load_state_dict(state["optim"])
        return int(state["step"]) + 1

    # ------------------------------------------------------------------------------ passes
    def _pass(self, action: Action, source: Optional[str], batches: list, ids_of: dict, routes_of: dict,
              probe: bool = False, record_weights: bool = False):
        """One forward-only schedule run over ``batches``: (results, replay step, probe or None)."""
        prb = RoutingProbe(self.trainer, include_mtp=False) if probe else None
        for c in self.trainer:
            c.eval()
        try:
            with prb if prb is not None else contextlib.nullcontext():
                with self.rep.open_pass(action, forward_only=True, route_kind=source,
                                        record_weights=record_weights) as st:
                    res = run_schedule(self.trainer, batches, _install(st, self.fwd_logits, routes_of, ids_of),
                                       forward_only=True)
        finally:
            for c in self.trainer:
                c.train()
        return res, st, prb

    def _engine_hf_state(self) -> dict[str, torch.Tensor]:
        # one rank: the weights stay on the trainer's device and reach the engine device to device
        full = gather_full_state(self.trainer, self.ctx, on_device=self.ctx.world_size == 1)
        return mcore_to_hf(from_te_names(full) if self.te else full, self.cfg, self.hf_ref)

    @torch.no_grad()
    def _self_sample(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """The noise floor's sampling: the trainer's forward on the growing sequences."""
        gen = torch.Generator(device=self.opts.device).manual_seed(seed)
        seqs = [list(p) for p in prompts]
        responses: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        for _ in range(self.task.max_response_len):
            if not live:
                break
            b = batch_to(packed_from_tokens([seqs[i] for i in live]), self.opts.device)
            res, _, _ = self._pass(Action.NATIVE, None, [b], {id(b): live}, {})
            last = (b.cu_seqlens_padded[:-1] + torch.as_tensor(b.seq_lens, device=b.input_ids.device) - 1).long()
            probs = torch.softmax(res[0].logits[last].float() / self.opts.temperature, -1)
            tokens = torch.multinomial(probs, 1, generator=gen).squeeze(-1).tolist()
            for i, t in zip(live, tokens):
                seqs[i].append(int(t))
                responses[i].append(int(t))
            live = [i for i in live if responses[i][-1] != task_mod.EOS]
        return responses

    # -------------------------------------------------------------------------------- step
    def rollout(self, step: int, timing: dict[str, float]) -> tuple[Samples, list]:
        o, arm, task = self.opts, self.arm, self.task
        t = time.perf_counter()
        if arm.engine != "self":
            self.engine.load_hf_state(self._engine_hf_state())
        timing["update_weights"] = time.perf_counter() - t
        t = time.perf_counter()
        problems = task.sample(o.prompts, np.random.default_rng([arm.seed, step]))
        problems = [p for p in problems for _ in range(o.group)]
        prompts = [p.prompt_ids for p in problems]
        seed = zlib.crc32(f"{arm.seed}:{step}".encode())
        if arm.engine == "self":
            responses = self._self_sample(prompts, seed)
            comps = None
        else:
            comps = self.engine.generate(prompts, max_new_tokens=task.max_response_len, seed=seed,
                                         eos_token_id=task_mod.EOS, temperature=o.temperature)
            responses = [c.output_ids for c in comps]
        rewards = np.array([task.reward(p, r) for p, r in zip(problems, responses)], dtype=np.float64)
        s = Samples(prompts, responses, [], rewards, _advantages(rewards, o.group))
        lp_groups = np.array_split(np.arange(len(s)), o.logprob_micro_batches)
        lp_batches = [_pack(s, g, o.device) for g in lp_groups]
        if comps is not None:
            s.rollout_lp = [torch.tensor(c.logprobs, dtype=torch.float32) for c in comps]
            s.routes = ReplayBatch.from_vllm([c.routed_experts for c in comps], num_experts=self.num_experts,
                                             moe_layer_ids=self.engine.moe_layer_ids)
        else:
            s.rollout_lp, s.routes = self._self_score(s, lp_groups, lp_batches)
        timing["gen"] = time.perf_counter() - t
        return s, list(zip(lp_groups, lp_batches))

    def _self_score(self, s: Samples, groups, batches):
        """The noise floor engine's report: log-probs and routes of one forward over the finished
        samples in compute_log_prob's packing, routes handed over in vLLM's format."""
        ids_of = {id(b): list(map(int, g)) for g, b in zip(groups, batches)}
        res, st, _ = self._pass(Action.RECORD, None, batches, ids_of, {})
        lp: list[torch.Tensor] = [torch.empty(0)] * len(s)
        for g, b, r in zip(groups, batches, res):
            full = _logprobs(r.logits, b.labels).cpu()
            for sl, i in zip(_response_slices(s, g, b), g):
                lp[int(i)] = full[sl]
        rec = st.recorded.select(list(range(len(s))))
        arrays = []
        starts = np.cumsum([0, *rec.rows_per_seq])
        for i in range(len(s)):
            rows = len(s.prompts[i]) + len(s.responses[i]) - 1       # vLLM: the last token is never fed
            a = np.zeros((rows, int(self.cfg.num_hidden_layers), rec.topk), dtype=np.uint8)
            a[:, rec.layer_ids] = rec.routes[starts[i]:starts[i] + rows].numpy()
            arrays.append(a)
        return lp, ReplayBatch.from_vllm(arrays, num_experts=self.num_experts, moe_layer_ids=self.moe_ids,
                                         engine="self")

    def step(self, step: int) -> dict[str, float]:
        """One GRPO step; returns the step's log line."""
        t_step, cpu_step = time.perf_counter(), time.process_time()
        timing: dict[str, float] = {}
        s, lp = self.rollout(step, timing)
        m: dict[str, float] = {"critic/score/mean": float(s.rewards.mean()),
                               "task/accuracy": float((s.rewards == 1.0).mean()),
                               "response_length/mean": float(np.mean([len(r) for r in s.responses]))}
        util = [self._gpu_utilization()]
        t = time.perf_counter()
        old_lp, recorded = self.compute_log_prob(s, lp, m)
        timing["old_log_prob"] = time.perf_counter() - t
        util.append(self._gpu_utilization())
        t = time.perf_counter()
        self.update(step, s, old_lp, recorded, m)
        timing["update_actor"] = time.perf_counter() - t
        util.append(self._gpu_utilization())
        timing["step"] = time.perf_counter() - t_step
        timing["step_cpu"] = time.process_time() - cpu_step     # this process's CPU time (a shared box: wall / cpu)
        m.update({f"timing_s/{k}": v for k, v in timing.items()})
        if None not in util:
            m["perf/gpu_utilization"] = float(np.mean(util))
        return m

    def _gpu_utilization(self) -> Optional[float]:
        """The whole GPU's busy percentage over NVML's last sample period (every process's
        kernels): side by side, it tells whether the arms will wait for the GPU or for their
        cores. None off the GPU or without NVML (then not logged; ``logs/<arm>.json`` says why)."""
        if self.opts.device != "cuda" or self.gpu_util_unavailable:
            return None
        try:
            return float(torch.cuda.utilization())
        except Exception as e:          # pynvml missing or NVML refusing: a metric less, said once
            self.gpu_util_unavailable = f"{type(e).__name__}: {e}"
            return None

    def compute_log_prob(self, s: Samples, lp: list, m: dict[str, float]):
        """theta_old's log-probs per sample (and R2's recording); logs the train-vs-rollout
        mismatch, the entropy and how often the trainer's own routers chose the engine's experts."""
        plan = arm_plan(self.arm.mode, Phase.OLD_LOG_PROB)
        batches = [b for _, b in lp]
        ids_of = {id(b): list(map(int, g)) for g, b in lp}
        roll_of = {id(b): s.routes.select(ids_of[id(b)]) for b in batches}
        native = plan.route_kind is None
        with RouterInputs(self.trainer) if native else contextlib.nullcontext() as inputs:
            res, st, probe = self._pass(plan.action, plan.route_kind, batches, ids_of,
                                        roll_of if plan.route_kind else {}, probe=native,
                                        record_weights=plan.record_weights)
        old_lp: list[torch.Tensor] = [torch.empty(0)] * len(s)
        sums, ent_sum, ent_n = None, 0.0, 0
        for (g, b), r in zip(lp, res):
            logp_all = torch.log_softmax(r.logits.float(), -1)
            full = logp_all.gather(-1, b.labels[:, None]).squeeze(-1)
            mask = b.loss_mask.bool()
            ent_sum += float(-(logp_all.exp() * logp_all).sum(-1)[mask].sum())
            ent_n += int(mask.sum())
            part = logprob_mismatch_sums(full, _per_token(s, g, b, s.rollout_lp), mask,
                                         cu_seqlens=b.cu_seqlens_padded, exclude_last=False)
            sums = part if sums is None else sums + part
            full = full.cpu()
            for sl, i in zip(_response_slices(s, g, b), g):
                old_lp[int(i)] = full[sl]
        _put_mismatch(m, "actor/r3bridge/old_log_prob/mismatch/", sums)
        m["actor/entropy"] = ent_sum / max(ent_n, 1)
        if probe is not None:       # native routing: compare what the routers chose with the engine
            n = self.rep.layout.num_layers
            tally = {"agree": torch.zeros(n), "total": torch.zeros(n)}
            count_agreement(probe, batches, roll_of, self.rep.layout, self.ctx, tally, grad_enabled=False)
            m["route/native_vs_engine"] = float(tally["agree"].sum() / tally["total"].sum().clamp(min=1))
            for lid in self.moe_ids:
                m[f"route/native_vs_engine/layer{lid}"] = float(tally["agree"][lid] / tally["total"][lid].clamp(min=1))
            margins = inputs.margins(self.cfg.num_experts_per_tok)
            m["route/margin/median"], m["route/margin/below"] = margins["median"], margins["below"]
            for lay in margins["per_layer"]:
                m[f"route/margin/layer{lay['layer']}/median"] = lay["median"]
        else:                       # R3: the driver compares the native top-k with the replayed engine's
            m["route/native_vs_engine"] = st.metrics["r3bridge/agreement/mean"]
            m["actor/r3bridge/old_log_prob/coverage"] = st.metrics["r3bridge/coverage"]
        return old_lp, st.recorded

    def update(self, step: int, s: Samples, old_lp: list[torch.Tensor], recorded: Optional[ReplayBatch],
               m: dict[str, float]) -> None:
        """The samples shuffled into mini-batches, one PPO-clip update each, routed per the plan;
        logs the updates' mismatch with the rollout, the PPO statistics and the gradient norms."""
        o, plan = self.opts, arm_plan(self.arm.mode, Phase.UPDATE)
        order = np.random.default_rng([self.arm.seed, step, 1]).permutation(len(s))
        adv = [torch.full((len(r),), float(a)) for r, a in zip(s.responses, s.advantages)]
        sums, norms, stats, cov, agree, weights = None, [], [], [], [], np.zeros(2)
        m["actor/mini_batches"] = self.mini_batches
        for u, g in enumerate(np.array_split(order, self.mini_batches)):
            ids = list(map(int, g))
            b = _pack(s, ids, o.device)
            per = {id(b): {"old_lp": _per_token(s, ids, b, old_lp), "adv": _per_token(s, ids, b, adv),
                           "mask": b.loss_mask.float()}}
            ref = {}
            if plan.route_kind == "recorded":
                ref = {id(b): recorded.select(ids)}
            elif plan.route_kind == "rollout":
                ref = {id(b): s.routes.select(ids)}
            out: list[dict] = []
            self.optim.zero_grad()
            with self.rep.open_pass(plan, forward_only=False) as us:
                run_schedule(self.trainer, [b], _install(us, _ppo_forward_step(self.te, per, o.clip, out), ref,
                                                         {id(b): ids}), forward_only=False)
            norms.append(self.optim.step())
            stats.append(out[0])
            if plan.route_kind:
                cov.append(us.metrics["r3bridge/coverage"])
                agree.append(us.metrics["r3bridge/agreement/mean"])
            if plan.replay_weights:
                weights += [us.metrics["r3bridge/weights/replayed_pairs"], us.metrics["r3bridge/weights/live_pairs"]]
            mask = b.loss_mask.bool()
            part = logprob_mismatch_sums(out[0]["logp"], _per_token(s, ids, b, s.rollout_lp), mask,
                                         cu_seqlens=b.cu_seqlens_padded, exclude_last=False)
            sums = part if sums is None else sums + part
            if u == 0:   # weights still theta_old: only routing and kernels can move the log-probs
                shift = (out[0]["logp"] - per[id(b)]["old_lp"]).abs()[mask]
                m["actor/first_update/abs_log_ratio"] = float(shift.mean())
        _put_mismatch(m, "actor/r3bridge/update/mismatch/", sums)
        _take_router_losses(m, self.mini_batches, len(self.moe_ids))
        m.update({"actor/pg_loss": float(np.mean([x["loss"] for x in stats])),
                  "actor/pg_clipfrac": float(np.mean([x["clipfrac"] for x in stats])),
                  "actor/ppo_kl": float(np.mean([x["ppo_kl"] for x in stats])),
                  "actor/grad_norm": float(np.mean(norms)),
                  "actor/grad_norm/p50": float(np.percentile(norms, 50)),
                  "actor/grad_norm/p99": float(np.percentile(norms, 99)),
                  "actor/grad_norm/max": float(np.max(norms))})
        if cov:
            m["actor/r3bridge/update/coverage"] = float(np.mean(cov))
            m["actor/r3bridge/update/agreement/mean"] = float(np.mean(agree))
        if plan.replay_weights:     # (token, MoE layer) pairs whose combine weights were replayed / live
            m["actor/r3bridge/update/weights/replayed_pairs"] = float(weights[0])
            m["actor/r3bridge/update/weights/live_pairs"] = float(weights[1])


def _put_mismatch(m: dict[str, float], prefix: str, sums: torch.Tensor) -> None:
    mm = mismatch_from_sums(sums.cpu(), prefix="")
    for k in ("k3_kl", "abs_diff", "F2", "F5"):
        m[prefix + k] = mm[f"mismatch/{k}"]


# ----------------------------------------------------------------------------- the process
def run_arms(ctx: RankContext, run_dir: str, names: Sequence[str]) -> dict[str, str]:
    """A rank's work (:func:`r3bridge.testing.harness.dist.spawn`): the named arms of the run one after the
    other, sharing one engine. Returns each arm's final status."""
    run = RunConfig.load(Path(run_dir))
    root = Path(run_dir)
    arms = [run.arm(n) for n in names]
    engines: dict[str, Any] = {}
    cfg = run.shape.hf_config()
    o = run.grpo
    n, max_len = o.prompts * o.group, run.task.max_prompt_len + run.task.max_response_len
    status: dict[str, str] = {}
    for arm in arms:
        if arm.engine not in engines and arm.engine != "self":
            engines[arm.engine] = (HFRollout(cfg, o.device) if arm.engine == "hf"
                                   else _vllm_rollout(root, cfg, o, arm.seed, n, max_len))
    wait_for_warm_start(root, run.deadline)
    for arm in arms:
        status[arm.name] = _run_one(ctx, root, run, arm, engines.get(arm.engine))
    return status


def _run_one(ctx: RankContext, root: Path, run: RunConfig, arm: Arm, engine: Optional[Engine]) -> str:
    meta_path = root / "logs" / f"{arm.name}.json"
    meta: dict[str, Any] = {"arm": asdict(arm), "grpo": asdict(run.grpo), "status": "running",
                            "engine_version": getattr(engine, "version", None), "started": time.time()}
    meta_path.write_text(json.dumps(meta, indent=1))
    runner = ArmRunner(ctx, root, arm, run.grpo, run.shape, run.task, engine, warm=run.warm)
    start = runner.restore() if run.resume else 0
    if run.start_gate:
        (root / "logs" / f"{arm.name}.ready").touch()
        wait_for_gate(Path(run.start_gate), run.deadline)
    log = StepLog(root / "logs" / f"{arm.name}.jsonl", start)
    status, last = "done", 0.0
    try:
        for step in range(start, run.grpo.steps):
            if run.deadline and time.time() + last > run.deadline:
                status = "stopped at the wall-clock bound"
                break
            m = runner.step(step)
            last = m["timing_s/step"]
            if runner.gpu_util_unavailable and "gpu_utilization" not in meta:
                meta["gpu_utilization"] = f"not logged: {runner.gpu_util_unavailable}"
            log.write(step, m)
            meta["steps_done"] = step + 1
            every = run.grpo.checkpoint_every
            if every and (step + 1) % every == 0:
                runner.save(step)
    except BaseException as e:
        status = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        log.close()
        meta.update(status=status, finished=time.time())
        meta_path.write_text(json.dumps(meta, indent=1))
    return status

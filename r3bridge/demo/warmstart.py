"""The evidence run's model and its warm start: a tiny Qwen3-MoE taught the task by supervision.

GRPO needs a policy that already solves part of the task (a group of samples that are all wrong
has no learning signal). A short supervised run on generated problems gives one: the HF
transformers model (plain PyTorch, AdamW, a small load-balancing loss so every expert is used, as
in a pretrained MoE) trained on the answer tokens only. Every arm of the run starts from the
weights it saves; the trainer gets them through :func:`r3bridge.demo.hf_to_mcore.hf_to_mcore`, the
engine as the trainer's weights at step 0.

Accuracy is greedy exact match measured teacher-forced: greedy decoding writes the whole answer
iff the argmax is right at every answer position given the right prefix.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch

from r3bridge.demo import task as task_mod
from r3bridge.demo.hf_engine import tiny_qwen3_moe_config


@dataclass(frozen=True)
class EvidenceModelShape:
    """The evidence model. ``dense_first``: layer 0 is a dense MLP (DeepSeek / Moonlight style);
    else every layer is MoE (Qwen3-30B-A3B style). ``head_dim`` 64: every vLLM attention backend
    takes it."""

    layers: int = 4
    hidden: int = 128
    experts: int = 8
    topk: int = 2
    moe_ffn: int = 128
    dense_ffn: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    dense_first: bool = False

    def hf_config(self) -> Any:
        cfg = tiny_qwen3_moe_config(
            num_layers=self.layers, hidden_size=self.hidden, num_experts=self.experts, topk=self.topk,
            vocab_size=task_mod.VOCAB_SIZE, dense_layers=(0,) if self.dense_first else (),
            num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
            ffn_hidden_size=self.dense_ffn, moe_ffn_hidden_size=self.moe_ffn)
        cfg.bos_token_id, cfg.eos_token_id = task_mod.BOS, task_mod.EOS
        cfg.max_position_embeddings = 64
        return cfg


@dataclass(frozen=True)
class WarmStartOptions:
    """``steps`` at most; every 100 steps the greedy accuracy is measured and training stops once
    it reaches ``target_accuracy`` (GRPO needs room to learn: a policy that is always right gives
    every group the same reward) or after ``max_seconds``."""

    steps: int = 3000
    batch: int = 256
    lr: float = 3e-3
    warmup: int = 30
    aux_loss: float = 0.01      # HF's load-balancing loss coefficient (router_aux_loss_coef)
    seed: int = 0
    eval_problems: int = 512
    target_accuracy: float = 0.6
    max_seconds: float = 150.0


def _lr_at(step: int, opts: WarmStartOptions) -> float:
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    frac = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _answer_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, aux: float):
    out = model(input_ids=ids, output_router_logits=aux > 0)
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1)
    tgt = ids[:, 1:]
    nll = -logp.gather(-1, tgt[..., None]).squeeze(-1)
    m = mask[:, :-1]
    loss = nll[m].mean()
    total = loss + aux * out.aux_loss if aux > 0 and out.aux_loss is not None else loss
    return total, loss, logp.argmax(-1), tgt, m


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, task: task_mod.AdditionTask, n: int, seed: int, device: str) -> float:
    """Fraction of ``n`` fresh problems whose greedy answer is exact (teacher-forced check)."""
    ids, mask = task.sft_batch(n, np.random.default_rng(10_000 + seed))
    ids_t, mask_t = torch.as_tensor(ids, device=device), torch.as_tensor(mask, device=device)
    _, _, pred, tgt, m = _answer_loss(model, ids_t, mask_t, 0.0)
    wrong = (pred != tgt) & m
    return float((~wrong.any(-1)).float().mean())


def warm_start(shape: EvidenceModelShape, task: task_mod.AdditionTask, opts: WarmStartOptions, *, device: str = "cpu",
               log: Callable[[str], None] = lambda s: None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train the HF model from scratch on the task; returns its fp32 state dict (CPU) and stats."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(opts.seed)
    cfg = shape.hf_config()
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = np.random.default_rng(opts.seed)
    t0 = time.time()
    curve = []
    for step in range(opts.steps):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, opts)
        ids, mask = task.sft_batch(opts.batch, rng)
        total, loss, *_ = _answer_loss(model, torch.as_tensor(ids, device=device),
                                       torch.as_tensor(mask, device=device), opts.aux_loss)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 99:
            model.eval()
            acc = greedy_accuracy(model, task, 256, opts.seed, device)
            model.train()
            curve.append((step, float(loss.detach()), acc))
            log(f"[warm start] step {step + 1}/{opts.steps} loss {curve[-1][1]:.4f} greedy accuracy {acc:.3f} "
                f"({time.time() - t0:.0f} s)")
            if acc >= opts.target_accuracy or time.time() - t0 > opts.max_seconds:
                break
    model.eval()
    acc = greedy_accuracy(model, task, opts.eval_problems, opts.seed, device)
    stats = {"greedy_accuracy": acc, "steps": step + 1, "seconds": time.time() - t0, "curve": curve,
             "options": asdict(opts)}
    state = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return state, stats

"""The evidence run's model and its warm start: a tiny Qwen3-MoE taught the task by supervision.

GRPO needs a policy that already solves part of the task (a group of samples that are all wrong
has no learning signal). A short supervised run on generated problems gives one: the HF
transformers model (plain PyTorch, AdamW, a small load-balancing loss so every expert is used, as
in a pretrained MoE) trained on the answer tokens only. Every arm of the run starts from the
weights it saves; the trainer gets them through :func:`r3bridge.demo.hf_to_mcore.hf_to_mcore`, the
engine as the trainer's weights at step 0.

**Router margins.** Whether a bf16 engine and a bf16 trainer pick the same experts depends on how
far apart a token's k-th and (k+1)-th router logits are (:func:`router_margins`). A trained large
MoE has narrow margins: many experts, a load-balancing loss that pulls the routers towards using
all of them evenly, a router z-loss that holds each token's logsumexp near 0 (so its logits sit
near -log(experts), where bf16's grid is coarse next to the margins). ``aux_loss`` (HF's
load-balancing coefficient) and ``router_z_loss`` (ST-MoE's z-loss, per MoE layer, as megatron's
``moe_z_loss_coeff``) make the warm-started router like that by training; the margins it ends with
are measured and kept in the stats.

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

    def __post_init__(self) -> None:
        where = "the evidence model"
        if self.layers < (2 if self.dense_first else 1):
            raise ValueError(f"{where}: layers must be >= {2 if self.dense_first else 1}, got {self.layers}")
        if not 2 <= self.experts <= 512:
            raise ValueError(f"{where}: experts must be in 2..512, got {self.experts}")
        if not 1 <= self.topk <= self.experts:
            raise ValueError(f"{where}: topk must be in 1..experts ({self.experts}), got {self.topk}")
        # vLLM's attention backends take head sizes 64, 128, 256 (all do); its fused-MoE and the
        # bf16 GEMMs want dimensions in multiples of 16; hidden carries the heads' q/k norms
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"{where}: head_dim must be 64, 128 or 256 (vLLM's attention backends), got {self.head_dim}")
        for name in ("hidden", "moe_ffn", "dense_ffn"):
            v = getattr(self, name)
            if v < 32 or v % 16:
                raise ValueError(f"{where}: {name} must be a multiple of 16 and >= 32, got {v}")
        if self.heads % self.kv_heads:
            raise ValueError(f"{where}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @property
    def moe_layers(self) -> int:
        return self.layers - (1 if self.dense_first else 0)

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
    router_z_loss: float = 0.0  # z-loss coefficient per MoE layer: mean logsumexp(router logits)^2
    seed: int = 0
    eval_problems: int = 512
    target_accuracy: float = 0.6
    max_seconds: float = 150.0
    # transformers' expert kernels: "grouped_mm" runs all experts of a layer in one grouped GEMM
    # (its default, "eager", loops over them in Python: a few kernels per expert and layer, which
    # bounds a deep many-expert model's warm start on a GPU); the same loss and gradients (CPU-checked)
    experts_implementation: str = "grouped_mm"

    def __post_init__(self) -> None:
        if self.experts_implementation not in ("grouped_mm", "eager"):
            raise ValueError(f"warm start: experts_implementation must be grouped_mm or eager, got "
                             f"{self.experts_implementation!r}")
        if self.aux_loss < 0 or self.router_z_loss < 0 or self.lr <= 0:
            raise ValueError(f"warm start: aux_loss and router_z_loss must be >= 0 and lr > 0, got "
                             f"{self.aux_loss}, {self.router_z_loss}, {self.lr}")


MARGIN_BELOW = 1e-2     # a margin under this is "narrow": bf16 rounds a logit of 2-4 in steps of 1/64


def _lr_at(step: int, opts: WarmStartOptions) -> float:
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    frac = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _answer_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, aux: float, z_loss: float = 0.0):
    out = model(input_ids=ids, output_router_logits=aux > 0 or z_loss > 0)
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1)
    tgt = ids[:, 1:]
    nll = -logp.gather(-1, tgt[..., None]).squeeze(-1)
    m = mask[:, :-1]
    loss = nll[m].mean()
    total = loss + aux * out.aux_loss if aux > 0 and out.aux_loss is not None else loss
    if z_loss > 0:
        # ST-MoE's router z-loss on the real tokens, summed over MoE layers (megatron's moe_z_loss_coeff)
        real = (ids != task_mod.PAD).reshape(-1)
        total = total + z_loss * sum(torch.logsumexp(r.float()[real], -1).square().mean() for r in out.router_logits)
    return total, loss, logp.argmax(-1), tgt, m


def margins_of(logits_per_layer: list[torch.Tensor], layer_ids: list[int], topk: int,
               below: float = MARGIN_BELOW) -> dict[str, Any]:
    """Router margins: per token, the k-th largest router logit minus the (k+1)-th (softmax is
    monotonic, so this is also the gap in log-probability); per MoE layer the median and the
    fraction of tokens under ``below``, and both over all layers. ``logits_per_layer``: [tokens,
    experts] per MoE layer, in ``layer_ids`` order."""
    per_layer, gaps_all = [], []
    for lid, logits in zip(layer_ids, logits_per_layer):
        if logits.shape[-1] <= topk or logits.shape[0] == 0:
            continue                      # top-k of all experts: no boundary to flip
        top = torch.topk(logits.float(), topk + 1, dim=-1).values
        gap = (top[:, topk - 1] - top[:, topk]).cpu()
        gaps_all.append(gap)
        per_layer.append({"layer": int(lid), "median": float(gap.median()), "below": float((gap < below).float().mean())})
    if not gaps_all:
        return {"threshold": below, "median": math.nan, "below": math.nan, "per_layer": []}
    g = torch.cat(gaps_all)
    return {"threshold": below, "median": float(g.median()), "below": float((g < below).float().mean()),
            "per_layer": per_layer}


@torch.no_grad()
def router_margins(model: torch.nn.Module, task: task_mod.AdditionTask, n: int, seed: int, device: str) -> dict[str, Any]:
    """:func:`margins_of` of the HF model's routers over the real tokens of ``n`` fresh problems."""
    from r3bridge.hf import moe_layer_ids_from_hf_config

    ids, _ = task.sft_batch(n, np.random.default_rng(20_000 + seed))
    ids_t = torch.as_tensor(ids, device=device)
    out = model(input_ids=ids_t, output_router_logits=True)
    real = (ids_t != task_mod.PAD).reshape(-1)
    layer_ids = moe_layer_ids_from_hf_config(model.config)
    return margins_of([r[real] for r in out.router_logits], layer_ids, int(model.config.num_experts_per_tok))


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

    cfg = shape.hf_config()

    def build(impl: str):
        torch.manual_seed(opts.seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, experts_implementation=impl).to(device)
        model.train()
        return model, torch.optim.AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.98), weight_decay=0.01)

    impl = opts.experts_implementation
    model, opt = build("eager") if impl == "eager" else (None, None)
    rng = np.random.default_rng(opts.seed)
    t0 = time.time()
    curve = []

    def train_step(step: int, ids_t: torch.Tensor, mask_t: torch.Tensor) -> torch.Tensor:
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, opts)
        total, loss, *_ = _answer_loss(model, ids_t, mask_t, opts.aux_loss, opts.router_z_loss)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    for step in range(opts.steps):
        ids, mask = task.sft_batch(opts.batch, rng)
        ids_t, mask_t = torch.as_tensor(ids, device=device), torch.as_tensor(mask, device=device)
        if step == 0 and model is None:
            try:
                model, opt = build(impl)
                loss = train_step(step, ids_t, mask_t)
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
                # by design, said and kept in the stats: a torch / transformers without fp32 grouped
                # GEMMs here; the first step is taken again from the same initial weights
                log(f"[warm start] experts_implementation {impl!r} failed ({type(e).__name__}: {str(e)[:200]}); "
                    f"training with 'eager' (a Python loop over the experts: slower)")
                impl = f"eager (after {impl}: {type(e).__name__})"
                model, opt = build("eager")
                loss = train_step(step, ids_t, mask_t)
        else:
            loss = train_step(step, ids_t, mask_t)
        if time.time() - t0 > opts.max_seconds:      # the bound holds between checks too (a deep model's steps are slow)
            log(f"[warm start] stopped at step {step + 1}: the {opts.max_seconds:.0f} s bound")
            break
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
    margins = router_margins(model, task, 256, opts.seed, device)
    log(f"[warm start] router margins (k-th minus (k+1)-th logit): median {margins['median']:.3g}, "
        f"{margins['below']:.1%} of tokens under {margins['threshold']:g}")
    stats = {"greedy_accuracy": acc, "steps": step + 1, "seconds": time.time() - t0, "curve": curve,
             "experts_implementation": impl,
             "router_margins": margins, "shape": asdict(shape), "options": asdict(opts)}
    state = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return state, stats

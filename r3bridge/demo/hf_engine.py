"""A real, independent rollout engine for R3 tests and the demo: HuggingFace transformers.

vLLM and SGLang cannot run on the CPU harness, but transformers can, and it is the reference
implementation both engines check their MoE models against: its own attention and expert
kernels, its own routing code, its own token bookkeeping in ``generate()`` (left-padded batched
prefill, one decode forward per sampled token, the last sampled token never fed back).

:class:`HFEngine` wraps a transformers MoE causal LM and records, for every request, the experts
each MoE layer chose for every token it fed forward, exactly as the engines report them:

* vLLM: ``routed_experts`` ``[prompt + generated - 1, num_hidden_layers, topk]`` uint8, dense
  layers as zero rows (:attr:`Completion.routed_experts`);
* SGLang: ``meta_info`` with ``prompt_tokens``, ``completion_tokens`` and ``routed_experts`` as
  base64 of flat little-endian int32 (:meth:`Completion.meta_info`).

The routes are read, not recomputed: a forward pre-hook on each MoE block's ``experts`` module
(public ``torch.nn.Module`` API) receives the top-k indices the HF router just computed and passes
them on untouched. Nothing here re-implements routing.

This is not a serving engine: no continuous batching, no paged KV cache, no speculative decoding,
one process. It is a second implementation of the same model whose routes land on the trainer's
tokens only if r3bridge's bookkeeping (ingest, stitch, shard) is right.
"""
from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from r3bridge.hf import moe_layer_ids_from_hf_config, num_experts_from_hf_config, topk_from_hf_config

__all__ = ["Completion", "HFEngine", "tiny_qwen3_moe_config", "tiny_deepseek_v3_config", "build_hf_model"]

PAD_ID = 0


def tiny_qwen3_moe_config(*, num_layers: int = 4, hidden_size: int = 64, num_experts: int = 8, topk: int = 2,
                          vocab_size: int = 256, dense_layers: Sequence[int] = (0,), num_heads: int = 4,
                          num_kv_heads: int = 2, head_dim: int = 16, ffn_hidden_size: int = 128,
                          moe_ffn_hidden_size: int = 64) -> Any:
    """A tiny Qwen3-MoE: GQA with q/k norms, RoPE, RMSNorm, SwiGLU experts, softmax top-k with
    renormalised top-k weights; ``dense_layers`` via ``mlp_only_layers`` (dense-first)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=ffn_hidden_size,
        moe_intermediate_size=moe_ffn_hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        num_experts=num_experts, num_experts_per_tok=topk, norm_topk_prob=True,
        mlp_only_layers=list(dense_layers), decoder_sparse_step=1, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False, attention_bias=False,
        output_router_logits=False, pad_token_id=PAD_ID, bos_token_id=None, eos_token_id=None,
        attn_implementation="sdpa")


def tiny_deepseek_v3_config(*, num_layers: int = 4, first_k_dense: int = 1, num_experts: int = 8, topk: int = 2,
                            vocab_size: int = 256, hidden_size: int = 64) -> Any:
    """A tiny DeepSeek-V3: MLA, first-k-dense, sigmoid scores with an expert bias
    (``e_score_correction_bias``), group-limited top-k, a shared expert."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=num_experts, num_experts_per_tok=topk, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, first_k_dense_replace=first_k_dense, norm_topk_prob=True,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
        max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=PAD_ID, bos_token_id=None,
        eos_token_id=None, attn_implementation="sdpa")


# As in the demo's megatron model: a freshly initialised tiny model predicts a near-uniform next
# token and its experts barely move the residual stream, so which expert a token visits would
# not matter. Trained MoE models are the opposite; scaling experts and the output layer gives the
# tiny model that shape (peaked predictions, experts that matter).
SCALES = {"mlp.experts.": 8.0, "lm_head.": 4.0}


@torch.no_grad()
def build_hf_model(config: Any, *, seed: int = 1234, init_std: float = 0.02, router_std: float = 0.02,
                   dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The HF causal LM for ``config`` with weights drawn from (seed, parameter name) only, so the
    same seed gives the same model in every process; norms are ones, expert biases zero."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, p in model.named_parameters():
        if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] or name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        if "e_score_correction_bias" in name or name.endswith(".bias"):
            p.zero_()
            continue
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        std = router_std if name.endswith("mlp.gate.weight") else init_std
        p.copy_(torch.randn(p.shape, generator=g) * std)
        for key, scale in SCALES.items():
            if key in name:
                p.mul_(scale)
    for name, b in model.named_buffers():
        if "e_score_correction_bias" in name:
            b.zero_()
    model.eval()
    return model.to(dtype)


@dataclass
class Completion:
    """One request's result, in both engines' formats."""

    prompt_ids: list[int]
    output_ids: list[int]
    routed_experts: np.ndarray          # vLLM: [prompt + generated - 1, num_hidden_layers, topk] uint8
    logprobs: list[float]               # engine log-prob of each output token (sampling distribution)
    finish_reason: str                  # "length" (max_new_tokens reached) or "stop" (eos)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def meta_info(self) -> dict[str, Any]:
        """SGLang's ``meta_info`` for this request (``--enable-return-routed-experts``)."""
        flat = np.ascontiguousarray(self.routed_experts.astype("<i4")).reshape(-1)
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.output_ids),
                "routed_experts": base64.b64encode(flat.tobytes()).decode("ascii"),
                "finish_reason": {"type": self.finish_reason}}


class _RouteRecorder:
    """Forward pre-hooks on every MoE block's ``experts`` module: each call appends the top-k
    indices the HF router computed (``[tokens, topk]``) for that layer."""

    def __init__(self, model: torch.nn.Module, moe_layer_ids: Sequence[int]):
        layers = model.model.layers
        self.calls: dict[int, list[torch.Tensor]] = {i: [] for i in moe_layer_ids}
        self._handles = []
        for i in moe_layer_ids:
            experts = getattr(layers[i].mlp, "experts", None)
            if experts is None:
                raise TypeError(f"layer {i} of {type(model).__name__} has no mlp.experts module")
            self._handles.append(experts.register_forward_pre_hook(self._hook(i)))

    def _hook(self, layer: int):
        def hook(_module: torch.nn.Module, args: tuple) -> None:
            self.calls[layer].append(args[1].detach().to("cpu", torch.int64).clone())
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class HFEngine:
    """Batched sampling with a transformers MoE causal LM, routes recorded per request."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int = PAD_ID):
        self.model = model
        cfg = model.config
        self.pad_token_id = pad_token_id
        self.num_layers = int(cfg.num_hidden_layers)
        self.moe_layer_ids = moe_layer_ids_from_hf_config(cfg)
        self.num_experts = num_experts_from_hf_config(cfg)
        self.topk = int(topk_from_hf_config(cfg))
        if self.num_experts > 256:
            raise ValueError("the engine writes uint8 routes (vLLM's format up to 256 experts)")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int], seed: int = 0,
                 temperature: float = 1.0, eos_token_id: int | None = None) -> list[Completion]:
        """Sample continuations of ``prompts`` in one left-padded batch (as engines batch requests).

        ``max_new_tokens`` per request (a request that reaches it finishes with ``"length"``:
        truncated); ``eos_token_id`` ends a request with ``"stop"``. Requests that finish early are
        cut where they finished: their later batch rows are never reported, as a serving engine
        would have dropped them from the batch (rows are independent per request)."""
        n = len(prompts)
        if n == 0:
            return []
        limits = [int(max_new_tokens)] * n if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
        if len(limits) != n or min(limits) < 1:
            raise ValueError("max_new_tokens: one positive limit per prompt")
        plens = [len(p) for p in prompts]
        if min(plens) < 1:
            raise ValueError("every prompt needs at least one token")
        width = max(plens)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((n, width), dtype=torch.int64)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):] = torch.as_tensor(list(p), dtype=torch.int64)
            mask[b, width - len(p):] = 1
        rec = _RouteRecorder(self.model, self.moe_layer_ids)
        try:
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=True,
                temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max(limits),
                eos_token_id=eos_token_id, pad_token_id=self.pad_token_id, output_logits=True,
                return_dict_in_generate=True, use_cache=True)
        finally:
            rec.remove()
        gen = out.sequences[:, width:].cpu()
        steps = gen.shape[1]
        # every sampled token's log-prob in one pass: [steps, n] (one host copy, not one per token)
        logp = torch.log_softmax(torch.stack(list(out.logits)).float() / temperature, -1)
        sampled_lp = logp.gather(-1, out.sequences[:, width:].T[..., None]).squeeze(-1).cpu()
        results = []
        for b in range(n):
            g = min(limits[b], steps)
            toks = gen[b, :g].tolist()
            reason = "length"
            if eos_token_id is not None and eos_token_id in toks:
                g = toks.index(eos_token_id) + 1
                toks, reason = toks[:g], "stop"
            routes = np.zeros((plens[b] + g - 1, self.num_layers, self.topk), dtype=np.uint8)
            for lid, calls in rec.calls.items():
                routes[:, lid] = self._rows(calls, b, n, width, plens[b], g).numpy().astype(np.uint8)
            lp = sampled_lp[:g, b].tolist()
            results.append(Completion(list(map(int, prompts[b])), toks, routes, lp, reason))
        return results

    @staticmethod
    def _rows(calls: list[torch.Tensor], b: int, n: int, width: int, plen: int, g: int) -> torch.Tensor:
        """Request ``b``'s rows of one layer: its prompt rows of the prefill (left padding
        skipped), then one row per decode step that fed one of its sampled tokens (``g - 1``)."""
        if len(calls) < g:
            raise RuntimeError(f"generate() made {len(calls)} forward calls, expected at least {g}")
        prefill = calls[0].view(n, -1, calls[0].shape[-1])
        if prefill.shape[1] != width:
            raise RuntimeError(f"prefill routed {prefill.shape[1]} positions per request, expected {width}")
        rows = [prefill[b, width - plen:]]
        for c in calls[1:g]:
            rows.append(c.view(n, -1, c.shape[-1])[b])
        return torch.cat(rows)

    # ----------------------------------------------------------------------------- weights
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take new weights (e.g. the trainer's, converted) in the engine's dtype."""
        with torch.no_grad():
            own = self.model.state_dict()
            missing = sorted(set(own) - set(state))
            if missing:
                raise KeyError(f"engine weights missing: {missing[:5]}")
            for k, v in own.items():
                v.copy_(state[k].to(v.dtype))

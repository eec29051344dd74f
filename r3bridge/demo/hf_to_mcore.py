"""The HF engine's weights in the harness's megatron-core model, and back.

``spec_from_hf(config)`` gives the :class:`~r3bridge.testing.harness.models.ModelSpec` of the same
architecture (RMSNorm, GQA with q/k norms, RoPE, SwiGLU, softmax top-k router); ``hf_to_mcore``
maps an HF state dict to the harness's *canonical* full state (global layer and expert ids, full
shapes), which :func:`r3bridge.testing.harness.models.load_reference_state` slices for any parallel layout;
``mcore_to_hf`` is the inverse (the demo pushes the trainer's weights to the engine with it).
Both speak the local layer spec's names; :func:`to_te_names` / :func:`from_te_names` rename them
for the Transformer Engine layer spec (``ModelSpec(layer_spec="te")``).

Layouts that differ between the two (megatron's, from its module code):

* ``linear_qkv``: per query group ``g``, the group's query heads, then its key head, then its value
  head, concatenated over groups (``[ng * (nh/ng + 2) * d, h]``);
* ``linear_fc1`` of a gated MLP / expert: ``[gate; up]`` (HF experts already store ``gate_up_proj``
  that way; the dense MLP has separate ``gate_proj`` / ``up_proj``);
* the router: megatron's ``softmax`` score function with ``moe_router_pre_softmax=False`` takes the
  top-k of the logits and softmaxes those k, which is HF's softmax / top-k / renormalise
  (``norm_topk_prob=True``); without renormalising it is megatron's pre-softmax.

With ``attention='identity'`` (the MoE-only layers context parallelism needs on CPU, see
docs/testing-harness.md) the attention weights are dropped and the HF model must have a zero
``o_proj`` (:func:`zero_attention`): then both compute exactly ``x + MoE(norm(x))`` per layer.
"""
from __future__ import annotations

import re
from typing import Any, Literal, Sequence

import torch

from r3bridge.hf import moe_layer_ids_from_hf_config
from r3bridge.testing.harness.data import PackedBatch, make_packed_batch
from r3bridge.testing.harness.models import ModelSpec

__all__ = ["spec_from_hf", "hf_to_mcore", "mcore_to_hf", "to_te_names", "from_te_names", "zero_attention",
           "packed_from_tokens", "router_settings"]

Attention = Literal["real", "identity"]


def _check_supported(cfg: Any) -> None:
    if getattr(cfg, "model_type", None) != "qwen3_moe":
        raise NotImplementedError(f"hf_to_mcore converts Qwen3-MoE only, got model_type {cfg.model_type!r}")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "tie_word_embeddings", False):
        raise NotImplementedError("attention biases / tied embeddings are not converted")


def spec_from_hf(cfg: Any, *, attention: Attention = "real", seed: int = 1234) -> ModelSpec:
    """The megatron-core model of the same architecture as the HF config."""
    import torch.nn.functional as F

    _check_supported(cfg)
    moe = set(moe_layer_ids_from_hf_config(cfg))
    n = int(cfg.num_hidden_layers)
    return ModelSpec(
        num_layers=n, hidden_size=int(cfg.hidden_size), ffn_hidden_size=int(cfg.intermediate_size),
        moe_ffn_hidden_size=int(cfg.moe_intermediate_size), num_attention_heads=int(cfg.num_attention_heads),
        vocab_size=int(cfg.vocab_size), max_sequence_length=int(cfg.max_position_embeddings),
        num_moe_experts=int(cfg.num_experts), moe_router_topk=int(cfg.num_experts_per_tok),
        moe_layer_freq=[1 if i in moe else 0 for i in range(n)], attention=attention, seed=seed,
        position_embedding_type="rope", rotary_base=int(_rope_theta(cfg)),
        extra_config=dict(
            normalization="RMSNorm", layernorm_epsilon=float(cfg.rms_norm_eps), qk_layernorm=True,
            num_query_groups=int(cfg.num_key_value_heads), kv_channels=int(cfg.head_dim),
            gated_linear_unit=True, activation_func=F.silu,
            moe_router_score_function="softmax", moe_router_pre_softmax=not bool(cfg.norm_topk_prob),
            moe_router_topk_scaling_factor=None, moe_router_num_groups=None, moe_router_group_topk=None,
        ))


def _rope_theta(cfg: Any) -> float:
    rp = getattr(cfg, "rope_parameters", None) or {}
    return float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def router_settings(tc: Any) -> dict[str, Any]:
    """The routing-relevant fields of a megatron TransformerConfig (what must match HF)."""
    return {k: getattr(tc, k) for k in ("moe_router_score_function", "moe_router_pre_softmax",
                                        "moe_router_topk", "moe_router_topk_scaling_factor",
                                        "moe_router_num_groups", "moe_router_group_topk",
                                        "moe_router_enable_expert_bias", "num_moe_experts")}


def _fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], 0)


def hf_to_mcore(hf_state: dict[str, torch.Tensor], cfg: Any, *, attention: Attention = "real") -> dict[str, torch.Tensor]:
    """HF Qwen3-MoE state dict -> the harness's canonical full megatron state (fp32)."""
    _check_supported(cfg)
    s = {k: v.detach().float() for k, v in hf_state.items()}
    nh, ng, d, h = int(cfg.num_attention_heads), int(cfg.num_key_value_heads), int(cfg.head_dim), int(cfg.hidden_size)
    moe = set(moe_layer_ids_from_hf_config(cfg))
    out = {"embedding.word_embeddings.weight": s["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": s["model.norm.weight"],
           "output_layer.weight": s["lm_head.weight"]}
    for i in range(int(cfg.num_hidden_layers)):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        if attention == "real":
            q = s[hp + "self_attn.q_proj.weight"].view(ng, nh // ng * d, h)
            k = s[hp + "self_attn.k_proj.weight"].view(ng, d, h)
            v = s[hp + "self_attn.v_proj.weight"].view(ng, d, h)
            out[mp + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, h)
            out[mp + "self_attention.linear_proj.weight"] = s[hp + "self_attn.o_proj.weight"]
            out[mp + "self_attention.q_layernorm.weight"] = s[hp + "self_attn.q_norm.weight"]
            out[mp + "self_attention.k_layernorm.weight"] = s[hp + "self_attn.k_norm.weight"]
            out[mp + "input_layernorm.weight"] = s[hp + "input_layernorm.weight"]
        elif float(s[hp + "self_attn.o_proj.weight"].abs().max()) != 0.0:
            raise ValueError(f"layer {i}: attention='identity' needs the HF model's o_proj zeroed (zero_attention)")
        out[mp + "pre_mlp_layernorm.weight"] = s[hp + "post_attention_layernorm.weight"]
        if i in moe:
            out[mp + "mlp.router.weight"] = s[hp + "mlp.gate.weight"]
            gu, dn = s[hp + "mlp.experts.gate_up_proj"], s[hp + "mlp.experts.down_proj"]
            for e in range(int(cfg.num_experts)):
                out[mp + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = gu[e]
                out[mp + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = dn[e]
        else:
            out[mp + "mlp.linear_fc1.weight"] = _fc1(s[hp + "mlp.gate_proj.weight"], s[hp + "mlp.up_proj.weight"])
            out[mp + "mlp.linear_fc2.weight"] = s[hp + "mlp.down_proj.weight"]
    return out


def mcore_to_hf(state: dict[str, torch.Tensor], cfg: Any, hf_reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_mcore`. ``hf_reference`` supplies what megatron does not hold
    (the zero attention of an identity-attention model) and the dtypes."""
    nh, ng, d, h = int(cfg.num_attention_heads), int(cfg.num_key_value_heads), int(cfg.head_dim), int(cfg.hidden_size)
    moe = set(moe_layer_ids_from_hf_config(cfg))
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        out[name] = t.to(hf_reference[name].dtype).reshape(hf_reference[name].shape).clone()

    put("model.embed_tokens.weight", state["embedding.word_embeddings.weight"])
    put("model.norm.weight", state["decoder.final_layernorm.weight"])
    put("lm_head.weight", state["output_layer.weight"])
    for i in range(int(cfg.num_hidden_layers)):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        if mp + "self_attention.linear_qkv.weight" in state:
            qkv = state[mp + "self_attention.linear_qkv.weight"].view(ng, (nh // ng + 2) * d, h)
            q, k, v = qkv.split([nh // ng * d, d, d], 1)
            put(hp + "self_attn.q_proj.weight", q.reshape(-1, h))
            put(hp + "self_attn.k_proj.weight", k.reshape(-1, h))
            put(hp + "self_attn.v_proj.weight", v.reshape(-1, h))
            put(hp + "self_attn.o_proj.weight", state[mp + "self_attention.linear_proj.weight"])
            put(hp + "self_attn.q_norm.weight", state[mp + "self_attention.q_layernorm.weight"])
            put(hp + "self_attn.k_norm.weight", state[mp + "self_attention.k_layernorm.weight"])
            put(hp + "input_layernorm.weight", state[mp + "input_layernorm.weight"])
        put(hp + "post_attention_layernorm.weight", state[mp + "pre_mlp_layernorm.weight"])
        if i in moe:
            put(hp + "mlp.gate.weight", state[mp + "mlp.router.weight"])
            ne = int(cfg.num_experts)
            put(hp + "mlp.experts.gate_up_proj",
                torch.stack([state[mp + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(ne)]))
            put(hp + "mlp.experts.down_proj",
                torch.stack([state[mp + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in range(ne)]))
        else:
            gate, up = state[mp + "mlp.linear_fc1.weight"].chunk(2, 0)
            put(hp + "mlp.gate_proj.weight", gate)
            put(hp + "mlp.up_proj.weight", up)
            put(hp + "mlp.down_proj.weight", state[mp + "mlp.linear_fc2.weight"])
    # in the reference's order; what megatron does not hold is the reference's (copied, not shared)
    return {k: out[k] if k in out else v.clone() for k, v in hf_reference.items()}


_LAYER = re.compile(r"(decoder\.layers\.\d+\.)(.*)")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)")


def to_te_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Local-spec canonical names -> the TE layer spec's (same tensors).

    TE fuses the attention's input norm into ``linear_qkv`` (``layer_norm_weight``) and a dense
    MLP's pre-norm into ``linear_fc1``; an MoE layer keeps its ``pre_mlp_layernorm``; TEGroupedMLP
    names expert ``e``'s weights ``experts.linear_fc1.weight<e>`` instead of
    ``experts.local_experts.<e>.linear_fc1.weight``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _LAYER.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        p, rest = m.groups()
        e = _LOCAL_EXPERT.fullmatch(rest)
        if rest == "input_layernorm.weight":
            out[p + "self_attention.linear_qkv.layer_norm_weight"] = t
        elif rest == "pre_mlp_layernorm.weight" and p + "mlp.linear_fc1.weight" in state:   # dense layer
            out[p + "mlp.linear_fc1.layer_norm_weight"] = t
        elif e is not None:
            out[p + f"mlp.experts.{e.group(2)}.weight{e.group(1)}"] = t
        else:
            out[name] = t
    return out


def from_te_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_te_names`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _LAYER.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        p, rest = m.groups()
        e = _GROUPED_EXPERT.fullmatch(rest)
        if rest == "self_attention.linear_qkv.layer_norm_weight":
            out[p + "input_layernorm.weight"] = t
        elif rest == "mlp.linear_fc1.layer_norm_weight":
            out[p + "pre_mlp_layernorm.weight"] = t
        elif e is not None:
            out[p + f"mlp.experts.local_experts.{e.group(2)}.{e.group(1)}.weight"] = t
        else:
            out[name] = t
    return out


@torch.no_grad()
def zero_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Make every HF decoder layer's attention contribute nothing (``o_proj = 0``): the layer is
    then exactly the harness's MoE-only (identity attention) layer."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
    return model


def packed_from_tokens(tokens: Sequence[Sequence[int]], *, align: int = 1, pad_to: int | None = None,
                       loss_from: Sequence[int] | None = None) -> PackedBatch:
    """A packed micro-batch of the given token sequences. ``loss_from[i]``: first token position
    of sequence ``i`` whose log-prob is trained (the response start); default: all but the first."""
    lens = [len(t) for t in tokens]
    b = make_packed_batch(lens, 2, 0, align=align, pad_to=pad_to)
    starts = [0] * len(lens) if loss_from is None else [max(0, int(x) - 1) for x in loss_from]
    b.input_ids.zero_()
    b.labels.zero_()
    b.loss_mask.zero_()
    for i, t in enumerate(tokens):
        off = int(b.cu_seqlens_padded[i])
        toks = torch.as_tensor(list(t), dtype=torch.int64)
        b.input_ids[off:off + len(t)] = toks
        b.labels[off:off + len(t) - 1] = toks[1:]
        b.loss_mask[off + starts[i]:off + len(t) - 1] = 1.0
    return b

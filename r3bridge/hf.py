"""Which decoder layers of a Hugging Face MoE model are MoE: shared by every adapter.

Engines (vLLM, SGLang) report routes for *all* ``num_hidden_layers``, dense ones as zero rows, so
adapters need the MoE layer ids explicitly (never map by "i + offset": field notes 8.4).
The rules below mirror the Hugging Face modelling code of each family (transformers 5.x):

* Qwen2-MoE / Qwen3-MoE / Qwen3-Next / Qwen3-VL-MoE: layer ``i`` is MoE iff
  ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``;
* DeepSeek-V2/V3, Moonlight, Kimi-K2, GLM-4.5/4.6/4.7: ``i >= first_k_dense_replace`` (and, as in
  DeepSeek's own modelling code, ``i % moe_layer_freq == 0`` when the config has that field);
* Llama-4: the explicit ``moe_layers`` list (else every ``interleave_moe_layer_step``-th layer);
* ERNIE-4.5-MoE: ``moe_layer_start_index <= i <= moe_layer_end_index`` and
  ``(i + 1) % moe_layer_interval == 0``;
* Mixtral, gpt-oss, MiniMax and any other config with an expert count and none of the fields
  above: every layer.

A config without any expert count (or with zero experts) is dense: ``[]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from r3bridge.errors import LayerMappingError, RouteShapeError

__all__ = ["moe_layer_ids_from_hf_config", "num_experts_from_hf_config", "topk_from_hf_config",
           "num_hidden_layers_from_hf_config", "text_config", "ModelInfo", "check_topk"]

_EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_TOPK_FIELDS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k")


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def text_config(hf_config: Any) -> Any:
    """The language-model part of a config (VLMs nest it under ``text_config``)."""
    if _get(hf_config, "num_hidden_layers") is None:
        sub = _get(hf_config, "text_config")
        if sub is not None:
            return sub
    return hf_config


def num_experts_from_hf_config(hf_config: Any) -> int:
    """Routed expert count (0 for a dense model)."""
    cfg = text_config(hf_config)
    for name in _EXPERT_FIELDS:
        v = _get(cfg, name)
        if isinstance(v, (list, tuple)):      # e.g. ERNIE-VL: one count per modality
            v = v[0] if v else 0
        if v is not None:
            return int(v)
    return 0


def num_hidden_layers_from_hf_config(hf_config: Any) -> int:
    n = _get(text_config(hf_config), "num_hidden_layers")
    if n is None:
        raise LayerMappingError("hf config has no num_hidden_layers (nor a text_config with one)")
    return int(n)


def topk_from_hf_config(hf_config: Any) -> int | None:
    cfg = text_config(hf_config)
    for name in _TOPK_FIELDS:
        v = _get(cfg, name)
        if v is not None:
            return int(v)
    return None


def moe_layer_ids_from_hf_config(hf_config: Any) -> list[int]:
    """Ascending 0-based ids of the MoE decoder layers (``[]`` for a dense model).

    ``hf_config``: a ``transformers.PretrainedConfig`` or a plain dict (``config.json``).
    """
    cfg = text_config(hf_config)
    n = _get(cfg, "num_hidden_layers")
    if n is None:
        raise LayerMappingError("hf config has no num_hidden_layers (nor a text_config with one)")
    n = int(n)
    if num_experts_from_hf_config(cfg) <= 0:
        return []
    layers = range(n)

    explicit = _get(cfg, "moe_layers")                      # Llama-4
    if explicit is not None:
        ids = sorted(int(i) for i in explicit)
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise LayerMappingError(f"hf config moe_layers {ids} out of range for {n} layers")
        return ids
    step = _get(cfg, "interleave_moe_layer_step")
    if step is not None:
        step = int(step)
        return list(range(step - 1, n, step))

    if _get(cfg, "decoder_sparse_step") is not None or _get(cfg, "mlp_only_layers") is not None:
        step = int(_get(cfg, "decoder_sparse_step", 1) or 1)  # Qwen family
        dense = {int(i) for i in (_get(cfg, "mlp_only_layers") or [])}
        return [i for i in layers if i not in dense and (i + 1) % step == 0]

    if _get(cfg, "first_k_dense_replace") is not None:    # DeepSeek / Moonlight / Kimi / GLM
        k = int(_get(cfg, "first_k_dense_replace"))
        freq = int(_get(cfg, "moe_layer_freq", 1) or 1)
        return [i for i in layers if i >= k and i % freq == 0]

    if _get(cfg, "moe_layer_interval") is not None:       # ERNIE-4.5-MoE
        interval = int(_get(cfg, "moe_layer_interval"))
        start = _get(cfg, "moe_layer_start_index")
        start = 1 if start is None else int(start)        # transformers' Ernie4_5_MoeConfig default
        end = _get(cfg, "moe_layer_end_index")
        end = n - 1 if end is None or int(end) < 0 else int(end)
        return [i for i in layers if start <= i <= end and (i + 1) % interval == 0]

    return list(layers)                                   # Mixtral, gpt-oss, MiniMax, ...


@dataclass
class ModelInfo:
    """What an adapter needs to know about the model to read engine routes: the expert count, the
    MoE layers (engines report every decoder layer, dense ones zero), the decoder layer count and
    top-k. :meth:`from_hf_config` reads them with the rules above."""

    num_experts: int
    moe_layer_ids: list[int] = field(default_factory=list)
    num_layers: int = 0
    topk: Optional[int] = None

    def __post_init__(self) -> None:     # framework configs hand numpy / tensor ints
        self.num_experts, self.num_layers = int(self.num_experts), int(self.num_layers)
        self.moe_layer_ids = [int(i) for i in self.moe_layer_ids]
        self.topk = None if self.topk is None else int(self.topk)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "ModelInfo":
        """``hf_config``: a ``PretrainedConfig``, a ``config.json`` dict, or a model path."""
        if isinstance(hf_config, str):
            from transformers import AutoConfig
            hf_config = AutoConfig.from_pretrained(hf_config, trust_remote_code=True)
        return cls(num_experts=num_experts_from_hf_config(hf_config),
                   moe_layer_ids=moe_layer_ids_from_hf_config(hf_config),
                   num_layers=num_hidden_layers_from_hf_config(hf_config), topk=topk_from_hf_config(hf_config))


def check_topk(field: str, width: int, topk: int | None, *, where: str = "") -> None:
    """Refuse routes carrying ``width`` expert ids per (token, layer) for a top-``topk`` model
    (``None``: unknown, nothing to check), naming the field and both values."""
    if topk is not None and int(width) != int(topk):
        at = f"{where}: " if where else ""
        raise RouteShapeError(f"{at}{field} carries {int(width)} expert ids per token and layer, the model routes "
                              f"top-{int(topk)} (num_experts_per_tok / moe_router_topk): routes from another model "
                              f"or engine setting")

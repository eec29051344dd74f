"""What the layer axis of an engine's routes means, stated, never guessed from its length.

Engines disagree: vLLM and SGLang report every hidden layer (dense ones as zero rows), TensorRT-LLM
reports the MoE layers only, ``(seq_len - 1, num_moe_layers, top_k)`` (TensorRT-LLM #18397, RFC
#17778). A reported axis of ``n`` layers is read as:

* ``"all_hidden"``: entry ``i`` is decoder layer ``i``; ``n == num_hidden_layers``; the MoE layers
  are picked by id (never by "i + offset", field notes 8.4);
* ``"moe_only"``: entry ``j`` is the ``j``-th MoE layer, ``moe_layer_ids[j]``; ``n == len(moe_layer_ids)``.

Unstated (``None``), a length both readings fit while they name different layers is refused
with a message that asks for ``layer_axis``. Expert ids are always logical (pre-EPLB, the
router's ``[0, num_experts)``); an engine that reports physical slots of a redundant-expert
placement must map them back before ingest.
"""
from __future__ import annotations

from typing import Optional, Sequence

from r3bridge.errors import ConfigError, LayerMappingError

ALL_HIDDEN = "all_hidden"
MOE_ONLY = "moe_only"
LAYER_AXES = (ALL_HIDDEN, MOE_ONLY)

__all__ = ["ALL_HIDDEN", "MOE_ONLY", "LAYER_AXES", "check_layer_axis", "axis_columns"]


def check_layer_axis(layer_axis: Optional[str], *, where: str = "layer_axis") -> Optional[str]:
    """``None`` or one of :data:`LAYER_AXES`."""
    if layer_axis is not None and layer_axis not in LAYER_AXES:
        raise ConfigError(f"{where} must be one of {list(LAYER_AXES)} (or null: refuse ambiguous shapes), "
                          f"got {layer_axis!r}")
    return layer_axis


def axis_columns(reported: int, *, layer_axis: Optional[str], moe_layer_ids: Optional[Sequence[int]],
                  num_hidden_layers: Optional[int] = None, field: str = "routes") -> Optional[list[int]]:
    """The columns of a ``reported``-layer axis that hold ``moe_layer_ids``' layers, in that order;
    ``None`` when every column is kept as it is. ``field`` names the routes in errors."""
    check_layer_axis(layer_axis)
    moe = None if moe_layer_ids is None else [int(i) for i in moe_layer_ids]
    hidden = None if num_hidden_layers is None else int(num_hidden_layers)
    if layer_axis == MOE_ONLY:
        if moe is None:
            raise LayerMappingError(f"{field}: layer_axis='moe_only' needs moe_layer_ids (which decoder layer "
                                    f"each reported entry is)")
        if reported != len(moe):
            raise LayerMappingError(f"{field} has {reported} layers, layer_axis='moe_only' expects one per MoE "
                                    f"layer: {len(moe)} ({moe})")
        return None
    if layer_axis == ALL_HIDDEN:
        if hidden is not None and reported != hidden:
            hint = (" (it has one per MoE layer: an engine that reports MoE layers only, e.g. TensorRT-LLM, "
                    "needs layer_axis='moe_only')" if moe is not None and reported == len(moe) else "")
            raise LayerMappingError(f"{field} has {reported} layers but the model has num_hidden_layers={hidden} "
                                    f"(layer_axis='all_hidden'){hint}")
        return _in_range(moe, reported, field)
    # unstated: read the length only where exactly one reading fits, or both name the same layers
    if moe is None:
        return None                       # every reported layer is MoE: both readings are the identity
    fits_all = hidden is None or reported == hidden
    fits_moe = reported == len(moe)
    if fits_moe and fits_all and moe == list(range(reported)):
        return None                       # the MoE layers are the first ones: both readings agree
    if fits_moe:
        raise LayerMappingError(
            f"{field} has {reported} layers, the model's MoE layer count ({moe}), "
            f"{'and num_hidden_layers is not given' if hidden is None else f'not num_hidden_layers={hidden}'}: "
            f"set layer_axis='moe_only' (TensorRT-LLM reports MoE layers only) or 'all_hidden' (vLLM, SGLang); "
            f"r3bridge does not guess the layer axis from its length")
    if not fits_all:
        raise LayerMappingError(f"{field} has {reported} layers, neither num_hidden_layers={hidden} nor the "
                                f"{len(moe)} MoE layers {moe}: engine and trainer describe different models")
    return _in_range(moe, reported, field)


def _in_range(moe: Optional[list[int]], reported: int, field: str) -> Optional[list[int]]:
    if moe is None:
        return None
    if moe and not 0 <= min(moe) <= max(moe) < reported:
        raise LayerMappingError(f"{field}: MoE layers {moe} out of range for {reported} reported layers")
    return moe

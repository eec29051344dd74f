"""Layer ids: 0-based global decoder layer indices, and what a 1-based id looks like when it slips in.

Everywhere in r3bridge a layer id is the 0-based index of a decoder layer in the whole model: the
HF config's index (``mlp_only_layers``, ``first_k_dense_replace``), Megatron's ``layer_number - 1``,
the column of the layer in vLLM / SGLang routes (which report every decoder layer, dense ones as
zero rows). Frameworks that key routes by layer sometimes count from 1; read as 0-based, their ids
point one layer further, at a dense layer's zero rows or at a layer another stage holds. The
errors that follows then name a symptom (a missing layer, duplicate expert ids ``[0, 0]``); these
helpers name the cause instead:

* :func:`shifted_layer_ids_hint`: the words to add when ids are the wanted ones plus or minus one;
* :func:`check_dense_columns`: the MoE columns picked from an every-layer array hold only zero
  rows where other columns hold routes (the columns of dense layers);
* :func:`layers_from_mapping`: routes kept as ``{layer id: [rows, K]}`` stacked in the model's MoE
  layer order, refusing keys that are not the model's MoE layers (and saying when they are off
  by one).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from r3bridge.errors import LayerMappingError, RouteShapeError

__all__ = ["CONVENTION", "shifted_layer_ids_hint", "check_dense_columns", "check_dense_layers_empty",
           "layers_from_mapping"]

CONVENTION = ("layer ids are 0-based global decoder layer indices (HF config index, Megatron layer_number - 1; "
              "vLLM / SGLang report every decoder layer, dense ones as zero rows)")

# rows of an engine array looked at by check_dense_columns: enough routed rows to be sure, few
# enough to cost nothing next to the copy that follows
_SAMPLE_ROWS = 64


def shifted_layer_ids_hint(have: Sequence[int], want: Sequence[int]) -> str:
    """``"; ..."`` naming the off-by-one when ``have`` is ``want`` shifted by +1 (1-based ids read as
    0-based) or -1, else ``""``. Partial overlaps count: a shift explains ``have`` when it maps more
    of ``want`` onto ``have`` than no shift does."""
    have_s, want_s = {int(x) for x in have}, {int(x) for x in want}
    if not want_s or have_s == want_s:
        return ""
    plain = len(have_s & want_s)
    for shift, words in ((1, "one more than"), (-1, "one less than")):
        hits = len(have_s & {w + shift for w in want_s})
        if hits > plain and hits >= max(1, len(want_s) // 2):
            based = " (1-based ids?)" if shift == 1 else " (0-based ids shifted down?)"
            return f"; the ids are {words} the model's MoE layers {sorted(want_s)}{based}: {CONVENTION}"
    return ""


def _rows_view(arr: Any, layer_dim: int) -> Any:
    """``arr`` as ``[rows, layers, K]`` (every dim before ``layer_dim`` folded into rows)."""
    shape = tuple(arr.shape)
    return arr.reshape((-1,) + shape[layer_dim:layer_dim + 2]) if len(shape) == layer_dim + 2 else None


def check_dense_columns(routes: Any, cols: Sequence[int], *, layer_dim: int, field: str) -> None:
    """Refuse picking columns ``cols`` (the model's MoE layer ids) of an every-layer id array when,
    on the sampled rows that hold any route, picked columns are all zero while the columns that
    hold routes are the picked ids shifted by one: those are dense layers (engines write them as
    zeros) and the ids are off by one, typically 1-based. Only for integer ids with top-k > 1 (a
    real top-k row of distinct ids is never all zero); a bounded sample of rows, so the cost does
    not grow with the batch."""
    view = _rows_view(routes, layer_dim)
    if view is None or not cols or view.shape[0] == 0 or view.shape[-1] < 2:
        return
    if isinstance(view, torch.Tensor):
        if view.is_floating_point() or view.is_nested:
            return
        stride = max(1, view.shape[0] // _SAMPLE_ROWS)
        sample = view[::stride][:_SAMPLE_ROWS].detach().cpu().numpy()
    else:
        sample = np.asarray(view)
        if sample.dtype.kind not in "iu":
            return
        sample = sample[::max(1, sample.shape[0] // _SAMPLE_ROWS)][:_SAMPLE_ROWS]
    nonzero = sample.reshape(sample.shape[0], sample.shape[1], -1).any(-1)       # [rows, layers]
    routed = nonzero.any(1)
    if int(routed.sum()) < 2:
        return
    holds = nonzero[routed].any(0)                                                 # [layers]
    empty = [int(c) for c in cols if 0 <= int(c) < holds.shape[0] and not holds[int(c)]]
    if not empty:
        return
    with_routes = [int(c) for c in np.flatnonzero(holds)]
    hint = shifted_layer_ids_hint(cols, with_routes)
    if not hint:
        # no shift explains it: not a layer-id mix-up (zero ids on some MoE layers only are
        # degenerate routes, which validation reports as such)
        return
    raise LayerMappingError(
        f"{field}: MoE layer ids {empty} pick layers whose rows are all zero in {int(routed.sum())} sampled routed "
        f"rows (dense layers: engines report them as zeros), while layers {with_routes} hold routes{hint}")


def check_dense_layers_empty(routes: Any, cols: Sequence[int], *, layer_dim: int, field: str) -> None:
    """Refuse an every-layer id array whose columns of the trainer's dense layers (every column not
    in ``cols``) hold ids on the sampled rows. vLLM and SGLang zero-initialise the capture buffer
    and only MoE layers write it (vLLM ``routed_experts_capturer``, SGLang ``state_capturer/base.py``),
    so ids there mean the engine ran experts on a layer the trainer's model has dense: it serves a
    different model (seen: SGLang 0.5.12's Qwen3-MoE marks every layer sparse and ignores
    ``mlp_only_layers``, so a checkpoint's dense layer ran as an MoE layer with experts the
    checkpoint does not hold, 1 x H200, docs/gpu-results/sglang-0.5.12). R3 would replay the other
    layers of that other model. A bounded sample of rows, as :func:`check_dense_columns`."""
    view = _rows_view(routes, layer_dim)
    if view is None or view.shape[0] == 0:
        return
    keep = {int(c) for c in cols}
    dense = [c for c in range(view.shape[1]) if c not in keep]
    if not dense:
        return
    if isinstance(view, torch.Tensor):
        if view.is_floating_point() or view.is_nested:
            return
        sample = view[::max(1, view.shape[0] // _SAMPLE_ROWS)][:_SAMPLE_ROWS][:, dense].detach().cpu().numpy()
    else:
        sample = np.asarray(view)
        if sample.dtype.kind not in "iu":
            return
        sample = sample[::max(1, sample.shape[0] // _SAMPLE_ROWS)][:_SAMPLE_ROWS][:, dense]
    holds = sample.reshape(sample.shape[0], len(dense), -1).any(-1)          # [rows, dense layers]
    routed = [d for d, h in zip(dense, holds.any(0)) if h]
    if routed:
        raise LayerMappingError(
            f"{field}: layers {routed} are dense in the trainer's model (not in its MoE layers {sorted(keep)}), but the "
            f"engine returned expert ids for them on {int(holds.any(1).sum())} of {sample.shape[0]} sampled rows "
            f"(engines write dense layers as zeros): the engine ran experts there, so it serves a different model "
            f"than the trainer's (SGLang 0.5.12's Qwen3-MoE ignores mlp_only_layers and treats every layer as MoE); "
            f"{CONVENTION}")


def layers_from_mapping(per_layer: Mapping[int, Any], moe_layer_ids: Sequence[int], *,
                        field: str = "routes", topk: Optional[int] = None) -> np.ndarray:
    """Routes a framework keeps per layer, ``{layer id: [rows, K]}``, stacked ``[rows, L, K]`` in
    the order of ``moe_layer_ids`` (0-based global). Every MoE layer must be a key; keys of other
    layers are refused too (dense layers have no routes), and when the keys are the MoE ids shifted
    by one the error says so. ``topk``: the model's top-k, checked against every layer's width."""
    keys = [int(k) for k in per_layer]
    want = [int(i) for i in moe_layer_ids]
    if sorted(keys) != sorted(want):
        missing, extra = sorted(set(want) - set(keys)), sorted(set(keys) - set(want))
        raise LayerMappingError(
            f"{field}: keyed by layers {sorted(keys)}, the model's MoE layers are {want} (missing {missing}, "
            f"not MoE {extra}){shifted_layer_ids_hint(keys, want) or '; ' + CONVENTION}")
    arrays = [np.asarray(per_layer[k].cpu() if isinstance(per_layer[k], torch.Tensor) else per_layer[k])
              for k in want]
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1 or len(arrays[0].shape) != 2:
        raise LayerMappingError(f"{field}: every layer must hold [rows, top-k] ids of the same shape, got "
                                f"{ {k: tuple(a.shape) for k, a in zip(want, arrays)} }")
    if topk is not None and arrays[0].shape[1] != int(topk):
        raise RouteShapeError(f"{field}: top-{arrays[0].shape[1]} ids per layer, the model routes top-{int(topk)}")
    return np.stack(arrays, axis=1)

"""Engine and trainer payloads -> integer arrays, before any `ReplayBatch` exists.

The bottom of the ingest path: :mod:`r3bridge.batch.schema` builds batches from what these return
(``ReplayBatch.from_vllm`` / ``from_sglang`` / ``from_padded``) and :mod:`r3bridge.rollout.stitching` stitches
engine calls; nothing here imports either. Formats (docs/frameworks.md):

* vLLM ``CompletionOutput.routed_experts``: ``[prompt + generated - 1, num_hidden_layers, K]``
  uint8 (uint16 above 256 experts, int32 on older builds), read-only; aborted requests give None.
  It travels in-process as the array, as nested lists over JSON, or as base64 of a ``.npy`` file
  (vLLM's OpenAI serving).
* SGLang ``meta_info["routed_experts"]``: base64 of flat int32, token-major then layer then k,
  with ``prompt_tokens + completion_tokens - 1`` rows (minus the start offset).
* Both report *every* decoder layer, dense ones as zero rows: :func:`select_layers` keeps the
  layers in ``moe_layer_ids`` (never map by "i + offset").
* TensorRT-LLM ``CompletionOutput.routed_experts``: ``(seq_len - 1, num_moe_layers, top_k)``, the
  MoE layers only, pre-EPLB logical ids (TensorRT-LLM #18397, RFC #17778); the same array
  transports as vLLM's. ``layer_axis="moe_only"`` (:mod:`r3bridge.engines.layer_axis`) reads it; an
  unstated axis whose length fits both readings is refused, never guessed.
* The padded trainer layout ``[B, S, L, K]`` + ``[B, S]`` mask: :func:`padded_rows`.
* Routing weights (optional, :mod:`r3bridge.batch.route_weights`): SGLang #23999 proposes
  ``--enable-return-routed-expert-weights``, a float32 buffer parallel to the ids, same
  token-major ``[rows, num_layers, top_k]`` layout; read from ``meta_info`` under one of
  :data:`SGLANG_WEIGHTS_KEYS` by :func:`decode_sglang_weights`. vLLM returns no weights
  (0.33); a fork or plugin that does passes them per sequence in the routes' shape
  (:func:`decode_vllm_weights`).
* Where a response's routes came from is read by :mod:`r3bridge.batch.provenance`
  (``vllm_provenance``, ``sglang_provenance``): ids only here.
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from r3bridge.engines.layer_axis import ALL_HIDDEN, MOE_ONLY, axis_columns
from r3bridge.engines.layer_ids import check_dense_columns
from r3bridge.errors import CoverageError, LayerMappingError, PayloadError, RouteShapeError, RouteWeightsError

__all__ = ["decode_vllm_routes", "decode_sglang_routes", "sglang_rows", "select_layers", "moe_layers_of",
           "padded_rows", "decode_sglang_weights", "decode_vllm_weights", "sglang_weights_of", "SGLANG_WEIGHTS_KEYS"]

# meta_info keys of SGLang's routing weights: the proposal (SGLang #23999, unmerged) names its flag
# ``enable_return_routed_expert_weights``; ``routed_experts_weights`` follows the ids' key (and
# is what miles calls the same data). The first present is read.
SGLANG_WEIGHTS_KEYS = ("routed_experts_weights", "routed_expert_weights")


def moe_layers_of(routes: Any, moe_layer_ids: Sequence[int], *, layer_dim: int,
                  num_hidden_layers: Optional[int] = None, field: str = "routes",
                  layer_axis: Optional[str] = None) -> Any:
    """The MoE layers of an array / tensor along its ``layer_dim`` axis, selected by id, never by
    offset. ``layer_axis`` says what that axis is (:mod:`r3bridge.engines.layer_axis`): ``"all_hidden"``
    (vLLM, SGLang: every decoder layer, dense ones as zero rows), ``"moe_only"`` (TensorRT-LLM), or
    ``None``: read from its length only where that is unambiguous, refused otherwise.
    ``num_hidden_layers`` (``None``: not checked) is the model's decoder layer count. ``field``
    names the routes in errors."""
    cols = axis_columns(int(routes.shape[layer_dim]), layer_axis=layer_axis, moe_layer_ids=moe_layer_ids,
                         num_hidden_layers=num_hidden_layers, field=field)
    if cols is None:
        return routes
    # ids that pick dense layers' zero rows are off by one (1-based?): say so, not "duplicate [0, 0]"
    check_dense_columns(routes, cols, layer_dim=layer_dim, field=field)
    # list indexing copies (numpy and torch): read-only engine buffers are never aliased
    return routes[(slice(None),) * layer_dim + (cols,)]


def select_layers(arr: Any, moe_layer_ids: Sequence[int] | None, seq: int, what: str,
                  layer_axis: Optional[str] = ALL_HIDDEN) -> Any:
    """Keep only the MoE layers' columns of a ``[rows, layers, K]`` array whose layer axis is
    ``layer_axis`` (vLLM and SGLang: ``"all_hidden"``)."""
    if arr.ndim != 3:
        raise RouteShapeError(f"sequence {seq}: {what} routes must be [rows, layers, topk], got shape {tuple(arr.shape)}")
    if moe_layer_ids is None:
        if layer_axis == MOE_ONLY:
            raise LayerMappingError(f"sequence {seq}: {what} routes with layer_axis='moe_only' need moe_layer_ids")
        return arr
    return moe_layers_of(arr, moe_layer_ids, layer_dim=1, field=f"sequence {seq}", layer_axis=layer_axis)


def decode_vllm_routes(payload: Any, *, seq: int = 0) -> np.ndarray | torch.Tensor:
    """One vLLM call's ``routed_experts`` in any transport -> ``[rows, num_hidden_layers, K]``: a
    ``CompletionOutput`` or its array / tensor (in-process), nested lists (JSON), or base64 of a
    ``.npy`` byte stream, which carries shape and dtype in its header."""
    if payload is None:
        raise PayloadError(f"sequence {seq}: vLLM returned no routed_experts (aborted request, or the "
                           f"engine was started without enable_return_routed_experts)")
    if isinstance(payload, torch.Tensor):
        a = payload.detach()
        kind_ok = not a.is_floating_point() and not a.is_complex() and a.dtype is not torch.bool
    else:
        if isinstance(payload, np.ndarray):
            a = payload
        elif isinstance(payload, (str, bytes, bytearray)):
            try:
                a = np.load(io.BytesIO(base64.b64decode(payload, validate=True)), allow_pickle=False)
            except (binascii.Error, ValueError, OSError) as e:
                raise PayloadError(f"sequence {seq}: routed_experts is not base64 of a .npy array ({e})") from None
        elif hasattr(payload, "routed_experts"):          # a vLLM CompletionOutput
            return decode_vllm_routes(payload.routed_experts, seq=seq)
        else:
            a = np.asarray(payload)
            if a.size == 0:
                a = a.reshape(0, 0, 0)
        kind_ok = a.dtype.kind in "iu"
    if a.ndim != 3:
        raise RouteShapeError(f"sequence {seq}: routed_experts must be [rows, layers, topk], got shape {tuple(a.shape)}")
    if not kind_ok:
        raise RouteShapeError(f"sequence {seq}: routed_experts must be integers, got {a.dtype}")
    return a


def sglang_rows(meta_info: Any, *, start: int = 0, seq: int = 0) -> int:
    """Rows an SGLang response holds: ``prompt_tokens + completion_tokens - 1 - start``."""
    if not isinstance(meta_info, Mapping):
        raise PayloadError(f"sequence {seq}: meta_info must be a dict, got {type(meta_info).__name__}")
    try:
        return int(meta_info["prompt_tokens"]) + int(meta_info["completion_tokens"]) - 1 - int(start)
    except KeyError as e:
        raise PayloadError(f"sequence {seq}: meta_info lacks {e.args[0]!r}") from None
    except (TypeError, ValueError):
        raise PayloadError(f"sequence {seq}: prompt_tokens / completion_tokens are not integers: "
                           f"{meta_info.get('prompt_tokens')!r}, {meta_info.get('completion_tokens')!r}") from None


def decode_sglang_routes(payload: Any, *, num_layers: int | None = None, topk: int | None = None,
                         rows: int | None = None, seq: int = 0) -> np.ndarray:
    """SGLang's ``routed_experts`` (base64 flat int32, or an array / tensor) -> int32
    ``[rows, num_layers, topk]``; with ``num_layers`` / ``topk`` unknown (an inference engine that
    does not know the model), ``[rows, num_layers * topk]`` for the given ``rows``."""
    if isinstance(payload, dict):
        raise PayloadError(f"sequence {seq}: routed_experts is a dict {payload!r}; SGLang serialises a raw "
                           f"tensor as {{}} with skip_tokenizer_init: ask for the base64 form")
    if isinstance(payload, (str, bytes, bytearray)):
        flat = _base64_values(payload, "<i4", seq=seq, what="routed_experts")
    elif isinstance(payload, torch.Tensor):
        flat = payload.detach().cpu().reshape(-1).numpy()
    elif payload is None:
        raise PayloadError(f"sequence {seq}: SGLang returned no routed_experts (request without "
                           f"return_routed_experts, or server without --enable-return-routed-experts)")
    else:
        flat = np.asarray(payload).reshape(-1)
    if flat.dtype.kind not in "iu":
        raise RouteShapeError(f"sequence {seq}: routed_experts must be integers, got {flat.dtype}")
    if num_layers is None or topk is None:
        if rows is None or rows <= 0 or flat.size % rows:
            raise PayloadError(f"sequence {seq}: {flat.size} ids are not {rows} rows (prompt + completion - 1)")
        return flat.astype(np.int32, copy=False).reshape(rows, -1)
    if num_layers < 1 or topk < 1:
        raise RouteShapeError(f"sequence {seq}: num_layers ({num_layers}) and topk ({topk}) must be >= 1")
    per_row = num_layers * topk
    if flat.size % per_row:
        raise PayloadError(f"sequence {seq}: routed_experts has {flat.size} ids, not divisible by "
                           f"num_layers*topk = {num_layers}*{topk}")
    n = flat.size // per_row
    if rows is not None and n != rows:
        raise PayloadError(f"sequence {seq}: routed_experts has {n} rows, expected {rows} "
                           f"(prompt_tokens + completion_tokens - 1 - start)")
    return flat.reshape(n, num_layers, topk)


def padded_rows(routes: torch.Tensor, attention_mask: Any, valid: Any = None
                ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """``[B, S, L, K]`` routes + ``[B, S]`` mask (left or right padded) -> (one row per unmasked
    token ``[N, L, K]``, rows per sequence, their validity or None)."""
    m = torch.as_tensor(np.asarray(attention_mask) if not isinstance(attention_mask, torch.Tensor)
                        else attention_mask).bool().cpu()
    if routes.dim() != 4:
        raise RouteShapeError(f"padded routes must be [batch, seq, layers, topk], got shape {tuple(routes.shape)}")
    if m.shape != routes.shape[:2]:
        raise RouteShapeError(f"attention_mask shape {tuple(m.shape)} does not match routes' [batch, seq] "
                              f"{tuple(routes.shape[:2])}")
    # Unmasked tokens of a row must be one contiguous run (left, right or no padding).
    lens = m.sum(1)
    first = torch.where(lens > 0, m.float().argmax(1), torch.zeros_like(lens))
    pos = torch.arange(m.shape[1])
    expect = (pos[None, :] >= first[:, None]) & (pos[None, :] < (first + lens)[:, None])
    bad = (expect != m).any(1).nonzero()
    if bad.numel():
        raise CoverageError(f"sequence {int(bad[0])}: attention_mask has holes; only left or right padding "
                            f"is supported")
    flat = routes[m.to(routes.device)]
    v = None
    if valid is not None:
        vt = torch.as_tensor(np.asarray(valid) if not isinstance(valid, torch.Tensor) else valid).bool()
        if vt.shape != m.shape:
            raise RouteShapeError(f"valid mask shape {tuple(vt.shape)} does not match attention_mask {tuple(m.shape)}")
        v = vt.cpu()[m]
    return flat, lens.tolist(), v


def _float_array(payload: Any, *, seq: int, what: str) -> np.ndarray:
    """A real-valued array / tensor / nested lists -> numpy (no copy where possible)."""
    if isinstance(payload, torch.Tensor):
        if payload.device.type == "meta":
            raise RouteWeightsError(f"sequence {seq}: {what} is a meta tensor (no values)")
        a = payload.detach().cpu().float().numpy() if payload.dtype == torch.bfloat16 else payload.detach().cpu().numpy()
    else:
        a = np.asarray(payload)
    if a.dtype.kind not in "fiu":
        raise RouteWeightsError(f"sequence {seq}: {what} must be real numbers, got dtype {a.dtype}")
    return a


def sglang_weights_of(meta_info: Any) -> Any:
    """The routing weights payload of an SGLang ``meta_info`` (``None``: it has none)."""
    if not isinstance(meta_info, Mapping):
        return None
    return next((meta_info[k] for k in SGLANG_WEIGHTS_KEYS if meta_info.get(k) is not None), None)


def _base64_values(payload: str | bytes | bytearray, dtype: str, *, seq: int, what: str) -> np.ndarray:
    """SGLang's base64 of a flat little-endian 4-byte array (ids ``"<i4"``, weights ``"<f4"``)."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PayloadError(f"sequence {seq}: {what} is not valid base64 ({e})") from None
    if len(raw) % 4:
        raise PayloadError(f"sequence {seq}: {what} decodes to {len(raw)} bytes, not a whole number of "
                           f"{np.dtype(dtype).name} values")
    return np.frombuffer(raw, dtype=dtype)


def decode_sglang_weights(payload: Any, *, num_layers: int, topk: int, rows: int, seq: int = 0) -> np.ndarray:
    """SGLang's routing weights (base64 of flat little-endian float32, or an array / tensor) ->
    float32 ``[rows, num_layers, topk]``, checked against the ids' row count."""
    if isinstance(payload, (str, bytes, bytearray)):
        flat = _base64_values(payload, "<f4", seq=seq, what="the routing weights payload")
    else:
        flat = _float_array(payload, seq=seq, what="routing weights").reshape(-1)
    if flat.size != rows * num_layers * topk:
        raise RouteWeightsError(f"sequence {seq}: {flat.size} routing weights for {rows} rows x {num_layers} layers "
                                f"x top-{topk} ids")
    return flat.astype(np.float32, copy=False).reshape(rows, num_layers, topk)


def decode_vllm_weights(payload: Any, *, seq: int = 0) -> np.ndarray:
    """One sequence's routing weights in the routes' vLLM shape ``[rows, num_hidden_layers, K]``:
    an array / tensor, nested lists, or base64 of a ``.npy`` file."""
    if payload is None:
        raise RouteWeightsError(f"sequence {seq}: no routing weights (None)")
    if isinstance(payload, (str, bytes, bytearray)):
        try:
            payload = np.load(io.BytesIO(base64.b64decode(payload, validate=True)), allow_pickle=False)
        except (binascii.Error, ValueError, OSError) as e:
            raise PayloadError(f"sequence {seq}: routing weights are not base64 of a .npy array ({e})") from None
    a = _float_array(payload, seq=seq, what="routing weights")
    if a.ndim != 3:
        raise RouteWeightsError(f"sequence {seq}: routing weights must be [rows, layers, topk], got shape {a.shape}")
    return a

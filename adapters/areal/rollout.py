"""AReaL's rollout side: SGLang responses -> :class:`r3bridge.ReplayBatch` (no areal import).

Rollout side. SGLang returns ``meta_info["routed_experts"]``: base64 of flat int32, token-major,
``prompt_tokens + completion_tokens - 1`` rows of ``num_hidden_layers * K`` ids, *from row 0 of the
request*. AReaL 1.0.4's ``RemoteInfEngine.agenerate`` resubmits an interrupted request with the
tokens generated so far appended to the prompt and ``np.concatenate``s every attempt's routes, so
the prefix is duplicated (AReaL #1207: ~2.4% of samples zeroed downstream). Multi-turn workflows
("parent-concat": each turn's prompt is the previous turn's prompt + output + new message) get the
whole context re-routed by every turn's prefill. Both are stitched first-seen here: rows an
earlier call returned are kept (they sampled those tokens), later calls only add rows past them,
and rows are kept only as far as the call's tokens agree with the final trajectory.
"""
from __future__ import annotations

import base64
import binascii
from typing import Any, Optional, Sequence

import numpy as np

from r3bridge.canonical import canonical_form
from r3bridge.errors import LayerMappingError, PayloadError, RouteShapeError, StitchError
from r3bridge.ingest import stitch
from r3bridge.schema import ReplayBatch

__all__ = ["ArealRollout", "decode_sglang", "decode_sglang_rows", "first_seen_rows", "routes_from_attempts",
           "routes_from_responses"]


class ArealRollout:
    """The :class:`r3bridge.protocols.RolloutIngest` of AReaL's workflows: one trajectory's
    ``ModelResponse`` list (one per turn, root first) and its final tokens."""

    def __init__(self, *, num_experts: int, moe_layer_ids: Sequence[int], num_layers: int, topk: int) -> None:
        self.num_experts, self.num_layers, self.topk = int(num_experts), int(num_layers), int(topk)
        self.moe_layer_ids = [int(i) for i in moe_layer_ids]

    def routes_from_rollout(self, engine_outputs: tuple[Sequence[Any], Sequence[int]]) -> ReplayBatch:
        responses, tokens = engine_outputs
        return routes_from_responses(responses, tokens, num_experts=self.num_experts, num_layers=self.num_layers,
                                     topk=self.topk, moe_layer_ids=self.moe_layer_ids)


def decode_sglang(meta_info: dict, *, num_layers: int, topk: int, seq: int = 0) -> np.ndarray:
    """One SGLang response's ``meta_info`` -> int32 ``[prompt + completion - 1, L_all, K]``.
    Also accepts AReaL's already decoded ``[rows, L_all*K]`` array as ``routed_experts``."""
    raw = meta_info.get("routed_experts")
    if raw is None:
        raise PayloadError(f"sequence {seq}: SGLang returned no routed_experts (request without "
                           f"return_routed_experts, or server without --enable-return-routed-experts)")
    if isinstance(raw, dict):
        raise PayloadError(f"sequence {seq}: routed_experts is a dict {raw!r} (SGLang serialised a raw tensor "
                           f"with skip_tokenizer_init): ask for the base64 form")
    if isinstance(raw, (str, bytes, bytearray)):
        try:
            flat = np.frombuffer(base64.b64decode(raw, validate=True), dtype="<i4")
        except (binascii.Error, ValueError) as e:
            raise PayloadError(f"sequence {seq}: routed_experts is not valid base64 int32 ({e})") from None
    else:
        flat = np.asarray(raw).reshape(-1)
    if flat.size % (num_layers * topk):
        raise PayloadError(f"sequence {seq}: {flat.size} ids are not rows of num_layers*topk = {num_layers}*{topk}")
    rows = flat.size // (num_layers * topk)
    if "prompt_tokens" in meta_info and "completion_tokens" in meta_info:
        expect = int(meta_info["prompt_tokens"]) + int(meta_info["completion_tokens"]) - 1
        if rows != expect:
            raise PayloadError(f"sequence {seq}: {rows} route rows, SGLang reports prompt + completion - 1 = {expect}")
    return flat.reshape(rows, num_layers, topk)


def decode_sglang_rows(meta_info: dict, *, seq: int = 0) -> np.ndarray:
    """``meta_info`` -> int32 ``[prompt + completion - 1, L_all*K]`` (AReaL's own layout), for
    callers that do not know the model's layer count and top-k (the inference engine)."""
    raw = meta_info.get("routed_experts")
    if isinstance(raw, (str, bytes, bytearray)):
        try:
            flat = np.frombuffer(base64.b64decode(raw, validate=True), dtype="<i4").astype(np.int32)
        except (binascii.Error, ValueError) as e:
            raise PayloadError(f"sequence {seq}: routed_experts is not valid base64 int32 ({e})") from None
    elif raw is None or isinstance(raw, dict):
        raise PayloadError(f"sequence {seq}: no usable routed_experts in meta_info ({type(raw).__name__})")
    else:
        flat = np.asarray(raw, dtype=np.int32).reshape(-1)
    rows = int(meta_info["prompt_tokens"]) + int(meta_info["completion_tokens"]) - 1
    if rows <= 0 or flat.size % rows:
        raise PayloadError(f"sequence {seq}: {flat.size} ids are not {rows} rows (prompt + completion - 1)")
    return flat.reshape(rows, -1)


def first_seen_rows(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
    """Attempts of one request (each from row 0) -> (first-seen rows, disagreeing overlapping rows).
    Used where no schema is known yet (the inference engine): rows are kept as they came."""
    if not arrays:
        raise PayloadError("no attempt returned routes")
    out, dis = arrays[0], 0
    for a in arrays[1:]:
        if a.shape[1:] != out.shape[1:]:
            raise RouteShapeError(f"attempt routes are [*, {a.shape[1:]}], earlier ones [*, {out.shape[1:]}]")
        n = min(len(a), len(out))
        dis += int((a[:n].reshape(n, -1) != out[:n].reshape(n, -1)).any(1).sum())
        if len(a) > len(out):
            out = np.concatenate([out, a[len(out):]])
    return out, dis


def _piece(arr: np.ndarray, *, num_experts: int, moe_layer_ids: Sequence[int], rows: Optional[int] = None) -> ReplayBatch:
    moe = list(moe_layer_ids)
    if moe and max(moe) >= arr.shape[1]:
        raise LayerMappingError(f"MoE layers {moe} out of range for {arr.shape[1]} reported layers")
    a = arr[: arr.shape[0] if rows is None else rows][:, moe, :]
    return ReplayBatch.from_ragged([a], num_experts=num_experts, layer_ids=moe, source="rollout")


def routes_from_attempts(meta_infos: Sequence[dict], *, num_experts: int, num_layers: int, topk: int,
                         moe_layer_ids: Sequence[int]) -> ReplayBatch:
    """All SGLang responses of one request (first submit, then every resubmit after an
    interruption) -> one sequence, duplicates removed first-seen."""
    pieces = [_piece(decode_sglang(m, num_layers=num_layers, topk=topk, seq=0), num_experts=num_experts,
                     moe_layer_ids=moe_layer_ids) for m in meta_infos]
    rb, _ = stitch(pieces)
    return rb


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(x.argmax()) if x.any() else n


def routes_from_responses(responses: Sequence[Any], tokens: Sequence[int], *, num_experts: int,
                          num_layers: int, topk: int, moe_layer_ids: Sequence[int]) -> ReplayBatch:
    """One trajectory from its ``ModelResponse``s (one per turn, root first: parent-concat) and
    its final token list. Each response's ``routed_experts`` (``[rows, L_all*K]``, already deduped
    across resubmits) covers its own ``input_tokens + output_tokens``; only rows whose whole token
    prefix agrees with ``tokens`` are kept. Canonical form for ``len(tokens)`` tokens."""
    tokens = list(tokens)
    pieces = []
    for t, r in enumerate(responses):
        arr = getattr(r, "routed_experts", None)
        if arr is None:
            raise PayloadError(f"turn {t}: the response has no routed_experts (return_routed_experts off?)")
        arr = np.asarray(arr).reshape(len(arr), num_layers, topk)
        own = list(r.input_tokens) + list(r.output_tokens)
        keep = min(len(arr), _lcp(own, tokens))
        pieces.append(_piece(arr, num_experts=num_experts, moe_layer_ids=moe_layer_ids, rows=keep))
    rb, _ = stitch(pieces)
    if rb.rows_per_seq[0] > len(tokens):
        raise StitchError(f"{rb.rows_per_seq[0]} route rows for {len(tokens)} tokens")
    return canonical_form(rb, [len(tokens)])

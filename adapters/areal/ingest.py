"""AReaL's route formats <-> :class:`r3bridge.ReplayBatch` (pure torch / numpy: no areal import).

Rollout side. SGLang returns ``meta_info["routed_experts"]``: base64 of flat int32, token-major,
``prompt_tokens + completion_tokens - 1`` rows of ``num_hidden_layers * K`` ids, *from row 0 of the
request*. AReaL 1.0.4's ``RemoteInfEngine.agenerate`` resubmits an interrupted request with the
tokens generated so far appended to the prompt and ``np.concatenate``s every attempt's routes, so
the prefix is duplicated (AReaL #1207: ~2.4% of samples zeroed downstream). Multi-turn workflows
("parent-concat": each turn's prompt is the previous turn's prompt + output + new message) get the
whole context re-routed by every turn's prefill. Both are stitched first-seen here: rows an
earlier call returned are kept (they sampled those tokens), later calls only add rows past them,
and rows are kept only as far as the call's tokens agree with the final trajectory.

Trainer side. AReaL's batches are dicts of ``[B, S, ...]`` tensors that its own utilities concat,
split (``split_padded_tensor_dict_into_mb_list`` moves only tensors with ``B*S`` elements), unpad
(``split_and_unpad_tensor`` trims the *last* dim to the sequence length) and deep-copy non-tensor
values into every trajectory. Routes therefore travel as one tensor per trajectory,
``[g, L_moe, K, S]`` (sequence last, so trimming is exact), ids in the narrowest dtype and a
sentinel (255 / -1) where a token has no route; the engine slices them per micro-batch explicitly
by sample id.
"""
from __future__ import annotations

import base64
import binascii
from typing import Any, Optional, Sequence

import numpy as np
import torch

from r3bridge.errors import CoverageError, LayerMappingError, PayloadError, RouteShapeError, StitchError
from r3bridge.ingest import stitch
from r3bridge.protocols import canonical_form, drop_final_invalid_rows
from r3bridge.schema import ReplayBatch

__all__ = ["ROUTES_KEY", "RECORDED_KEY", "SAMPLE_KEY", "decode_sglang", "decode_sglang_rows", "first_seen_rows",
           "routes_from_attempts", "routes_from_responses", "trajectory_tensor", "replay_batch_from_batch",
           "replay_batch_from_tensor",
           "batch_tensor", "sentinel"]

ROUTES_KEY = "r3bridge_routes"        # rollout routes (R3), one [g, L_moe, K, S] tensor per trajectory
RECORDED_KEY = "r3bridge_recorded"    # R2: routes recorded in compute_logp, same layout
SAMPLE_KEY = "r3bridge_sample"        # [B, S] int64 batch-level sample id (transient, added by the actor)


def sentinel(num_experts: int) -> tuple[torch.dtype, int]:
    """(dtype, "no route" value) of the trajectory tensor."""
    if num_experts < 255:
        return torch.uint8, 255
    if num_experts <= 32767:
        return torch.int16, -1
    return torch.int32, -1


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


def trajectory_tensor(rb: ReplayBatch, seq_lens: Sequence[int], width: Optional[int] = None) -> torch.Tensor:
    """ReplayBatch (start 0) -> ``[n, L_moe, K, width]`` with the sentinel where there is no route."""
    dtype, none = sentinel(rb.num_experts)
    lens = [int(x) for x in seq_lens]
    s = max(lens) if width is None else int(width)
    out = torch.full((rb.num_seqs, rb.num_layers, rb.topk, s), none, dtype=dtype)
    for i in range(rb.num_seqs):
        r, v = rb.sequence(i)
        if r.shape[0] > lens[i] or rb.start_rows[i] != 0:
            raise CoverageError(f"sequence {i}: rows [{rb.start_rows[i]}, +{r.shape[0]}) do not fit {lens[i]} tokens")
        vals = r.to(dtype).permute(1, 2, 0).clone()                 # [L, K, rows]
        vals[..., ~v] = none
        out[i, :, :, : r.shape[0]] = vals
    return out


def replay_batch_from_tensor(t: torch.Tensor, rows: Sequence[int], lens: Sequence[int], *, num_experts: int,
                             moe_layer_ids: Sequence[int], source: str = "rollout") -> ReplayBatch:
    """Rows ``rows`` of a ``[B, L_moe, K, S]`` routes tensor, tokens ``[0, lens[i])`` of each (AReaL
    batches are right-padded), -> canonical ReplayBatch in that order."""
    t = torch.as_tensor(t)
    if t.dim() != 4:
        raise RouteShapeError(f"routes must be [batch, layers, topk, seq], got {tuple(t.shape)}")
    if t.shape[1] != len(moe_layer_ids):
        raise LayerMappingError(f"routes have {t.shape[1]} layers, the model has MoE layers {list(moe_layer_ids)}")
    rows, lens = [int(r) for r in rows], [int(n) for n in lens]
    if len(rows) != len(lens):
        raise CoverageError(f"{len(rows)} rows for {len(lens)} lengths")
    bad = [n for n in lens if n > t.shape[3]]
    if bad:
        raise CoverageError(f"sequence of {bad[0]} tokens, routes tensor holds {t.shape[3]}")
    _, none = sentinel(num_experts)
    per, valid = [], []
    for r, n in zip(rows, lens):
        x = t[r, :, :, :n].permute(2, 0, 1)                     # [tokens, L, K]
        v = ~(x == none).flatten(1).all(1)
        per.append(torch.where(v[:, None, None], x, torch.zeros_like(x)))
        valid.append(v)
    rb = ReplayBatch.from_ragged(per, num_experts=num_experts, layer_ids=list(moe_layer_ids), valid=valid,
                                 source=source)
    return drop_final_invalid_rows(rb) if source != "recorded" else rb


def _right_padded_lens(attention_mask: torch.Tensor) -> list[int]:
    attn = torch.as_tensor(attention_mask).bool()
    lens = attn.sum(-1).long()
    pos = torch.arange(attn.shape[-1])[None, :]
    if not bool((attn == (pos < lens[:, None])).all()):
        raise CoverageError("AReaL batches are right-padded; this attention_mask is not")
    return lens.tolist()


def replay_batch_from_batch(data: dict, *, key: str, num_experts: int, moe_layer_ids: Sequence[int],
                            source: str = "rollout") -> ReplayBatch:
    """A batched AReaL dict (``attention_mask`` ``[B, S]``, ``key`` ``[B, L_moe, K, S]``) ->
    canonical ReplayBatch of its samples in batch order."""
    t = data.get(key)
    if t is None:
        raise CoverageError(f"the batch has no {key!r}")
    lens = _right_padded_lens(data["attention_mask"])
    return replay_batch_from_tensor(t, range(len(lens)), lens, num_experts=num_experts,
                                    moe_layer_ids=moe_layer_ids, source=source)


def batch_tensor(rb: ReplayBatch, attention_mask: torch.Tensor) -> torch.Tensor:
    """R2 write-back: recorded ReplayBatch (batch order) -> ``[B, L_moe, K, S]`` for a right-padded
    ``attention_mask``."""
    attn = torch.as_tensor(attention_mask)
    return trajectory_tensor(rb, _right_padded_lens(attn), width=attn.shape[-1])

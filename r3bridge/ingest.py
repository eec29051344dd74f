"""Engine and trainer formats -> `ReplayBatch`, and multi-turn / resubmit stitching.

Formats (field-notes section 6):

* vLLM ``CompletionOutput.routed_experts``: numpy ``[prompt + generated - 1, num_hidden_layers, K]``
  uint8 (uint16 above 256 experts, int32 on older builds), read-only; aborted requests give None.
* SGLang ``meta_info["routed_experts"]``: base64 of flat int32, token-major then layer then k, with
  ``prompt_tokens + completion_tokens - 1`` rows (minus the start offset).
* Both report *every* decoder layer, dense ones as zero rows: entries of layers not in
  ``moe_layer_ids`` are dropped before validation (verl #5037: never map by "i + offset").
"""
from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from r3bridge.errors import CoverageError, LayerMappingError, PayloadError, RouteShapeError, StitchError
from r3bridge.schema import ReplayBatch, as_int_tensor

__all__ = ["from_padded", "from_vllm", "from_sglang", "decode_vllm_routes", "decode_sglang_routes", "stitch",
           "StitchReport", "rollout_routes"]


def _select_layers(arr, moe_layer_ids: Sequence[int] | None, seq: int, what: str):
    """Keep only the MoE layers' columns of an all-layers ``[rows, num_hidden_layers, K]`` array."""
    if arr.ndim != 3:
        raise RouteShapeError(f"sequence {seq}: {what} routes must be [rows, layers, topk], got shape {tuple(arr.shape)}")
    if moe_layer_ids is None:
        return arr
    ids = list(moe_layer_ids)
    if ids and (max(ids) >= arr.shape[1] or min(ids) < 0):
        raise LayerMappingError(f"sequence {seq}: moe_layer_ids {ids} out of range for {arr.shape[1]} reported layers")
    return arr[:, ids, :]  # fancy indexing copies: read-only engine buffers are never aliased


def from_padded(routes: Any, attention_mask: Any, *, num_experts: int, layer_ids: Sequence[int],
                valid: Any = None, source: str = "padded") -> ReplayBatch:
    """``[B, S, L, K]`` routes + ``[B, S]`` mask (left or right padded) -> one row per unmasked token."""
    r = as_int_tensor(routes, what="padded")
    m = torch.as_tensor(np.asarray(attention_mask) if not isinstance(attention_mask, torch.Tensor) else attention_mask).bool().cpu()
    if r.dim() != 4:
        raise RouteShapeError(f"padded routes must be [batch, seq, layers, topk], got shape {tuple(r.shape)}")
    if m.shape != r.shape[:2]:
        raise RouteShapeError(f"attention_mask shape {tuple(m.shape)} does not match routes' [batch, seq] {tuple(r.shape[:2])}")
    # Unmasked tokens of a row must be one contiguous run (left, right or no padding).
    lens = m.sum(1)
    first = torch.where(lens > 0, m.float().argmax(1), torch.zeros_like(lens))
    pos = torch.arange(m.shape[1])
    expect = (pos[None, :] >= first[:, None]) & (pos[None, :] < (first + lens)[:, None])
    bad = (expect != m).any(1).nonzero()
    if bad.numel():
        b = int(bad[0])
        raise CoverageError(f"sequence {b}: attention_mask has holes; only left or right padding is supported")
    flat = r[m.to(r.device)]
    v = None
    if valid is not None:
        vt = torch.as_tensor(np.asarray(valid) if not isinstance(valid, torch.Tensor) else valid).bool()
        if vt.shape != m.shape:
            raise RouteShapeError(f"valid mask shape {tuple(vt.shape)} does not match attention_mask {tuple(m.shape)}")
        v = vt.cpu()[m]
    return ReplayBatch.from_packed(flat, lens.tolist(), num_experts=num_experts, layer_ids=layer_ids,
                                   valid=v, source=source)


def from_vllm(items: Sequence[Any], *, num_experts: int, moe_layer_ids: Sequence[int] | None = None,
              start_rows: Sequence[int] | None = None) -> ReplayBatch:
    """vLLM ``CompletionOutput`` objects (or their ``routed_experts`` arrays) -> ReplayBatch."""
    arrays = []
    for i, it in enumerate(items):
        a = getattr(it, "routed_experts", it) if not isinstance(it, (np.ndarray, torch.Tensor)) else it
        if a is None:
            raise PayloadError(f"sequence {i}: vLLM returned no routed_experts (aborted request, or the "
                               f"engine was started without enable_return_routed_experts)")
        a = a if isinstance(a, torch.Tensor) else np.asarray(a)
        arrays.append(_select_layers(a, moe_layer_ids, i, "vLLM"))
    num_layers = arrays[0].shape[1] if arrays else 0
    layer_ids = list(moe_layer_ids) if moe_layer_ids is not None else list(range(num_layers))
    return ReplayBatch.from_ragged(arrays, num_experts=num_experts, layer_ids=layer_ids,
                                   start_rows=start_rows, source="vllm")


def decode_vllm_routes(payload: Any, *, seq: int = 0) -> np.ndarray:
    """One vLLM call's ``routed_experts`` in any transport -> ``[rows, num_hidden_layers, K]`` array:
    a ``CompletionOutput`` or its numpy array / tensor (in-process), nested lists (JSON, e.g.
    SkyRL 0.3's ``/skyrl/v1/generate``), or base64 of a ``.npy`` byte stream (vLLM's OpenAI
    serving), which carries shape and dtype in its header."""
    if payload is None:
        raise PayloadError(f"sequence {seq}: no routed_experts (aborted request, or vLLM started "
                           f"without enable_return_routed_experts)")
    if isinstance(payload, np.ndarray):
        a = payload
    elif isinstance(payload, torch.Tensor):
        a = payload.detach().cpu().numpy()
    elif isinstance(payload, (str, bytes, bytearray)):
        try:
            raw = base64.b64decode(payload, validate=True)
            a = np.load(io.BytesIO(raw), allow_pickle=False)
        except (binascii.Error, ValueError, OSError) as e:
            raise PayloadError(f"sequence {seq}: routed_experts is not base64 of a .npy array ({e})") from None
    elif hasattr(payload, "routed_experts"):          # a vLLM CompletionOutput
        return decode_vllm_routes(payload.routed_experts, seq=seq)
    else:
        a = np.asarray(payload)
        if a.size == 0:
            a = a.reshape(0, 0, 0)
    if a.ndim != 3:
        raise RouteShapeError(f"sequence {seq}: routed_experts must be [rows, layers, topk], got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise RouteShapeError(f"sequence {seq}: routed_experts must be integers, got {a.dtype}")
    return a


def decode_sglang_routes(payload: Any, *, num_layers: int, topk: int, rows: int | None = None,
                         seq: int = 0) -> np.ndarray:
    """SGLang's ``routed_experts`` (base64 flat int32, or an array/tensor) -> int32 ``[rows, L, K]``."""
    if isinstance(payload, dict):
        raise PayloadError(f"sequence {seq}: routed_experts is a dict {payload!r}; SGLang serialises a raw "
                           f"tensor as {{}} with skip_tokenizer_init: ask for the base64 form")
    if isinstance(payload, (str, bytes, bytearray)):
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise PayloadError(f"sequence {seq}: routed_experts is not valid base64 ({e})") from None
        if len(raw) % 4:
            raise PayloadError(f"sequence {seq}: routed_experts decodes to {len(raw)} bytes, not a whole "
                               f"number of int32 values")
        flat = np.frombuffer(raw, dtype="<i4")
    elif isinstance(payload, torch.Tensor):
        flat = payload.detach().cpu().reshape(-1).numpy()
    elif payload is None:
        raise PayloadError(f"sequence {seq}: SGLang returned no routed_experts (request without "
                           f"return_routed_experts, or server without --enable-return-routed-experts)")
    else:
        flat = np.asarray(payload).reshape(-1)
    if flat.dtype.kind not in "iu":
        raise RouteShapeError(f"sequence {seq}: routed_experts must be integers, got {flat.dtype}")
    if num_layers < 1 or topk < 1:   # (0 used to raise ZeroDivisionError below)
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


def from_sglang(meta_infos: Sequence[dict], *, num_experts: int, num_layers: int, topk: int,
                moe_layer_ids: Sequence[int] | None = None,
                start_rows: Sequence[int] | None = None) -> ReplayBatch:
    """SGLang ``meta_info`` dicts -> ReplayBatch (rows = prompt + completion - 1 - start)."""
    starts = [0] * len(meta_infos) if start_rows is None else [int(s) for s in start_rows]
    if len(starts) != len(meta_infos):
        raise CoverageError(f"start_rows has {len(starts)} entries for {len(meta_infos)} sequences")
    arrays = []
    for i, mi in enumerate(meta_infos):
        if not isinstance(mi, Mapping):   # (None used to raise TypeError, not a ReplayError)
            raise PayloadError(f"sequence {i}: meta_info must be a dict, got {type(mi).__name__}")
        try:
            expect = int(mi["prompt_tokens"]) + int(mi["completion_tokens"]) - 1 - starts[i]
        except KeyError as e:
            raise PayloadError(f"sequence {i}: meta_info lacks {e.args[0]!r}") from None
        except (TypeError, ValueError):
            raise PayloadError(f"sequence {i}: prompt_tokens / completion_tokens are not integers: "
                               f"{mi.get('prompt_tokens')!r}, {mi.get('completion_tokens')!r}") from None
        a = decode_sglang_routes(mi.get("routed_experts"), num_layers=num_layers, topk=topk,
                                 rows=expect, seq=i)
        arrays.append(_select_layers(a, moe_layer_ids, i, "SGLang"))
    layer_ids = list(moe_layer_ids) if moe_layer_ids is not None else list(range(num_layers))
    if not arrays:      # an empty batch still has the engine's top-k (concat checks it)
        return ReplayBatch.from_packed(torch.zeros((0, len(layer_ids), int(topk)), dtype=torch.int32), [],
                                       num_experts=num_experts, layer_ids=layer_ids, source="sglang")
    return ReplayBatch.from_ragged(arrays, num_experts=num_experts, layer_ids=layer_ids,
                                   start_rows=starts, source="sglang")


@dataclass
class StitchReport:
    """What stitching saw, per sequence: rows present in more than one piece, the subset whose
    routes disagreed (first-seen kept), and rows an earlier piece lacked (invalid) and a later one
    filled."""

    overlap_rows: list[int] = field(default_factory=list)
    disagreeing_rows: list[int] = field(default_factory=list)
    filled_rows: list[int] = field(default_factory=list)

    @property
    def total_disagreeing(self) -> int:
        return sum(self.disagreeing_rows)

    def as_metrics(self, prefix: str = "r3bridge/stitch/") -> dict[str, float]:
        return {f"{prefix}overlap_rows": float(sum(self.overlap_rows)),
                f"{prefix}disagreeing_rows": float(self.total_disagreeing),
                f"{prefix}filled_rows": float(sum(self.filled_rows))}


def stitch(pieces: Sequence[ReplayBatch]) -> tuple[ReplayBatch, StitchReport]:
    """Append-only multi-turn / resubmit stitching: ``pieces[t]`` holds, for every sequence, the
    rows engine call ``t`` returned (possibly none). First-seen valid rows win (they sampled the
    tokens); repeated rows are deduplicated; disagreements are counted; gaps raise."""
    if not pieces:
        raise StitchError("stitch of no pieces")
    a = pieces[0]
    for t, b in enumerate(pieces[1:], 1):
        if (b.layer_ids, b.num_experts, b.topk) != (a.layer_ids, a.num_experts, a.topk):
            raise LayerMappingError(f"stitch: piece {t} has (layer_ids, num_experts, topk) = ({list(b.layer_ids)}, "
                                    f"{b.num_experts}, {b.topk}); piece 0 has ({list(a.layer_ids)}, {a.num_experts}, {a.topk})")
        if b.num_seqs != a.num_seqs:
            raise StitchError(f"stitch: piece {t} has {b.num_seqs} sequences, piece 0 has {a.num_seqs}")
    report = StitchReport()
    seq_routes, seq_valid, seq_start = [], [], []
    for i in range(a.num_seqs):
        start = end = None
        routes = valid = None
        over = dis = fill = 0
        for t, p in enumerate(pieces):
            r, v = p.sequence(i)
            s = p.start_rows[i]
            if r.shape[0] == 0:
                continue
            e = s + r.shape[0]
            if start is None:
                start, end, routes, valid = s, e, r.clone(), v.clone()
                continue
            if s > end or e < start:
                raise StitchError(f"sequence {i}, piece {t}: rows [{s}, {e}) leave a gap after the rows "
                                  f"[{start}, {end}) seen so far: cannot stitch unambiguously")
            lo, hi = max(s, start), min(e, end)
            old_r, old_v = routes[lo - start:hi - start], valid[lo - start:hi - start]
            new_r, new_v = r[lo - s:hi - s], v[lo - s:hi - s]
            both = old_v & new_v
            over += hi - lo
            dis += int(((old_r != new_r).flatten(1).any(1) & both).sum())
            take = ~old_v & new_v
            fill += int(take.sum())
            old_r[take] = new_r[take]
            old_v |= new_v
            if s < start:      # rows before anything seen so far
                routes, valid = torch.cat([r[:start - s], routes]), torch.cat([v[:start - s], valid])
                start = s
            if e > end:        # rows after
                routes, valid = torch.cat([routes, r[end - s:]]), torch.cat([valid, v[end - s:]])
                end = e
        if start is None:
            start, routes = 0, a.routes[:0]
            valid = a.valid[:0]
        report.overlap_rows.append(over)
        report.disagreeing_rows.append(dis)
        report.filled_rows.append(fill)
        seq_routes.append(routes)
        seq_valid.append(valid)
        seq_start.append(start)
    if not seq_routes:                     # pieces without sequences: nothing to stitch
        return a, report
    out = ReplayBatch.from_packed(torch.cat(seq_routes), [int(x.shape[0]) for x in seq_routes],
                                  num_experts=a.num_experts, layer_ids=a.layer_ids, start_rows=seq_start,
                                  valid=torch.cat(seq_valid), source=a.source,
                                  policy_versions=a.policy_versions)
    return out, report


def rollout_routes(calls: Sequence[Sequence[Any]], *, num_experts: int, moe_layer_ids: Sequence[int],
                   start_rows: Sequence[Sequence[int]] | None = None,
                   report: list | None = None) -> ReplayBatch:
    """``calls[i][t]``: the routes engine call ``t`` of sample ``i`` returned (any vLLM transport,
    :func:`decode_vllm_routes`), from row 0 of that call's prompt unless ``start_rows[i][t]`` says
    otherwise (vLLM ``routed_experts_prompt_start``). Returns one sequence per sample, first-seen
    rows kept, ``source="rollout"``. ``report`` (a list) receives one :class:`StitchReport` per
    sample."""
    per_sample = []
    for i, sample_calls in enumerate(calls):
        if not sample_calls:
            raise PayloadError(f"sample {i}: no engine call returned routes")
        arrays = [decode_vllm_routes(p, seq=i) for p in sample_calls]
        starts = list(start_rows[i]) if start_rows is not None else [0] * len(arrays)
        pieces = [from_vllm([a], num_experts=num_experts, moe_layer_ids=list(moe_layer_ids), start_rows=[s])
                  for a, s in zip(arrays, starts)]
        rb, rep = stitch(pieces)
        if report is not None:
            report.append(rep)
        per_sample.append(rb)
    out = ReplayBatch.concat(per_sample)
    return ReplayBatch(out.routes, out.valid, out.rows_per_seq, out.start_rows, out.layer_ids, out.num_experts,
                       out.topk, "rollout", out.policy_versions, out.offsets)

"""SkyRL's route formats <-> :class:`r3bridge.ReplayBatch` (pure torch / numpy: no skyrl import).

Generator side (what SkyRL 0.3.x hands around per engine call, ``InferenceEngineOutput
["rollout_expert_indices"][i]``, ``[prompt + generated - 1, num_hidden_layers, K]``):

* in-process vLLM: ``CompletionOutput.routed_experts``, a numpy array (uint8 / uint16 / int32);
* SkyRL 0.3.0's ``/skyrl/v1/generate`` server endpoint: ``routed_experts.tolist()``, nested lists;
* vLLM's OpenAI serving and newer SkyRL (``routed_experts_stash.decode_routed_experts_b64``):
  base64 of a ``.npy`` byte stream, which carries shape and dtype in its header.

SkyRL 0.3.0 *overwrites* the sample's routes with each new turn's (``AgentLoopState.
rollout_expert_indices = turn_output.rollout_expert_indices``): the later prefill re-routes
earlier tokens, so the routes that *sampled* them are lost (miles #3307). :func:`rollout_routes`
stitches the calls first-seen instead (``r3bridge.stitch``), :func:`merge_first_seen` does the same
on SkyRL's list format inside the generator.

Trainer side (``TrainingInputBatch`` or one of the worker's micro-batch dicts):
``rollout_expert_indices`` ``[B, S, L_all, K]`` left-padded like ``sequences`` (uint8 / int16 /
int32), rows past what the engine returned filled with dummy rows (``0..K-1`` in SkyRL main, zeros
in 0.3.0), and, in SkyRL main, ``router_padding_mask`` ``[B, S]`` (True = no captured route).
Without the mask (0.3.0) a row whose MoE-layer ids are all zero is "no route" (top-k ids are
distinct, so a real row is never all zero when K > 1; with K == 1 expert-0 rows are routed natively
and counted, as in the verl adapter).
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from r3bridge.errors import ConfigError, LayerMappingError, PayloadError, RouteShapeError
from r3bridge.ingest import StitchReport, from_padded, from_vllm, stitch
from r3bridge.protocols import drop_final_invalid_rows
from r3bridge.schema import ReplayBatch

__all__ = ["ROUTES_KEY", "MASK_KEY", "decode_routed_experts", "rollout_routes", "merge_first_seen",
           "replay_batch_from_training_batch", "training_batch_fields", "make_router_padding_mask"]

ROUTES_KEY = "rollout_expert_indices"
MASK_KEY = "router_padding_mask"


# ------------------------------------------------------------------------------------ generator
def decode_routed_experts(payload: Any, *, seq: int = 0) -> np.ndarray:
    """One engine call's routes in any of SkyRL's transports -> ``[rows, L_all, K]`` array."""
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
        return decode_routed_experts(payload.routed_experts, seq=seq)
    else:                                             # SkyRL 0.3.0 JSON: nested lists
        a = np.asarray(payload)
        if a.size == 0:
            a = a.reshape(0, 0, 0)
    if a.ndim != 3:
        raise RouteShapeError(f"sequence {seq}: routed_experts must be [rows, layers, topk], got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise RouteShapeError(f"sequence {seq}: routed_experts must be integers, got {a.dtype}")
    return a


def rollout_routes(calls: Sequence[Sequence[Any]], *, num_experts: int, moe_layer_ids: Sequence[int],
                   start_rows: Optional[Sequence[Sequence[int]]] = None,
                   report: Optional[list] = None) -> ReplayBatch:
    """``calls[i][t]``: routes engine call ``t`` of sample ``i`` returned (any transport), each
    from row 0 of that call's prompt unless ``start_rows[i][t]`` says otherwise (vLLM
    ``routed_experts_prompt_start``). Returns one sequence per sample, first-seen rows kept,
    ``source="rollout"``. ``report`` (a list) receives one :class:`StitchReport` per sample."""
    per_sample = []
    for i, sample_calls in enumerate(calls):
        if not sample_calls:
            raise PayloadError(f"sample {i}: no engine call returned routes")
        arrays = [decode_routed_experts(p, seq=i) for p in sample_calls]
        starts = list(start_rows[i]) if start_rows is not None else [0] * len(arrays)
        pieces = [from_vllm([a], num_experts=num_experts, moe_layer_ids=list(moe_layer_ids), start_rows=[s])
                  for a, s in zip(arrays, starts)]
        rb, rep = stitch(pieces)
        if report is not None:
            report.append(rep)
        per_sample.append(rb)
    out = ReplayBatch.concat(per_sample)
    return _with_source(out, "rollout")


def merge_first_seen(previous: Optional[list], new: Optional[list]) -> Optional[list]:
    """SkyRL's per-sample list ``[rows, L_all, K]`` accumulated over turns, first-seen: rows the
    earlier turns returned are kept, the new call only contributes rows past them. (Both start at
    row 0: SkyRL sends the whole conversation as each turn's prompt.)"""
    if new is None:
        return previous
    if previous is None or len(previous) == 0:
        return list(new)
    if len(new) and (len(new[0]) != len(previous[0]) or len(new[0][0]) != len(previous[0][0])):
        raise RouteShapeError(f"turn routes are [*, {len(new[0])}, {len(new[0][0])}], earlier turns "
                              f"[*, {len(previous[0])}, {len(previous[0][0])}]")
    return list(previous) + list(new[len(previous):])


# ------------------------------------------------------------------------------------ trainer
def _get(batch: Any, key: str) -> Any:
    if isinstance(batch, Mapping):
        return batch.get(key)
    try:
        return batch[key]
    except KeyError:
        return None


def replay_batch_from_training_batch(batch: Any, *, num_experts: int, moe_layer_ids: Sequence[int],
                                     num_hidden_layers: Optional[int] = None, source: str = "rollout",
                                     routes_key: str = ROUTES_KEY) -> ReplayBatch:
    """A ``TrainingInputBatch`` (or worker micro-batch dict) -> ReplayBatch of its samples in batch
    order, canonical form (r3bridge.protocols): one row per real token, start 0, uncaptured rows
    invalid, a final row without a route dropped (``source="rollout"`` only)."""
    routes = _get(batch, routes_key)
    if routes is None:
        raise ConfigError(f"the batch has no {routes_key!r}: enable generator.inference_engine."
                          f"enable_return_routed_experts (R3), or R2's recorded routes were not written back")
    attn = _get(batch, "attention_mask")
    if attn is None:
        raise RouteShapeError("the batch has no 'attention_mask'")
    if _get(batch, "sub_seq_lengths") is not None:
        raise ConfigError("SkyRL sub-sequence packing (sub_seq_lengths) carries several samples per row; "
                          "r3bridge needs one sample per row")
    routes = torch.as_tensor(routes)
    if routes.dim() != 4:
        raise RouteShapeError(f"{routes_key} must be [batch, seq, layers, topk], got {tuple(routes.shape)}")
    moe = [int(i) for i in moe_layer_ids]
    nl = int(routes.shape[2])
    if num_hidden_layers is not None and nl != int(num_hidden_layers):
        raise LayerMappingError(f"{routes_key} has {nl} layers but the model has num_hidden_layers="
                                f"{num_hidden_layers} (engine and trainer disagree)")
    if moe and max(moe) >= nl:
        raise LayerMappingError(f"MoE layers {moe} out of range for {nl} reported layers")
    sel = routes.index_select(2, torch.tensor(moe, dtype=torch.long, device=routes.device))
    attn = torch.as_tensor(attn).bool()
    mask = _get(batch, MASK_KEY)
    # SkyRL 0.3.0 marks "no route" with zero rows (its own padding micro-batches of token-based
    # micro-batching too, whose first token is "real"), and its worker does not carry
    # router_padding_mask into micro-batches. A zero row is never a top-k set when K > 1.
    has_route = (sel != 0).flatten(2).any(2).to(attn.device)
    if mask is not None:
        valid = attn & ~torch.as_tensor(mask).bool().to(attn.device)
    elif source == "recorded" and sel.shape[-1] == 1:
        valid = attn                        # top-1 R2: expert 0 is a real recorded route
    else:
        valid = attn & has_route
    rb = from_padded(sel, attn, num_experts=num_experts, layer_ids=moe, valid=valid, source=source)
    if source != "recorded":
        rb = drop_final_invalid_rows(rb)
    return rb


def make_router_padding_mask(attention_mask: torch.Tensor, captured: Sequence[int]) -> torch.Tensor:
    """SkyRL main's ``router_padding_mask`` for left-padded rows: True except the first
    ``captured[i]`` real tokens of row ``i`` (what ``skyrl.train.dataset.preprocess.
    make_router_padding_mask`` computes; provided here because SkyRL 0.3.0 lacks it)."""
    attn = torch.as_tensor(attention_mask).bool()
    lens = attn.sum(1)
    cap = torch.as_tensor(list(captured), dtype=torch.long)
    if cap.shape != lens.shape or bool((cap < 0).any()) or bool((cap > lens).any()):
        raise RouteShapeError(f"captured route lengths {cap.tolist()} do not fit sequence lengths {lens.tolist()}")
    start = attn.shape[1] - lens
    pos = torch.arange(attn.shape[1])[None, :]
    return ~((pos >= start[:, None]) & (pos < (start + cap)[:, None]))


def training_batch_fields(rb: ReplayBatch, attention_mask: torch.Tensor, *, num_hidden_layers: int,
                          dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """ReplayBatch (one sequence per row of ``attention_mask``, start 0) -> SkyRL's fields:
    ``rollout_expert_indices`` ``[B, S, num_hidden_layers, K]`` placed on the real (left- or
    right-padded) tokens, dummy rows ``0..K-1`` everywhere else (dense layers included), and
    ``router_padding_mask``. Used to return R2's recorded routes into the batch."""
    attn = torch.as_tensor(attention_mask).bool().cpu()
    b, s = attn.shape
    if rb.num_seqs != b:
        raise RouteShapeError(f"{rb.num_seqs} sequences for a batch of {b}")
    if any(x != 0 for x in rb.start_rows):
        raise RouteShapeError("training_batch_fields needs routes starting at token 0 of every sample")
    lens = attn.sum(1)
    rows = torch.tensor(rb.rows_per_seq, dtype=torch.long)
    if bool((rows > lens).any()):
        i = int((rows > lens).nonzero()[0])
        raise RouteShapeError(f"sample {i}: {int(rows[i])} route rows for {int(lens[i])} tokens")
    k = rb.topk
    if dtype is None:
        dtype = torch.uint8 if rb.num_experts <= 256 else torch.int16 if rb.num_experts <= 32767 else torch.int32
    if max(rb.layer_ids, default=-1) >= num_hidden_layers:
        raise LayerMappingError(f"layer ids {list(rb.layer_ids)} out of range for {num_hidden_layers} layers")
    out = torch.arange(k, dtype=dtype).expand(b, s, num_hidden_layers, k).clone()
    first = torch.where(lens > 0, attn.float().argmax(1), torch.zeros_like(lens))
    # position of every packed row: sample i, token j -> column first[i] + j
    seq = torch.arange(b).repeat_interleave(rows)
    j = torch.arange(rb.total_rows) - rb.offsets[:-1].repeat_interleave(rows)
    col = first[seq] + j
    valid = rb.valid.cpu()
    lid = torch.tensor(rb.layer_ids, dtype=torch.long)
    vals = rb.routes.cpu().to(dtype)
    out[seq[valid][:, None], col[valid][:, None], lid[None, :]] = vals[valid]
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[seq[valid], col[valid]] = False
    return {ROUTES_KEY: out, MASK_KEY: mask}


def _with_source(rb: ReplayBatch, source: str) -> ReplayBatch:
    if rb.source == source:
        return rb
    return ReplayBatch(rb.routes, rb.valid, rb.rows_per_seq, rb.start_rows, rb.layer_ids, rb.num_experts,
                       rb.topk, source, rb.policy_versions, rb.offsets)

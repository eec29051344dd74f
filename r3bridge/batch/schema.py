"""`ReplayBatch`: the one explicit, ragged, compact schema every adapter produces.

Principles (docs/architecture.md):

* Everything is a field, nothing is inferred from a length: layer ids, top-k, number of experts,
  coverage (start row and rows per sequence), a per-row validity mask and provenance.
* "No route" is ``valid == False``, never a zero row. Invalid rows are *canonicalised* to the
  distinct filler ids ``0..K-1`` on construction, so two ReplayBatches holding the same routes are
  byte-identical whichever engine or framework produced them, and a filler row can never crash
  the dispatcher if it is replayed by mistake.
* Routes are stored packed, ``[total_rows, L, K]``, in the narrowest integer dtype (uint8 up to
  256 experts, int16 up to 32767, int32 above): this is what travels between processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from r3bridge._validate import as_index, as_index_list, as_mask, check_readable, native_order
from r3bridge.batch import wire
from r3bridge.batch.meta import check_coverage, check_layer_ids, checked_meta
from r3bridge.batch.provenance import (
    ROUTE_KINDS,
    RouteProvenance,
    checked_provenance,
    concat_provenance,
    parse_route_label,
    route_label,
    select_provenance,
)
from r3bridge.batch.route_weights import as_weights_tensor, check_weights
from r3bridge.engines.decoders import (
    decode_sglang_weights,
    decode_vllm_routes,
    decode_vllm_weights,
    padded_rows,
    select_layers,
    sglang_rows,
    sglang_weights_of,
)
from r3bridge.engines.engine_pack import allocate, check_shapes, host_array, layer_columns, pack_sequences
from r3bridge.engines.layer_axis import ALL_HIDDEN, MOE_ONLY, check_layer_axis
from r3bridge.engines.layer_ids import check_dense_layers_empty
from r3bridge.engines.route_checks import check_routes
from r3bridge.engines.route_formats import decode_engine_routes, vllm_needs_format
from r3bridge.errors import CoverageError, LayerMappingError, PayloadError, RouteShapeError, RouteWeightsError

__all__ = ["ReplayBatch", "route_dtype", "sentinel_dtype", "ragged_arange"]

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
               torch.uint32, torch.uint64)


def route_dtype(num_experts: int) -> torch.dtype:
    """Narrowest dtype that holds expert ids ``[0, num_experts)``."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32767:
        return torch.int16
    return torch.int32


def sentinel_dtype(num_experts: int) -> tuple[torch.dtype, int]:
    """(dtype, "no route" value) for a dense layout that marks missing routes in-band: the
    narrowest dtype holding ``num_experts`` ids plus one sentinel (255 in uint8, else -1)."""
    dtype = route_dtype(num_experts + 1)
    return dtype, 255 if dtype == torch.uint8 else -1


def as_int_tensor(x, *, what: str) -> torch.Tensor:
    """numpy array (read-only allowed) or tensor -> integer CPU/GPU tensor, no per-row work."""
    if isinstance(x, torch.Tensor):
        check_readable(x, what=what, error=RouteShapeError)
        t = x
    else:
        a = np.asarray(x)
        if a.dtype.kind not in "iu":
            raise RouteShapeError(f"{what}: routes must have an integer dtype, got {a.dtype}")
        a = native_order(a)     # a big-endian array is a valid integer array: convert exactly
        # uint16/uint32 have no complete torch support: widen in numpy (copy also detaches
        # read-only buffers such as vLLM's, which torch.from_numpy refuses to share).
        if a.dtype in (np.uint16, np.uint32):
            a = a.astype(np.int64 if a.dtype == np.uint32 else np.int32)
        elif not a.flags.writeable or not a.flags.c_contiguous:
            a = np.ascontiguousarray(a).copy()
        t = torch.from_numpy(a)
    if t.dtype not in _INT_DTYPES:
        raise RouteShapeError(f"{what}: routes must have an integer dtype, got {t.dtype}")
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        t = t.to(torch.int64)
    return t


@dataclass(frozen=True)
class ReplayBatch:
    """Packed ragged routes of a batch of sequences.

    ``routes[offsets[i] + j]`` is the route of token ``start_rows[i] + j`` of sequence ``i``, for
    every layer in ``layer_ids`` (global 0-based decoder layer index).
    """

    routes: torch.Tensor            # [total_rows, L, K] uint8 / int16 / int32
    valid: torch.Tensor             # [total_rows] bool
    rows_per_seq: list[int]
    start_rows: list[int]
    layer_ids: tuple[int, ...]
    num_experts: int
    topk: int
    route_kind: str = "rollout"     # ROUTE_KINDS: "rollout" (an engine's) or "recorded" (R2), ...
    policy_versions: list[int] | None = None   # optional, per sequence
    _offsets: torch.Tensor = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    # optional, per sequence (None entries: unknown): the engine pass the routes came from
    # (r3bridge.batch.provenance); checked against the log-probs' by the driver
    provenance: tuple[RouteProvenance | None, ...] | None = None
    # optional float16 [total_rows, L, K]: the engine's gate weight of each routed expert
    # (r3bridge.batch.route_weights); 0 on rows without a route. Every row operation carries it.
    weights: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # rollout routes: the engine that produced them ("vllm", "sglang", "trtllm", ...; None: not said)
    engine: str | None = None

    # ----------------------------------------------------------------------------- construction
    def __post_init__(self) -> None:
        if self.route_kind not in ROUTE_KINDS:
            raise PayloadError(f"route_kind must be one of {ROUTE_KINDS}, got {self.route_kind!r} (an engine's name "
                               f"goes in engine=)")
        if self.engine is not None and (self.route_kind != "rollout" or not isinstance(self.engine, str)
                                        or not self.engine or self.engine in ROUTE_KINDS):
            raise PayloadError(f"engine={self.engine!r}: rollout routes only, a non-empty name that is no route kind")
        if self._offsets is None:
            offs = torch.zeros(len(self.rows_per_seq) + 1, dtype=torch.int64)
            if self.rows_per_seq:
                offs[1:] = torch.cumsum(torch.tensor(self.rows_per_seq, dtype=torch.int64), 0)
            object.__setattr__(self, "_offsets", offs)
        object.__setattr__(self, "provenance", checked_provenance(self.provenance, len(self.rows_per_seq)))

    @classmethod
    def from_ragged(
        cls,
        routes: Sequence,
        *,
        num_experts: int,
        layer_ids: Sequence[int],
        start_rows: Sequence[int] | None = None,
        valid: Sequence | None = None,
        route_kind: str = "rollout",
        policy_versions: Sequence[int] | None = None,
        provenance: Sequence[RouteProvenance | None] | None = None,
        weights: Sequence | None = None,
        engine: str | None = None,
    ) -> "ReplayBatch":
        """One array/tensor ``[rows_i, L, K]`` (any int dtype) per sequence; ``weights`` (optional):
        one real array ``[rows_i, L, K]`` per sequence, the gate weight of each routed expert."""
        batch = cls._ragged_routes(routes, num_experts=num_experts, layer_ids=layer_ids, start_rows=start_rows,
                                   valid=valid, route_kind=route_kind, engine=engine,
                                   policy_versions=policy_versions, provenance=provenance)
        return batch if weights is None else batch.with_weights(_ragged_weights(weights, batch))

    @classmethod
    def _ragged_routes(cls, routes: Sequence, *, num_experts: int, layer_ids: Sequence[int],
                       start_rows: Sequence[int] | None, valid: Sequence | None, route_kind: str,
                       engine: str | None, policy_versions: Sequence[int] | None,
                       provenance: Sequence[RouteProvenance | None] | None) -> "ReplayBatch":
        host = _host_arrays(routes)
        if host is not None:
            masks = _sequence_masks(valid, [int(a.shape[0]) for a in host])
            return cls._from_host(host, None, num_experts=num_experts, layer_ids=layer_ids, start_rows=start_rows,
                                  valid=masks, route_kind=route_kind, engine=engine,
                                  policy_versions=policy_versions, provenance=provenance)
        tensors = [as_int_tensor(r, what=f"sequence {i}") for i, r in enumerate(routes)]
        for i, t in enumerate(tensors):
            if t.dim() != 3:
                raise RouteShapeError(
                    f"sequence {i}: routes must be [rows, layers, topk], got shape {tuple(t.shape)}")
        rows = [int(t.shape[0]) for t in tensors]
        if tensors:
            # One common dtype that holds every input exactly. (Promoting only sequence 0's dtype
            # with int32 wrapped int64 ids >= 2**31 of later sequences into range, so they
            # passed validation.) All-equal dtypes (the engine case) are kept as they are.
            common = tensors[0].dtype
            for t in tensors[1:]:
                common = torch.promote_types(common, t.dtype)
            shapes = {tuple(t.shape[1:]) for t in tensors}
            if len(shapes) > 1:
                ref = tuple(tensors[0].shape[1:])
                bad = next(i for i, t in enumerate(tensors) if tuple(t.shape[1:]) != ref)
                raise RouteShapeError(
                    f"sequence {bad}: [layers, topk] = {list(tensors[bad].shape[1:])} differs from "
                    f"sequence 0's {list(ref)} (inconsistent topk or layer count)")
            flat = torch.cat([t.to(common) for t in tensors], 0) if len(tensors) > 1 else tensors[0]
        else:
            flat = torch.zeros((0, len(layer_ids), 1), dtype=torch.int32)
        vt = _sequence_masks(valid, rows)
        v = None if vt is None else torch.cat(vt) if vt else torch.zeros(0, dtype=torch.bool)
        return cls.from_packed(flat, rows, num_experts=num_experts, layer_ids=layer_ids,
                               start_rows=start_rows, valid=v, route_kind=route_kind, engine=engine,
                               policy_versions=policy_versions, provenance=provenance)

    @classmethod
    def _from_host(cls, arrays: list[np.ndarray], cols: Sequence[int] | None, *, num_experts: int,
                   layer_ids: Sequence[int], start_rows: Sequence[int] | None, route_kind: str = "rollout",
                   engine: str | None = None, valid: list[torch.Tensor] | None = None,
                   policy_versions: Sequence[int] | None = None,
                   provenance: Sequence[RouteProvenance | None] | None = None) -> "ReplayBatch":
        """Host arrays (one per sequence, all layers or ``cols`` of them) -> a batch, in one sweep:
        :func:`r3bridge.engines.engine_pack.pack_sequences` selects, narrows and checks every block of rows
        straight into the one buffer the batch keeps."""
        provenance = checked_provenance(provenance, len(arrays))     # before the copy, like the other metadata
        sel = layer_columns(cols)
        shapes = [(a.shape[0],) + tuple(a[:0][:, sel].shape[1:] if sel is not None else a.shape[1:]) for a in arrays]
        check_shapes([np.empty((0,) + sh[1:], dtype=np.uint8) for sh in shapes])
        total = sum(sh[0] for sh in shapes)
        rows, layer_ids, topk, num_experts, starts, policy_versions = checked_meta(
            (total,) + shapes[0][1:], [sh[0] for sh in shapes], num_experts, layer_ids, start_rows, policy_versions)
        out = allocate((total, len(layer_ids), topk), route_dtype(num_experts), what=f"{route_label(route_kind, engine)} ingest")
        vnp = None if valid is None else [v.numpy() for v in valid]
        pack_sequences(arrays, sel, out.numpy(), num_experts, layer_ids=layer_ids, starts=starts, valid=vnp)
        v = torch.cat(valid) if valid else torch.ones(total, dtype=torch.bool)
        if valid is not None and not bool(v.all()):
            out[~v] = torch.arange(topk, dtype=out.dtype)
        return cls(out, v, rows, starts, layer_ids, num_experts, topk, route_kind, policy_versions,
                   provenance=provenance, engine=engine)

    @classmethod
    def from_packed(
        cls,
        routes: torch.Tensor,
        rows_per_seq: Sequence[int],
        *,
        num_experts: int,
        layer_ids: Sequence[int],
        start_rows: Sequence[int] | None = None,
        valid: torch.Tensor | None = None,
        route_kind: str = "rollout",
        policy_versions: Sequence[int] | None = None,
        provenance: Sequence[RouteProvenance | None] | None = None,
        weights: torch.Tensor | None = None,
        engine: str | None = None,
    ) -> "ReplayBatch":
        """Already packed ``[total_rows, L, K]`` routes plus ``rows_per_seq`` (and optionally their
        ``weights``, same shape). Validates."""
        routes = as_int_tensor(routes, what="routes")
        if routes.dim() != 3:
            raise RouteShapeError(f"routes must be [rows, layers, topk], got shape {tuple(routes.shape)}")
        rows_per_seq, layer_ids, topk, num_experts, starts, policy_versions = checked_meta(
            tuple(routes.shape), rows_per_seq, num_experts, layer_ids, start_rows, policy_versions)
        n = len(rows_per_seq)
        provenance = checked_provenance(provenance, n)
        if valid is None:
            valid = torch.ones(routes.shape[0], dtype=torch.bool, device=routes.device)
        else:
            valid = as_mask(valid, what="valid", error=CoverageError).to(routes.device)
            if valid.shape != (routes.shape[0],):
                raise CoverageError(f"valid has shape {tuple(valid.shape)}, routes have {routes.shape[0]} rows")
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        if n:
            offsets[1:] = torch.cumsum(torch.tensor(rows_per_seq, dtype=torch.int64), 0)
        check_routes(routes, valid, num_experts, layer_ids, offsets, starts)
        packed = _canonical(routes, valid, num_experts)
        checked = None if weights is None else check_weights(weights, packed, valid, layer_ids, offsets, starts)
        return cls(packed, valid.clone(),
                   rows_per_seq, starts, layer_ids, num_experts, topk, route_kind,
                   policy_versions, offsets, provenance, weights=checked, engine=engine)

    # Engine / trainer formats: the payloads are decoded by r3bridge.engines.decoders (no batch there).
    @classmethod
    def from_padded(cls, routes, attention_mask, *, num_experts: int, layer_ids: Sequence[int],
                    valid=None, route_kind: str = "rollout",
                    provenance: Sequence[RouteProvenance | None] | None = None,
                    engine: str | None = None) -> "ReplayBatch":
        """``[B, S, L, K]`` + ``[B, S]`` mask, left or right padding; one row per unmasked token."""
        flat, lens, v = padded_rows(
            as_int_tensor(routes, what="padded"), as_mask(attention_mask, what="attention_mask", error=CoverageError),
            None if valid is None else as_mask(valid, what="valid", error=CoverageError))
        return cls.from_packed(flat, lens, num_experts=as_index(num_experts, what="num_experts", error=RouteShapeError),
                               layer_ids=as_index_list(layer_ids, what="layer_ids", error=LayerMappingError),
                               valid=v, route_kind=route_kind, engine=engine, provenance=provenance)

    @classmethod
    def from_vllm(cls, items, *, num_experts: int, moe_layer_ids: Sequence[int] | None = None,
                  start_rows: Sequence[int] | None = None,
                  provenance: Sequence[RouteProvenance | None] | None = None,
                  weights: Sequence | None = None, layer_axis: str = ALL_HIDDEN,
                  engine: str | None = "vllm",
                  engine_version: str | None = None) -> "ReplayBatch":
        """vLLM ``CompletionOutput``s or their ``routed_experts`` (any transport:
        :func:`r3bridge.engines.decoders.decode_vllm_routes`). ``provenance``: one per item, the engine
        pass each came from (:func:`r3bridge.batch.provenance.vllm_provenance` builds it from request
        outputs). ``weights``: optional, one array per sequence in the routes' shape (every
        reported layer; vLLM itself returns none). ``layer_axis`` (:mod:`r3bridge.engines.layer_axis`):
        vLLM reports every hidden layer; ``"moe_only"`` reads one entry per ``moe_layer_ids``
        (routes and weights alike). Rollout routes of ``engine``.
        ``engine_version``: the vLLM release that returned them; its format
        (:data:`r3bridge.engines.route_formats.ROUTE_FORMATS`: 0.21's split int16 lists over MoE layers,
        0.22-0.30's array, 0.31+'s AuxOutput emissions) decodes each item, and an item in another
        format is refused naming the release. ``None``: read from each item's own fields."""
        layer_axis = check_layer_axis(layer_axis) or ALL_HIDDEN
        items = list(items)
        if engine == "vllm" and (engine_version is not None or any(vllm_needs_format(it) for it in items)):
            starts = [0] * len(items) if start_rows is None else list(_opt_ids(start_rows, "start_rows", CoverageError))
            if len(starts) != len(items):
                raise CoverageError(f"start_rows has {len(starts)} entries for {len(items)} sequences")
            decoded = [decode_engine_routes("vllm", it, version=engine_version, seq=i, start_row=starts[i])
                       for i, it in enumerate(items)]
            items, start_rows = [d.routes for d in decoded], [d.start_row for d in decoded]
            if any(d.layer_axis == MOE_ONLY for d in decoded):
                layer_axis = MOE_ONLY            # 0.21's split lists hold the MoE layers only
            elif engine_version is not None and moe_layer_ids is not None:
                # the release's format writes dense layers as zeros: ids there mean another model
                for i, a in enumerate(items):
                    check_dense_layers_empty(a, list(moe_layer_ids), layer_dim=1, field=f"sequence {i}")
        batch = cls._from_vllm_routes(items, num_experts=num_experts, moe_layer_ids=moe_layer_ids,
                                      start_rows=start_rows, provenance=provenance, layer_axis=layer_axis,
                                      route_kind="rollout", engine=engine)
        if weights is None:
            return batch
        moe = _opt_ids(moe_layer_ids, "moe_layer_ids", LayerMappingError)
        return batch.with_weights(_ragged_weights(
            [select_layers(decode_vllm_weights(w, seq=i), moe, i, f"{route_label('rollout', engine)} weights", layer_axis)
             for i, w in enumerate(weights)], batch))

    @classmethod
    def _from_vllm_routes(cls, items, *, num_experts: int, moe_layer_ids: Sequence[int] | None,
                          start_rows: Sequence[int] | None,
                          provenance: Sequence[RouteProvenance | None] | None, layer_axis: str,
                          route_kind: str, engine: str | None) -> "ReplayBatch":
        num_experts = as_index(num_experts, what="num_experts", error=RouteShapeError)
        moe_layer_ids = _opt_ids(moe_layer_ids, "moe_layer_ids", LayerMappingError)
        start_rows = _opt_ids(start_rows, "start_rows", CoverageError)
        decoded = [decode_vllm_routes(it, seq=i) for i, it in enumerate(items)]
        # the columns to keep: the MoE layers' of an all-hidden axis, every one of a MoE-only axis
        cols = None if layer_axis == MOE_ONLY else moe_layer_ids
        host = _host_arrays(decoded)
        if host is not None:
            for i, a in enumerate(host):     # shape and layer-range checks on an empty view: nothing copied
                select_layers(a[:0], moe_layer_ids, i, route_label(route_kind, engine), layer_axis)
            layer_ids = list(moe_layer_ids) if moe_layer_ids is not None else list(range(host[0].shape[1]))
            return cls._from_host(host, cols, num_experts=num_experts, layer_ids=layer_ids,
                                  start_rows=start_rows, route_kind=route_kind, engine=engine, provenance=provenance)
        arrays = [select_layers(a, moe_layer_ids, i, route_label(route_kind, engine), layer_axis)
                  for i, a in enumerate(decoded)]
        num_layers = arrays[0].shape[1] if arrays else 0
        layer_ids = list(moe_layer_ids) if moe_layer_ids is not None else list(range(num_layers))
        return cls.from_ragged(arrays, num_experts=num_experts, layer_ids=layer_ids, start_rows=start_rows,
                               route_kind=route_kind, engine=engine, provenance=provenance)

    @classmethod
    def from_trtllm(cls, items, *, num_experts: int, moe_layer_ids: Sequence[int],
                    start_rows: Sequence[int] | None = None,
                    provenance: Sequence[RouteProvenance | None] | None = None) -> "ReplayBatch":
        """TensorRT-LLM ``CompletionOutput``s or their ``routed_experts`` (TensorRT-LLM #18397, RFC
        #17778): ``(seq_len - 1, num_moe_layers, top_k)`` per request, rows for the prompt and
        generated tokens but the last (it was never fed forward), one entry per **MoE** layer
        (``layer_axis="moe_only"``: entry ``j`` is ``moe_layer_ids[j]``), pre-EPLB logical expert
        ids (captured before the load balancer maps them to replicas)."""
        if moe_layer_ids is None:
            raise LayerMappingError("TensorRT-LLM routes have one entry per MoE layer: from_trtllm needs "
                                    "moe_layer_ids (r3bridge.hf.ModelInfo.moe_layer_ids)")
        items = list(items)
        for i, it in enumerate(items):
            if it is None or getattr(it, "routed_experts", 0) is None:
                raise PayloadError(f"sequence {i}: TensorRT-LLM returned no routed_experts (a request without "
                                   f"router replay capture, or an aborted one)")
        return cls.from_vllm(items, num_experts=num_experts, moe_layer_ids=moe_layer_ids, start_rows=start_rows,
                             provenance=provenance, layer_axis=MOE_ONLY, engine="trtllm")

    @classmethod
    def from_sglang(cls, meta_infos, *, num_experts: int, num_layers: int, topk: int,
                    moe_layer_ids: Sequence[int] | None = None,
                    start_rows: Sequence[int] | None = None,
                    provenance: Sequence[RouteProvenance | None] | None = None,
                    layer_axis: str = ALL_HIDDEN, engine_version: str | None = None) -> "ReplayBatch":
        """SGLang ``meta_info`` dicts (base64 flat int32 ``routed_experts``); rows = prompt +
        completion - 1 - start. Routing weights are read when the meta_infos carry them
        (:data:`r3bridge.engines.decoders.SGLANG_WEIGHTS_KEYS`, SGLang #23999): all of them or none.
        ``provenance``: one per meta_info (:func:`r3bridge.batch.provenance.sglang_provenance` reads it
        from the meta_infos). ``engine_version``: the SGLang release (its format in
        :data:`r3bridge.engines.route_formats.ROUTE_FORMATS`: 0.5.11+ hands base64 on every path, and
        base64 encoded twice by a client is refused); the routes may sit in ``sgl_ext`` (OpenAI
        endpoints) and ``routed_experts_dtype`` names a narrower wire (SGLang #31219). With the release
        given, ids on a layer ``moe_layer_ids`` leaves out are refused: the format writes dense layers
        as zeros, so the engine ran experts where the trainer's model has none (another model)."""
        num_experts = as_index(num_experts, what="num_experts", error=RouteShapeError)
        num_layers = as_index(num_layers, what="num_layers", error=RouteShapeError)
        topk = as_index(topk, what="topk", error=RouteShapeError)
        moe_layer_ids = _opt_ids(moe_layer_ids, "moe_layer_ids", LayerMappingError)
        starts = [0] * len(meta_infos) if start_rows is None else _opt_ids(start_rows, "start_rows", CoverageError)
        if len(starts) != len(meta_infos):
            raise CoverageError(f"start_rows has {len(starts)} entries for {len(meta_infos)} sequences")
        axis = check_layer_axis(layer_axis) or ALL_HIDDEN
        arrays, weights = [], []
        for i, mi in enumerate(meta_infos):
            mi = _sglang_numbers(mi, i)
            sglang_rows(mi, start=starts[i], seq=i)        # prompt / completion counts present and integers
            a = decode_engine_routes("sglang", mi, version=engine_version, seq=i, start_row=starts[i],
                                     num_hidden_layers=num_layers, topk=topk).routes
            if engine_version is not None and moe_layer_ids is not None and axis == ALL_HIDDEN:
                # the release's format writes dense layers as zeros: ids there mean another model
                check_dense_layers_empty(a, moe_layer_ids, layer_dim=1, field=f"sequence {i}")
            arrays.append(select_layers(a, moe_layer_ids, i, "SGLang", axis))
            w = sglang_weights_of(mi)
            if w is not None:
                w = decode_sglang_weights(w, num_layers=num_layers, topk=topk, rows=int(a.shape[0]), seq=i)
                weights.append(select_layers(w, moe_layer_ids, i, "SGLang weights", axis))
        if weights and len(weights) != len(arrays):
            raise RouteWeightsError(f"{len(weights)} of {len(arrays)} SGLang responses carry routing weights: "
                                    f"all or none (was the server restarted without the flag?)")
        layer_ids = list(moe_layer_ids) if moe_layer_ids is not None else list(range(num_layers))
        if not arrays:      # an empty batch still has the engine's top-k (concat checks it)
            return cls.from_packed(torch.zeros((0, len(layer_ids), int(topk)), dtype=torch.int32), [],
                                   num_experts=num_experts, layer_ids=layer_ids, engine="sglang",
                                   provenance=provenance)
        return cls.from_ragged(arrays, num_experts=num_experts, layer_ids=layer_ids, start_rows=starts,
                               engine="sglang", provenance=provenance, weights=weights or None)

    @classmethod
    def from_trusted(cls, routes: torch.Tensor, rows_per_seq: list[int], start_rows: list[int], valid: torch.Tensor,
                 layer_ids: tuple[int, ...], num_experts: int, route_kind: str) -> "ReplayBatch":
        """Routes already in the schema dtype whose ids are distinct and in range by construction
        (the router's own top-k, or shard() output). Shapes are still checked; the
        per-row duplicate scan is not repeated."""
        if routes.dtype != route_dtype(num_experts) or routes.dim() != 3 or routes.shape[0] != sum(rows_per_seq):
            raise RouteShapeError(f"internal: routes {tuple(routes.shape)} {routes.dtype} do not fit the schema")
        check_layer_ids(layer_ids, routes.shape[1])
        out = routes
        if not bool(valid.all()):
            out = out.clone()
            out[~valid] = torch.arange(routes.shape[2], dtype=routes.dtype, device=routes.device)
        return cls(out, valid, list(rows_per_seq), list(start_rows), layer_ids, num_experts,
                   int(routes.shape[2]), route_kind)

    # ----------------------------------------------------------------------------- properties
    @property
    def num_seqs(self) -> int:
        return len(self.rows_per_seq)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def total_rows(self) -> int:
        return int(self.routes.shape[0])

    @property
    def offsets(self) -> torch.Tensor:
        """int64 ``[num_seqs + 1]``: row offset of each sequence in ``routes``."""
        return self._offsets

    @property
    def coverage(self) -> float:
        """Fraction of rows holding a real route."""
        return float(self.valid.float().mean()) if self.total_rows else 0.0

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(routes ``[rows_i, L, K]``, valid ``[rows_i]``) of sequence ``i`` (views)."""
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        return self.routes[a:b], self.valid[a:b]

    def check_seq_lens(self, seq_lens: Sequence[int]) -> None:
        """Raise unless every sequence's rows cover ``[start, start + rows)`` with
        ``start + rows`` equal to ``seq_len`` or ``seq_len - 1`` (the last sampled token is never
        fed forward, so it has no route); a sequence with 0 rows passes whatever its start row
        (an aborted or interrupted sample: no route)."""
        check_coverage(self.start_rows, self.rows_per_seq, seq_lens)

    # ----------------------------------------------------------------------------- micro-batching
    def select(self, indices: Sequence[int]) -> "ReplayBatch":
        """Sequences ``indices`` in that order (e.g. one micro-batch after re-partitioning)."""
        idx = torch.as_tensor(as_index_list(indices, what="select indices", error=CoverageError),
                              dtype=torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_seqs):
            raise CoverageError(f"select: index out of range for {self.num_seqs} sequences: {list(indices)}")
        rows = torch.tensor(self.rows_per_seq, dtype=torch.int64)[idx] if idx.numel() else idx
        starts = self._offsets[idx]
        row_idx = ragged_arange(starts, rows)
        order = idx.tolist()
        pv = None if self.policy_versions is None else [self.policy_versions[i] for i in order]
        new_rows = rows.tolist()
        offsets = torch.zeros(len(new_rows) + 1, dtype=torch.int64)
        if new_rows:
            offsets[1:] = torch.cumsum(rows, 0)
        return ReplayBatch(
            self.routes.index_select(0, row_idx.to(self.routes.device)),
            self.valid.index_select(0, row_idx.to(self.valid.device)),
            new_rows, [self.start_rows[i] for i in order], self.layer_ids,
            self.num_experts, self.topk, self.route_kind, pv, offsets, select_provenance(self.provenance, order),
            weights=None if self.weights is None else self.weights.index_select(0, row_idx.to(self.weights.device)),
            engine=self.engine)

    def select_range(self, start: int, stop: int) -> "ReplayBatch":
        """Sequences ``start .. stop - 1`` as views of this batch's buffers (no copy): the
        consecutive micro-batches of a pass cost nothing to cut."""
        start = as_index(start, what="select_range start", error=CoverageError)
        stop = as_index(stop, what="select_range stop", error=CoverageError)
        if not 0 <= start <= stop <= self.num_seqs:
            raise CoverageError(f"select_range({start}, {stop}) out of range for {self.num_seqs} sequences")
        a, b = int(self._offsets[start]), int(self._offsets[stop])
        pv = None if self.policy_versions is None else self.policy_versions[start:stop]
        return ReplayBatch(self.routes[a:b], self.valid[a:b], self.rows_per_seq[start:stop],
                           self.start_rows[start:stop], self.layer_ids, self.num_experts, self.topk,
                           self.route_kind, pv, self._offsets[start:stop + 1] - a,
                           None if self.provenance is None else self.provenance[start:stop],
                           weights=None if self.weights is None else self.weights[a:b], engine=self.engine)

    @staticmethod
    def concat(batches: Sequence["ReplayBatch"]) -> "ReplayBatch":
        """Sequences of all ``batches``, in order. Schemas must agree."""
        if not batches:
            raise CoverageError("concat of no ReplayBatch")
        a = batches[0]
        for j, b in enumerate(batches[1:], 1):
            if (b.layer_ids, b.num_experts, b.topk) != (a.layer_ids, a.num_experts, a.topk):
                raise LayerMappingError(
                    f"concat: batch {j} has (layer_ids, num_experts, topk) = "
                    f"({list(b.layer_ids)}, {b.num_experts}, {b.topk}), batch 0 has "
                    f"({list(a.layer_ids)}, {a.num_experts}, {a.topk})")
        pv = None
        if all(b.policy_versions is not None for b in batches):
            pv = [p for b in batches for p in b.policy_versions]  # type: ignore[union-attr]
        kinds = {b.route_kind for b in batches}
        kind = kinds.pop() if len(kinds) == 1 else "mixed"
        engines = {b.engine for b in batches}
        engine = engines.pop() if len(engines) == 1 and kind == "rollout" else None     # several: not one name
        rows = [r for b in batches for r in b.rows_per_seq]
        return ReplayBatch(
            torch.cat([b.routes for b in batches]), torch.cat([b.valid for b in batches]), rows,
            [s for b in batches for s in b.start_rows], a.layer_ids, a.num_experts, a.topk,
            kind, pv, provenance=concat_provenance([(b.provenance, b.num_seqs) for b in batches]),
            weights=_concat_weights(batches), engine=engine)

    def with_layers(self, layer_ids: Iterable[int]) -> "ReplayBatch":
        """Keep only ``layer_ids`` (in the given order). Raises if one is missing."""
        want = as_index_list(layer_ids, what="with_layers", error=LayerMappingError)
        check_layer_ids(tuple(want), len(want))          # duplicates would break the schema
        pos = {lid: j for j, lid in enumerate(self.layer_ids)}
        missing = [x for x in want if x not in pos]
        if missing:
            raise LayerMappingError(f"layers {missing} are not in this batch (it has {list(self.layer_ids)})")
        cols = torch.tensor([pos[x] for x in want], dtype=torch.int64, device=self.routes.device)
        return ReplayBatch(self.routes.index_select(1, cols), self.valid, self.rows_per_seq,
                           self.start_rows, tuple(want), self.num_experts, self.topk, self.route_kind,
                           self.policy_versions, self._offsets, self.provenance,
                           weights=None if self.weights is None else self.weights.index_select(1, cols),
                           engine=self.engine)

    def to(self, device: torch.device | str) -> "ReplayBatch":
        if torch.device(device).type == "meta":
            raise RouteShapeError("ReplayBatch.to('meta'): a meta tensor holds no routes")
        return ReplayBatch(self.routes.to(device), self.valid.to(device), self.rows_per_seq,
                           self.start_rows, self.layer_ids, self.num_experts, self.topk,
                           self.route_kind, self.policy_versions, self._offsets, self.provenance,
                           weights=None if self.weights is None else self.weights.to(device), engine=self.engine)

    def with_weights(self, weights: torch.Tensor | None) -> "ReplayBatch":
        """The same routes with ``weights`` (``[total_rows, L, K]`` real numbers, validated and
        stored as float16; ``None`` drops them)."""
        checked = None if weights is None else check_weights(weights, self.routes, self.valid, self.layer_ids,
                                                             self._offsets, self.start_rows)
        return ReplayBatch(self.routes, self.valid, self.rows_per_seq, self.start_rows, self.layer_ids,
                           self.num_experts, self.topk, self.route_kind, self.policy_versions, self._offsets,
                           self.provenance, weights=checked, engine=self.engine)

    def equals(self, other: "ReplayBatch") -> bool:
        """Same schema, coverage, validity, routes and weights (``route_kind``, ``engine``,
        ``policy_versions`` and ``provenance`` are not compared)."""
        if (self.weights is None) != (other.weights is None) or (
                self.weights is not None and not torch.equal(self.weights.cpu(), other.weights.cpu())):
            return False
        return (
            self.layer_ids == other.layer_ids and self.num_experts == other.num_experts
            and self.topk == other.topk and self.rows_per_seq == other.rows_per_seq
            and self.start_rows == other.start_rows and self.routes.dtype == other.routes.dtype
            and torch.equal(self.valid.cpu(), other.valid.cpu())
            and torch.equal(self.routes.cpu(), other.routes.cpu())
        )

    # ----------------------------------------------------------------------------- transport
    def to_bytes(self) -> bytes:
        """Versioned header + raw little-endian buffers (:mod:`r3bridge.batch.wire`). Never pickle: a
        pickled tensor is slow and unsafe to load."""
        return wire.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "ReplayBatch":
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise PayloadError(f"ReplayBatch payload must be bytes, got {type(data).__name__}")
        d = wire.decode(bytes(data))
        kind, engine = parse_route_label(d.label)
        # Re-validate: a payload from another process is input like any other.
        return cls.from_packed(d.routes, d.rows_per_seq, num_experts=d.num_experts, layer_ids=d.layer_ids,
                               start_rows=d.start_rows, valid=d.valid, route_kind=kind, engine=engine,
                               policy_versions=d.policy_versions, provenance=d.provenance, weights=d.weights)

    @property
    def nbytes(self) -> int:
        """``len(self.to_bytes())`` without building it."""
        return wire.encoded_size(self)


# --------------------------------------------------------------------------------- helpers
def _sequence_masks(valid: Sequence | None, rows: Sequence[int]) -> list[torch.Tensor] | None:
    """One 0/1 validity mask per sequence, each of its sequence's row count (None: none given)."""
    if valid is None:
        return None
    if len(valid) != len(rows):
        raise CoverageError(f"valid has {len(valid)} entries for {len(rows)} sequences")
    masks = [as_mask(x, what=f"sequence {i}: valid", error=CoverageError) for i, x in enumerate(valid)]
    for i, x in enumerate(masks):
        if x.shape != (rows[i],):
            raise CoverageError(f"sequence {i}: valid mask has shape {tuple(x.shape)}, routes have {rows[i]} rows")
    return masks


def _opt_ids(xs, what: str, error) -> list[int] | None:
    return None if xs is None else as_index_list(xs, what=what, error=error)


def _sglang_numbers(mi, i: int):
    """A meta_info with its token counts checked as integers (10.5 or inf would be truncated or
    raise a foreign error in int()) and its routes readable; format checks stay in ingest."""
    if not isinstance(mi, Mapping):
        return mi
    out = dict(mi)
    for key in ("prompt_tokens", "completion_tokens"):
        if key in out:
            out[key] = as_index(out[key], what=f"sequence {i}: meta_info[{key!r}]", error=PayloadError)
    if isinstance(out.get("routed_experts"), torch.Tensor):
        check_readable(out["routed_experts"], what=f"sequence {i}: routed_experts", error=PayloadError)
    return out


def _ragged_weights(weights: Sequence, batch: "ReplayBatch") -> torch.Tensor:
    """Per-sequence weights -> one packed tensor, each checked against its sequence's routes."""
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__") or len(weights) != batch.num_seqs:
        raise RouteWeightsError(f"weights must be one array per sequence ({batch.num_seqs}), got {type(weights).__name__}"
                                f"{'' if not hasattr(weights, '__len__') else f' of {len(weights)}'}")
    parts = []
    for i, w in enumerate(weights):
        t = as_weights_tensor(w, what=f"sequence {i}: weights")
        want = (batch.rows_per_seq[i], batch.num_layers, batch.topk)
        if tuple(t.shape) != want:
            raise RouteWeightsError(f"sequence {i}: weights have shape {tuple(t.shape)}, its routes {list(want)}")
        parts.append(t.to(torch.float32))
    if not parts:
        return torch.zeros((0, batch.num_layers, batch.topk), dtype=torch.float32)
    return torch.cat(parts)


def _concat_weights(batches: Sequence["ReplayBatch"]) -> torch.Tensor | None:
    """The batches' weights end to end; a mix of batches with and without raises (dropping the
    weights of some would make later log-ratios silently partial)."""
    have = [b.weights is not None for b in batches]
    if not any(have):
        return None
    if not all(have):
        j = have.index(not have[0])
        raise RouteWeightsError(f"concat: batch {j} {'has' if have[j] else 'lacks'} routing weights, batch 0 "
                                f"{'has' if have[0] else 'lacks'} them")
    return torch.cat([b.weights for b in batches])  # type: ignore[misc]


def _host_arrays(routes: Sequence) -> list[np.ndarray] | None:
    """numpy views of per-sequence ``[rows, L, K]`` integer host arrays / CPU tensors, or None
    when any is something else (nested lists, a device tensor, a float or 2-D array: the general
    path converts or refuses it with its own error)."""
    if not isinstance(routes, (list, tuple)) or not routes:
        return None
    out = []
    for r in routes:
        a = host_array(r)
        if a is None or a.ndim != 3 or a.dtype.kind not in "iu":
            return None
        out.append(a)
    return out


def _canonical(routes: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Narrow to the schema dtype and write distinct fillers ``0..K-1`` into invalid rows."""
    out = routes.to(route_dtype(num_experts))
    if out.data_ptr() == routes.data_ptr():
        out = out.clone()  # never alias the caller's buffer: we write fillers into it
    if not bool(valid.all()):
        k = out.shape[2]
        filler = torch.arange(k, dtype=out.dtype, device=out.device)
        out[~valid] = filler
    return out


def ragged_arange(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """concat(arange(s, s + l) for s, l) without a Python loop."""
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum()) if lengths.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    seg_start = torch.cumsum(lengths, 0) - lengths
    # output_size: no size sync on GPU, and ~10x less CPU time for small inputs
    rep_start = torch.repeat_interleave(starts.to(torch.int64) - seg_start, lengths, output_size=total)
    return torch.arange(total, dtype=torch.int64) + rep_start

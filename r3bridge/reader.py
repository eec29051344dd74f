"""The one reader: what a framework hands over for one micro-batch -> one rank's router targets.

Every route that reaches a router comes through here: the public ``shard`` (a validated
``ReplayBatch``), ``rank_targets`` (vLLM's engine arrays), the driver's install of every adapter's
micro-batch (verl's nested field, SkyRL's packed or padded field, AReaL's trajectories, the
template's padded dict) for R3 and R2 alike. The data flow, once per micro-batch:

1. :class:`HandedRoutes` - the framework's own buffers, *viewed* (no copy, no id read): where row
   ``j`` of sequence ``i`` lives, which source column holds each MoE layer, how the transport
   writes "no route" (an explicit mask, zero rows past what the engine captured, a sentinel, or
   nothing: every handed row is a route). Metadata is checked here, once.
2. :class:`RankRows` - the pack plan (``packing.PackPlan``, the trainer's real ``cu_seqlens``
   when given) and this rank's row map: for each router row, its sequence, token, and whether
   and where the handed routes hold it. Built once per micro-batch; the driver's counts, every
   VPP chunk's read and a late recompute share it.
3. :func:`read_targets` - gathers this rank's rows of one chunk's layers in the source dtype
   (one index gather, or one copy per run of engine rows), moves them to the router's device,
   checks every id it read in one pass there (range, and distinct within the row: a sort on
   the GPU, a sorting network on the host, :mod:`r3bridge.route_scan`), writes fillers into rows
   without a route and widens to int64. An id is checked by the rank that reads it, once.

**Degenerate routes** (vLLM #54730: a kernel skipped the capture and every token "took expert
0"): inside a sample's captured rows, a row whose ids repeat is a *degenerate* route, not a
missing one. ``degenerate="refuse"`` (the default, ``ReplayConfig.degenerate_routes``) raises a
:class:`r3bridge.errors.DegenerateRouteError` naming the sample, row, token and layer before
anything is installed; ``"native"`` routes those rows natively and counts them. Rows past what
the engine captured (tail padding, multi-turn tails, padding samples) are "no route", decided by
the sample's captured range, never by a row's content alone: in a zero-row transport the
captured range ends at the sample's last non-zero row (:meth:`HandedRoutes.captured_rows`).
With top-1 an expert-0 row cannot be told from a zero row: zero rows stay "no route" there.
:func:`engine_row_report` runs the same classification on engine payloads alone.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from r3bridge._validate import as_index, as_index_list, check_readable, native_order, route_value_error
from r3bridge.batch_meta import check_coverage, checked_meta
from r3bridge.decoders import decode_vllm_routes, decode_vllm_weights
from r3bridge.engine_pack import allocate, check_shapes, host_array, layer_columns
from r3bridge.errors import (
    ConfigError,
    CoverageError,
    LayerMappingError,
    LayoutError,
    ReplayError,
    RouteShapeError,
    RouteWeightsError,
)
from r3bridge.layer_axis import ALL_HIDDEN, MOE_ONLY, axis_columns, check_layer_axis
from r3bridge.layer_ids import shifted_layer_ids_hint
from r3bridge.layout import ParallelLayout
from r3bridge.packing import PackPlan, checked_ranks, rank_positions, sp_bounds
from r3bridge.route_scan import block_rows, row_faults, run_blocks

__all__ = ["HandedRoutes", "RankRows", "ShardedTargets", "ReadCounts", "ReadStats", "read_targets", "rank_targets",
           "checked_rank_args", "engine_row_report", "EngineRowReport", "DEGENERATE_CHOICES", "NO_ROUTE_KINDS",
           "naming_samples"]

DEGENERATE_CHOICES = ("refuse", "native")
# How a transport writes "no route": "none" every handed row is a route (vLLM arrays); "mask" an
# explicit per-row mask; "zero" rows past the sample's last non-zero row (verl, SkyRL 0.3);
# "sentinel" rows whose ids all equal a value no expert id takes (AReaL's trajectories).
NO_ROUTE_KINDS = ("none", "mask", "zero", "sentinel")

# exact torch dtype for a source dtype (uint16 / uint32 have no complete torch support: widened
# on the copy, never wrapped)
_HOLDS = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int8): torch.int8, np.dtype(np.int16): torch.int16,
          np.dtype(np.uint16): torch.int32, np.dtype(np.int32): torch.int32, np.dtype(np.uint32): torch.int64,
          np.dtype(np.int64): torch.int64, np.dtype(np.uint64): torch.int64}
_TORCH_INT = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass
class ShardedTargets:
    """One rank's replay targets for one micro-batch.

    ``indices[layer_id]`` is the int64 ``[T_local, K]`` target of that MoE layer's router, rows in
    router order; ``valid[r]`` is False where row ``r`` has no route (filler ids ``0..K-1``).
    """

    indices: dict[int, torch.Tensor]
    valid: torch.Tensor
    layer_ids: tuple[int, ...]
    topk: int
    num_valid: int | None = None    # valid.sum(), counted on the host (no device sync)
    # the rollout's gate weight of each target id (float32 [T_local, K] per layer, 0 on rows
    # without a route); None when the routes carry no weights
    weights: dict[int, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.valid.numel())

    @property
    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self.indices.values()) + self.valid.numel()
                + sum(t.numel() * t.element_size() for t in (self.weights or {}).values()))


@dataclass
class ReadStats:
    """How a driver read its routes, over its life (a trace of the path, cheap enough to keep on):
    ``reads`` (:func:`read_targets` calls: one per chunk and micro-batch, plus late recomputes),
    ``row_maps`` (:class:`RankRows` built: one per micro-batch, whatever its chunks), ``routes``
    (micro-batches' handed routes read: one per micro-batch) and ``forms`` (how many of those
    came in each (storage form, "no route" kind, source): what the adapters handed over)."""

    reads: int = 0
    row_maps: int = 0
    routes: int = 0
    forms: dict = field(default_factory=dict)

    def saw(self, routes: "HandedRoutes") -> None:
        self.routes += 1
        key = f"{routes.form}/{routes.no_route}/{routes.source}"
        self.forms[key] = self.forms.get(key, 0) + 1

    def as_dict(self) -> dict:
        return {"reads": self.reads, "row_maps": self.row_maps, "routes": self.routes, "forms": dict(self.forms)}


@dataclass
class ReadCounts:
    """What one read saw, per sequence of the micro-batch (this rank's rows of the layers read):
    rows replayed, and rows whose route was degenerate (routed natively under ``"native"``)."""

    replayed: np.ndarray            # int64 [num_seqs]
    degenerate: np.ndarray          # int64 [num_seqs]


# ------------------------------------------------------------------------------------ argument checks
def checked_rank_args(tp_rank: Any, cp_rank: Any, pp_rank: Any, vp_stage: Any, layer_ids: Any,
                      device: Any, *, what: str) -> tuple[int, int, int, int, Optional[list[int]], Optional[torch.device]]:
    """The rank, layer and device arguments every entry (``shard``, ``rank_targets``, the driver)
    takes, converted once."""
    tp_rank, cp_rank, pp_rank, vp_stage = (as_index(v, what=name, error=LayoutError) for v, name in (
        (tp_rank, "tp_rank"), (cp_rank, "cp_rank"), (pp_rank, "pp_rank"), (vp_stage, "vp_stage")))
    if layer_ids is not None:
        layer_ids = as_index_list(layer_ids, what="layer_ids", error=LayerMappingError)
    dev = None if device is None else torch.device(device)
    if dev is not None and dev.type == "meta":
        raise LayoutError(f"{what}: device='meta' would hold no values (targets must be readable)")
    return tp_rank, cp_rank, pp_rank, vp_stage, layer_ids, dev


def _exact_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _TORCH_INT:
            return dtype
        if dtype in (torch.uint16, torch.uint32, torch.uint64):
            return torch.int32 if dtype == torch.uint16 else torch.int64
        raise RouteShapeError(f"routes must have an integer dtype, got {dtype}")
    dt = np.dtype(dtype)
    if dt.kind not in "iu":
        raise RouteShapeError(f"routes must have an integer dtype, got {dt}")
    return _HOLDS[dt.newbyteorder("=")]


# ------------------------------------------------------------------------------------ handed routes
@dataclass(eq=False)
class HandedRoutes:
    """One micro-batch's routes as a framework hands them over: its buffers viewed, nothing
    copied, no id read. Built by the ``from_*`` constructors (each checks the metadata once).

    Storage: ``grid`` is a tensor ``[B, S, L_src, K]`` (any strides; a packed ``[N, L, K]`` buffer
    is ``[1, N, L, K]``), sequence ``i``'s row ``j`` at ``grid[seq_b[i], seq_s0[i] + j]``; or
    ``arrays``, one host array ``[rows_i, L_src, K]`` per sequence (engine outputs). ``columns``:
    the source column of each of ``layer_ids`` (None: the identity)."""

    rows: list[int]
    starts: list[int]
    layer_ids: tuple[int, ...]
    columns: Optional[list[int]]
    num_experts: int
    topk: int
    no_route: str = "none"
    source: str = "rollout"
    trusted: bool = False              # ids in range and distinct by construction: not re-checked
    form: str = "batch"                # the constructor: batch, engine, packed, padded, sequence_last
    grid: Optional[torch.Tensor] = None
    seq_b: Optional[np.ndarray] = None
    seq_s0: Optional[np.ndarray] = None
    arrays: Optional[list[np.ndarray]] = None
    mask: Optional[torch.Tensor] = None            # "mask": bool [B, S] of the grid (True = a route)
    sentinel: Optional[int] = None                 # "sentinel": the no-route value
    names: Optional[list[str]] = None              # how errors name each sequence
    # whose names they are: errors then lead with "<framework> sample <name>: " (the adapters')
    framework: Optional[str] = None
    weights_grid: Optional[torch.Tensor] = None    # routing weights, the routes' storage and shape
    weights_arrays: Optional[list[np.ndarray]] = None
    _captured: Optional[np.ndarray] = field(default=None, repr=False)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_batch(cls, batch: Any) -> "HandedRoutes":
        """A validated :class:`r3bridge.ReplayBatch` (its ids are not checked again)."""
        check_readable(batch.routes, what="shard: batch routes", error=RouteShapeError)
        valid = batch.valid
        all_valid = bool(valid.all()) if valid.numel() else True
        return cls(list(batch.rows_per_seq), list(batch.start_rows), tuple(batch.layer_ids), None,
                   batch.num_experts, batch.topk, "none" if all_valid else "mask", batch.source, True, "batch",
                   grid=batch.routes[None], seq_b=np.zeros(batch.num_seqs, dtype=np.int64),
                   seq_s0=batch.offsets[:-1].numpy().astype(np.int64),
                   mask=None if all_valid else valid[None],
                   weights_grid=None if batch.weights is None else batch.weights[None])

    @classmethod
    def from_engine(cls, items: Sequence[Any], *, num_experts: int, moe_layer_ids: Optional[Sequence[int]] = None,
                    start_rows: Optional[Sequence[int]] = None, layer_axis: Optional[str] = ALL_HIDDEN,
                    weights: Optional[Sequence[Any]] = None, source: str = "rollout",
                    names: Optional[Sequence[str]] = None, framework: Optional[str] = None) -> "HandedRoutes":
        """vLLM-style per-sequence engine outputs (any transport
        :func:`r3bridge.decoders.decode_vllm_routes` reads: ``[rows, num_hidden_layers, K]``), every
        handed row a route; ``moe_layer_ids`` selects the MoE layers by id."""
        num_experts = as_index(num_experts, what="num_experts", error=RouteShapeError)
        axis = check_layer_axis(layer_axis) or ALL_HIDDEN
        moe = None if moe_layer_ids is None else as_index_list(moe_layer_ids, what="moe_layer_ids",
                                                                error=LayerMappingError)
        if axis == MOE_ONLY and moe is None:
            raise LayerMappingError("routes with layer_axis='moe_only' need moe_layer_ids")
        arrays = [_host(decode_vllm_routes(it, seq=i)) for i, it in enumerate(items)]
        if arrays:
            check_shapes([a[:0] for a in arrays])
        reported = int(arrays[0].shape[1]) if arrays else (len(moe) if moe is not None else 0)
        cols = None if moe is None else axis_columns(reported, layer_axis=axis, moe_layer_ids=moe,
                                                     field="sequence 0")
        layer_ids = moe if moe is not None else list(range(reported))
        k = int(arrays[0].shape[2]) if arrays else 1
        rows = [int(a.shape[0]) for a in arrays]
        rows, layer_ids, k, num_experts, starts, _ = checked_meta(
            (sum(rows), len(layer_ids), k), rows, num_experts, layer_ids, start_rows, None)
        w = None
        if weights is not None:
            if len(weights) != len(arrays):
                raise RouteWeightsError(f"{len(weights)} weight arrays for {len(arrays)} sequences")
            w = []
            for i, payload in enumerate(weights):
                wi = decode_vllm_weights(payload, seq=i)
                if tuple(wi.shape) != tuple(arrays[i].shape):
                    raise RouteWeightsError(f"sequence {i}: weights have shape {tuple(wi.shape)}, its routes "
                                            f"{tuple(arrays[i].shape)}")
                w.append(wi)
        return cls(rows, starts, layer_ids, cols, num_experts, k, "none", source, False, "engine", arrays=arrays,
                   names=None if names is None else list(names), framework=framework, weights_arrays=w)

    @classmethod
    def from_packed(cls, values: Any, rows_per_seq: Sequence[int], *, num_experts: int, layer_ids: Sequence[int],
                    columns: Optional[Sequence[int]] = None, no_route: str = "none", valid: Any = None,
                    sentinel: Optional[int] = None, source: str = "rollout", names: Optional[Sequence[str]] = None,
                    weights: Any = None, framework: Optional[str] = None) -> "HandedRoutes":
        """One packed buffer ``[sum rows, L_src, K]`` (verl's nested values, SkyRL 0.4's
        ``PackedTensor``), sequences consecutive; ``valid`` ``[sum rows]`` with ``no_route="mask"``."""
        v = _int_tensor(values, what="routes")
        if v.dim() != 3:
            raise RouteShapeError(f"packed routes must be [rows, layers, topk], got shape {tuple(v.shape)}")
        rows = as_index_list(rows_per_seq, what="rows_per_seq", error=CoverageError)
        offs = np.zeros(len(rows) + 1, dtype=np.int64)
        offs[1:] = np.cumsum(rows)
        m = None
        if valid is not None:
            m = _mask_tensor(valid, what="valid")
            if tuple(m.shape) != (v.shape[0],):
                raise CoverageError(f"valid has shape {tuple(m.shape)}, routes have {v.shape[0]} rows")
            m = m[None]
        w = None if weights is None else _weights_tensor(weights, v)[None]
        return cls._checked("packed", v[None], np.zeros(len(rows), dtype=np.int64), offs[:-1], rows, None,
                            num_experts, layer_ids, columns, no_route, m, sentinel, source, names, w, framework)

    @classmethod
    def from_padded(cls, routes: Any, attention_mask: Any, *, num_experts: int, layer_ids: Sequence[int],
                    columns: Optional[Sequence[int]] = None, no_route: str = "none", valid: Any = None,
                    sentinel: Optional[int] = None, source: str = "rollout",
                    names: Optional[Sequence[str]] = None, framework: Optional[str] = None) -> "HandedRoutes":
        """A padded ``[B, S, L_src, K]`` field and its ``[B, S]`` mask (left or right padding): one
        row per unmasked token; ``valid`` ``[B, S]`` with ``no_route="mask"``."""
        r = _int_tensor(routes, what="padded routes")
        if r.dim() != 4:
            raise RouteShapeError(f"padded routes must be [batch, seq, layers, topk], got shape {tuple(r.shape)}")
        attn = _mask_tensor(attention_mask, what="attention_mask")
        if tuple(attn.shape) != tuple(r.shape[:2]):
            raise RouteShapeError(f"attention_mask shape {tuple(attn.shape)} does not match routes' [batch, seq] "
                                  f"{tuple(r.shape[:2])}")
        first, lens = padded_spans(attn)
        m = None
        if valid is not None:
            m = _mask_tensor(valid, what="valid")
            if tuple(m.shape) != tuple(attn.shape):
                raise RouteShapeError(f"valid mask shape {tuple(m.shape)} does not match attention_mask "
                                      f"{tuple(attn.shape)}")
        return cls._checked("padded", r, np.arange(len(lens), dtype=np.int64), first, lens, None, num_experts,
                            layer_ids, columns, no_route, m, sentinel, source, names, None, framework)

    @classmethod
    def from_sequence_last(cls, routes: Any, rows: Sequence[int], lens: Sequence[int], *, num_experts: int,
                           layer_ids: Sequence[int], sentinel: int, source: str = "rollout",
                           names: Optional[Sequence[str]] = None, framework: Optional[str] = None) -> "HandedRoutes":
        """Rows ``rows`` of a ``[B, L, K, S]`` field (sequence last: AReaL's trajectories), tokens
        ``[0, lens[i])`` of each, ``sentinel`` where a token has no route."""
        t = _int_tensor(routes, what="routes")
        if t.dim() != 4:
            raise RouteShapeError(f"routes must be [batch, layers, topk, seq], got {tuple(t.shape)}")
        b = np.asarray(as_index_list(rows, what="rows", error=CoverageError), dtype=np.int64)
        n = as_index_list(lens, what="lens", error=CoverageError)
        if len(b) != len(n):
            raise CoverageError(f"{len(b)} rows for {len(n)} lengths")
        if b.size and (b.min() < 0 or b.max() >= t.shape[0]):
            raise CoverageError(f"rows {b.tolist()} out of range for {t.shape[0]} trajectories")
        bad = [x for x in n if x > t.shape[3]]
        if bad:
            raise CoverageError(f"sequence of {bad[0]} tokens, routes tensor holds {t.shape[3]}")
        return cls._checked("sequence_last", t.permute(0, 3, 1, 2), b, np.zeros(len(n), dtype=np.int64), n, None,
                            num_experts, layer_ids, None, "sentinel", None, sentinel, source, names, None, framework)

    @classmethod
    def _checked(cls, form, grid, seq_b, seq_s0, rows, starts, num_experts, layer_ids, columns, no_route, mask,
                 sentinel, source, names, weights_grid, framework=None) -> "HandedRoutes":
        if no_route not in NO_ROUTE_KINDS:
            raise RouteShapeError(f"no_route must be one of {NO_ROUTE_KINDS}, got {no_route!r}")
        if (no_route == "mask") != (mask is not None):
            raise CoverageError("no_route='mask' needs a validity mask (and only it takes one)")
        if no_route == "sentinel" and sentinel is None:
            raise RouteShapeError("no_route='sentinel' needs the sentinel value")
        ids = list(layer_ids)
        cols = None if columns is None else as_index_list(columns, what="layer columns", error=LayerMappingError)
        if cols is not None and (len(cols) != len(ids) or (cols and not 0 <= min(cols) <= max(cols) < grid.shape[2])):
            raise LayerMappingError(f"layer columns {cols} do not fit {grid.shape[2]} reported layers for layer ids {ids}")
        nl = len(ids) if cols is not None else int(grid.shape[2])
        rows, layer_ids, k, num_experts, starts, _ = checked_meta(
            (sum(int(r) for r in rows), nl, int(grid.shape[3])), list(rows), num_experts, ids, starts, None)
        return cls(rows, starts, layer_ids, cols, num_experts, k, no_route, source, False, form, grid=grid,
                   seq_b=np.asarray(seq_b, dtype=np.int64), seq_s0=np.asarray(seq_s0, dtype=np.int64), mask=mask,
                   sentinel=sentinel, names=None if names is None else list(names), framework=framework,
                   weights_grid=weights_grid)

    # ------------------------------------------------------------------ properties
    @property
    def num_seqs(self) -> int:
        return len(self.rows)

    @property
    def device(self) -> torch.device:
        return self.grid.device if self.grid is not None else torch.device("cpu")

    @property
    def has_weights(self) -> bool:
        return self.weights_grid is not None or self.weights_arrays is not None

    def name(self, i: int) -> str:
        if not self.names or i >= len(self.names):
            return f"sequence {i}"
        return self.names[i] if self.framework is None else f"{self.framework} sample {self.names[i]}"

    def with_empty_sequences(self, seq_lens: Sequence[int]) -> "HandedRoutes":
        """These routes followed by one sequence without any route per entry of ``seq_lens``
        (packing padding the trainer runs as a sequence): no rows, starting past its last token,
        nothing copied."""
        lens = [int(n) for n in seq_lens]
        if not lens:
            return self
        count = len(lens)
        out = HandedRoutes(**{f: getattr(self, f) for f in self.__dataclass_fields__ if f != "_captured"})
        out.rows = self.rows + [0] * count
        out.starts = self.starts + lens
        if self.arrays is not None:
            shape = tuple(self.arrays[0].shape[1:]) if self.arrays else (len(self.layer_ids), self.topk)
            dtype = self.arrays[0].dtype if self.arrays else np.dtype(np.uint8)
            out.arrays = self.arrays + [np.zeros((0,) + shape, dtype)] * count
            if self.weights_arrays is not None:
                out.weights_arrays = self.weights_arrays + [np.zeros((0,) + shape, np.float32)] * count
        else:
            out.seq_b = np.concatenate([self.seq_b, np.zeros(count, dtype=np.int64)])
            out.seq_s0 = np.concatenate([self.seq_s0, np.zeros(count, dtype=np.int64)])
        if self.names is not None:
            out.names = self.names + [f"padding sequence {j}" for j in range(count)]
        if self._captured is not None:
            out._captured = np.concatenate([self._captured, np.zeros(count, dtype=np.int64)])
        return out

    def any_route(self) -> bool:
        """Whether any handed row may hold a route (no id read: masks and captured ranges only)."""
        if self.no_route == "mask":
            return bool(self.mask.any())
        return int(self.captured_rows().sum()) > 0

    # ------------------------------------------------------------------ zero-row transports
    def captured_rows(self) -> np.ndarray:
        """Rows the engine captured per sequence: every handed row, except in a zero-row
        transport (``no_route="zero"``, top-k > 1), where a sequence's captured rows end at its
        last row with a non-zero id in any MoE layer (tails past it are "no route"; a zero row
        before it is a degenerate route). Found from each sequence's end, in blocks that double
        (a tail is a few rows), all sequences at once; cached."""
        if self._captured is not None:
            return self._captured
        rows = np.asarray(self.rows, dtype=np.int64)
        if self.no_route != "zero" or self.topk == 1 or not rows.size:
            self._captured = rows.copy()
            return self._captured
        end = rows.copy()                  # rows [end, rows) are known zero
        done = end == 0
        block = 8
        while not done.all():
            pend = np.flatnonzero(~done)
            lo = np.maximum(end[pend] - block, 0)
            span = end[pend] - lo
            seq = np.repeat(pend, span)
            j = np.repeat(lo - np.cumsum(span) + span, span) + np.arange(int(span.sum()))
            nz = self._gather_rows(seq, j, None).ne(0).flatten(1).any(1).cpu().numpy()
            last = np.full(len(pend), -1, dtype=np.int64)
            hit = np.flatnonzero(nz)
            if hit.size:
                owner = np.searchsorted(np.cumsum(span), hit, side="right")
                np.maximum.at(last, owner, j[hit])
            found = last >= 0
            end[pend[found]] = last[found] + 1
            done[pend[found]] = True
            end[pend[~found]] = lo[~found]
            done[pend[~found & (lo == 0)]] = True
            block *= 2
        self._captured = end
        return end

    # ------------------------------------------------------------------ the whole batch
    def to_batch(self, *, degenerate: str = "refuse", drop_final_invalid: Optional[bool] = None,
                 invalid_rows: str = "native") -> Any:
        """Every handed row as a canonical :class:`r3bridge.ReplayBatch` (where a framework needs
        the whole batch: R2 write-backs, a codec's ``to_replay_batch``, the conformance checks), by
        the reader's rules: ids checked once, "no route" from the transport (explicit mask,
        captured range, sentinel), degenerate rows refused or (``"native"``) marked without a
        route; a sequence's final row without a route dropped (the last sampled token is never fed
        forward; default: for rollout routes, recorded ones route every token).
        ``invalid_rows="error"``: a row without a usable route (a degenerate one too) is refused,
        naming the sequence and its token (``ReplayConfig.invalid_rows``' rule, for the whole
        batch). With a ``framework``, every error leads with the framework's name of the sample."""
        if invalid_rows not in ("native", "error"):
            raise ConfigError(f"invalid_rows must be 'native' or 'error', got {invalid_rows!r}")
        drop = self.source != "recorded" if drop_final_invalid is None else drop_final_invalid
        names = [self.name(i) for i in range(self.num_seqs)] if self.framework is not None and self.names else []
        with naming_samples(names):
            batch = self._whole_batch("native" if invalid_rows == "error" else degenerate, drop)
            if invalid_rows == "error" and not bool(batch.valid.all()):
                bad = int((~batch.valid).nonzero()[0])
                seq = int((batch.offsets[1:] <= bad).sum())
                token = batch.start_rows[seq] + bad - int(batch.offsets[seq])
                raise CoverageError(f"sequence {seq}: token {token} has no route and r3bridge.invalid_rows='error'")
        return batch

    def _whole_batch(self, degenerate: str, drop_final_invalid: bool) -> Any:
        from r3bridge.schema import ReplayBatch, route_dtype

        if self.arrays is not None and self.no_route == "none" and self.weights_arrays is None:
            return ReplayBatch._from_host(self.arrays, self.columns, num_experts=self.num_experts,
                                          layer_ids=self.layer_ids, start_rows=self.starts, source=self.source)
        n, rows = self.num_seqs, np.asarray(self.rows, dtype=np.int64)
        offs = np.zeros(n + 1, dtype=np.int64)
        offs[1:] = np.cumsum(rows)
        seq = np.repeat(np.arange(n, dtype=np.int64), rows)
        j = np.arange(int(offs[-1]), dtype=np.int64) - np.repeat(offs[:-1], rows)
        covered = j < self.captured_rows()[seq]
        if self.no_route == "mask" and covered.any():
            b = torch.from_numpy(self.seq_b[seq]).to(self.mask.device)
            covered &= self.mask[b, torch.from_numpy(self.seq_s0[seq] + j).to(self.mask.device)].cpu().numpy()
        starts = np.asarray(self.starts, dtype=np.int64)
        rr = RankRows(None, seq, starts[seq] + j, j, covered, int(j.size))      # type: ignore[arg-type]
        cols = list(range(len(self.layer_ids)))
        compact = _gather(self, rr, covered, cols)                             # [nl, N, K]
        covered &= ~_unrouted_rows(compact, self, covered)
        if not self.trusted and covered.any():
            covered, _ = _check(compact, covered, self, rr, list(self.layer_ids), cols, degenerate)
        routes = compact.permute(1, 0, 2).to(route_dtype(self.num_experts))     # exact: checked in range
        weights = None
        if self.has_weights:
            weights = torch.stack(list(_read_weights(self, rr, covered, cols, list(self.layer_ids),
                                                     compact.device).values()), 1).to(torch.float16)
        keep = None
        if drop_final_invalid and n:
            last = offs[1:] - 1
            has = rows > 0
            drop = np.zeros(n, dtype=bool)
            drop[has] = ~covered[last[has]]
            if drop.any():
                keep = np.ones(int(offs[-1]), dtype=bool)
                keep[last[drop]] = False
                rows = rows - drop
        if keep is not None:
            k_t = torch.from_numpy(keep).to(routes.device)
            routes, covered = routes[k_t], covered[keep]
            weights = None if weights is None else weights[k_t]
        else:
            routes = routes.contiguous()
        valid = torch.from_numpy(np.ascontiguousarray(covered)).to(routes.device)
        if not bool(covered.all()):
            routes = routes.clone() if routes.data_ptr() == compact.data_ptr() else routes
            routes[~valid] = torch.arange(self.topk, dtype=routes.dtype, device=routes.device)
        batch = ReplayBatch(routes, valid, rows.tolist(), list(self.starts), tuple(self.layer_ids), self.num_experts,
                            self.topk, self.source)
        return batch if weights is None else ReplayBatch(
            batch.routes, batch.valid, batch.rows_per_seq, batch.start_rows, batch.layer_ids, batch.num_experts,
            batch.topk, batch.source, weights=weights)

    # ------------------------------------------------------------------ gathers
    def _gather_rows(self, seq: np.ndarray, j: np.ndarray, cols: Optional[list[int]]) -> torch.Tensor:
        """``[T, nl, K]`` rows ``j`` of sequences ``seq`` (row-major; small reads)."""
        cols = self._source_cols(cols)
        if self.grid is not None:
            return _pick(self.grid, self.seq_b[seq], self.seq_s0[seq] + j, cols)
        out = [self.arrays[int(i)][int(r)] for i, r in zip(seq, j)]
        a = np.stack(out) if out else np.zeros((0,) + self.arrays[0].shape[1:], dtype=self.arrays[0].dtype)
        return torch.from_numpy(native_order(a if cols is None else a[:, cols]))

    def _source_cols(self, cols: Optional[list[int]]) -> Optional[list[int]]:
        """Source columns of the layer positions ``cols`` (None: every layer of ``layer_ids``)."""
        if cols is None:
            return self.columns
        return list(cols) if self.columns is None else [self.columns[c] for c in cols]


def padded_spans(attn: torch.Tensor) -> tuple[np.ndarray, list[int]]:
    """(first unmasked column, unmasked count) of each row of a ``[B, S]`` mask; holes refused."""
    m = attn.bool().cpu().numpy()          # host arrays: small torch ops on CPU stall on thread barriers
    lens = m.sum(1)
    first = np.where(lens > 0, m.argmax(1), 0).astype(np.int64)
    pos = np.arange(m.shape[1])
    expect = (pos[None, :] >= first[:, None]) & (pos[None, :] < (first + lens)[:, None])
    bad = np.flatnonzero((expect != m).any(1))
    if bad.size:
        raise CoverageError(f"sequence {int(bad[0])}: attention_mask has holes; only left or right padding "
                            f"is supported")
    return first, lens.tolist()


def _host(a: Any) -> np.ndarray:
    h = host_array(a)
    if h is None:       # a device / odd tensor: one sequence to the host (never the batch)
        h = a.detach().cpu().numpy()
    return h


def _int_tensor(x: Any, *, what: str) -> torch.Tensor:
    """A tensor view of an integer buffer (a numpy array is shared, never copied, unless torch
    cannot hold its dtype exactly: then one exact widening copy)."""
    if isinstance(x, torch.Tensor):
        check_readable(x, what=what, error=RouteShapeError)
        t = x.detach()
        if t.dtype not in _TORCH_INT:
            t = t.to(_exact_dtype(t.dtype))
        return t
    a = np.asarray(x)
    dt = _exact_dtype(a.dtype)
    a = native_order(a)
    held = torch.empty((), dtype=dt).numpy().dtype
    if a.dtype != held:
        a = a.astype(held)                  # exact widening (uint16 -> int32, ...)
    with warnings.catch_warnings():         # a read-only engine buffer is shared, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _mask_tensor(x: Any, *, what: str) -> torch.Tensor:
    from r3bridge._validate import as_mask
    return as_mask(x, what=what, error=CoverageError)


def _weights_tensor(w: Any, like: torch.Tensor) -> torch.Tensor:
    from r3bridge.route_weights import as_weights_tensor
    t = as_weights_tensor(w, what="weights")
    if tuple(t.shape) != tuple(like.shape):
        raise RouteWeightsError(f"weights have shape {tuple(t.shape)}, routes {tuple(like.shape)}: one weight per "
                                f"(row, layer, k)")
    return t


# ------------------------------------------------------------------------------------ this rank's rows
@dataclass
class RankRows:
    """A micro-batch's pack plan and this rank's row map (router row order), built once.

    ``seq[t]`` / ``pos[t]``: sequence and token position of router row ``t`` (positions ``>=
    seq_len`` are packing padding); ``covered[t]``: the handed routes hold a route for it, at
    source row ``src[t]`` of its sequence (explicit masks and captured ranges applied)."""

    plan: PackPlan
    seq: np.ndarray
    pos: np.ndarray
    src: np.ndarray
    covered: np.ndarray
    token_rows: int

    @classmethod
    def build(cls, layout: ParallelLayout, seq_lens: Any, *, tp_rank: int, cp_rank: int, format: str = "thd",
              cu_seqlens_padded: Any = None, seq_length: Optional[int] = None) -> "RankRows":
        """The plan and the positions; :meth:`cover` fills what the routes hold."""
        plan = PackPlan.build(layout, seq_lens, format=format, cu_seqlens_padded=cu_seqlens_padded,
                              seq_length=seq_length)
        seq, pos = _positions(plan, layout, tp_rank, cp_rank)
        lens = plan.seq_lens.numpy()
        real = pos < lens[seq] if seq.size else np.zeros(0, dtype=bool)
        return cls(plan, seq, pos, np.zeros(seq.size, dtype=np.int64), np.zeros(seq.size, dtype=bool),
                   int(real.sum()))

    @property
    def num_rows(self) -> int:
        return int(self.seq.size)

    def cover(self, routes: HandedRoutes) -> "RankRows":
        """The same plan with ``routes``' coverage: a row is covered where its token lies in
        ``[start, start + captured)`` of its sequence (and before ``seq_len``) and, with a mask,
        the mask says so. Checks the routes fit the trainer's token counts."""
        lens = self.plan.seq_lens.numpy()
        if routes.num_seqs != lens.size:
            raise CoverageError(f"batch has {routes.num_seqs} sequences but {lens.size} seq_lens were given")
        check_coverage(routes.starts, routes.rows, lens.tolist())
        if not self.seq.size:
            return self
        starts = np.asarray(routes.starts, dtype=np.int64)
        hi = np.minimum(starts + routes.captured_rows(), lens)
        seq, pos = self.seq, self.pos
        covered = (pos >= starts[seq]) & (pos < hi[seq])
        src = np.where(covered, pos - starts[seq], 0)
        if routes.no_route == "mask" and covered.any():
            idx = np.flatnonzero(covered)
            b = torch.from_numpy(routes.seq_b[seq[idx]]).to(routes.mask.device)
            s = torch.from_numpy(routes.seq_s0[seq[idx]] + src[idx]).to(routes.mask.device)
            covered[idx] = routes.mask[b, s].cpu().numpy()
        return RankRows(self.plan, seq, pos, src, covered, self.token_rows)


def _positions(plan: PackPlan, layout: ParallelLayout, tp_rank: int, cp_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, token position) of every router row of rank (tp_rank, cp_rank). THD per run in
    numpy (a rank's rows are, per sequence, its two CP chunks clipped to its SP slice: one
    ragged arange); BSHD through :func:`r3bridge.packing.rank_positions`."""
    if plan.format != "thd":
        seq, pos = rank_positions(plan, layout, tp_rank, cp_rank)
        return seq.numpy(), pos.numpy()
    tp_rank, cp_rank = checked_ranks(layout, tp_rank, cp_rank)
    n, cp = plan.num_seqs, layout.cp
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    padded = plan.padded_lens.numpy().astype(np.int64)
    if cp > 1:
        chunk = padded // (2 * cp)
        seg_seq = np.repeat(np.arange(n, dtype=np.int64), 2)
        seg_pos = np.stack([chunk * cp_rank, chunk * (2 * cp - 1 - cp_rank)], 1).reshape(-1)
        seg_len = np.repeat(chunk, 2)
    else:
        seg_seq, seg_pos, seg_len = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64), padded
    seg_end = np.cumsum(seg_len)
    lo, hi = sp_bounds(int(seg_end[-1]), layout, tp_rank)
    seg_begin = seg_end - seg_len
    cb, ce = np.clip(seg_begin, lo, hi), np.clip(seg_end, lo, hi)
    seg_pos, seg_len = seg_pos + (cb - seg_begin), ce - cb
    total = hi - lo
    seg_off = np.cumsum(seg_len) - seg_len
    seq = np.repeat(seg_seq, seg_len)
    pos = np.arange(total, dtype=np.int64) + np.repeat(seg_pos - seg_off, seg_len)
    return seq, pos


# ------------------------------------------------------------------------------------ the read
def read_targets(routes: HandedRoutes, rank_rows: RankRows, layer_ids: Sequence[int], *,
                 device: Optional[torch.device] = None, degenerate: str = "refuse",
                 counts: Optional[list] = None, where: str = "this rank",
                 model_layers: Optional[Sequence[int]] = None) -> ShardedTargets:
    """This rank's targets of ``layer_ids`` for the micro-batch ``routes`` (``rank_rows`` already
    :meth:`RankRows.cover`-ed with them). ``counts`` (a list) receives a :class:`ReadCounts`."""
    if degenerate not in DEGENERATE_CHOICES:
        raise RouteShapeError(f"degenerate must be one of {DEGENERATE_CHOICES}, got {degenerate!r}")
    want = [int(x) for x in layer_ids]
    pos_of = {lid: j for j, lid in enumerate(routes.layer_ids)}
    missing = [x for x in want if x not in pos_of]
    if missing:
        hint = "" if model_layers is None else shifted_layer_ids_hint(routes.layer_ids, model_layers)
        raise LayerMappingError(f"{where} needs MoE layers {missing}, but the batch only has "
                                f"layers {list(routes.layer_ids)}{hint}")
    dev = device if device is not None else routes.device
    k, n = routes.topk, routes.num_seqs
    covered = rank_rows.covered.copy()
    degenerate_rows = np.zeros(0, dtype=np.int64)
    if not want:
        if counts is not None:
            counts.append(ReadCounts(np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)))
        return ShardedTargets({}, torch.from_numpy(covered).to(dev), (), k, int(covered.sum()),
                              {} if routes.has_weights else None)
    cols = [pos_of[x] for x in want]
    compact = _gather(routes, rank_rows, covered, cols)                      # [nl, T, K], source dtype
    compact = compact.to(dev, non_blocking=True)
    covered &= ~_unrouted_rows(compact, routes, covered)
    if not routes.trusted and covered.any():
        covered, degenerate_rows = _check(compact, covered, routes, rank_rows, want, cols, degenerate)
    valid_t = torch.from_numpy(covered)
    out = torch.empty(compact.shape, dtype=torch.int64, device=dev)
    out.copy_(compact)
    if not covered.all():
        invalid = torch.from_numpy(np.flatnonzero(~covered)).to(dev)
        out[:, invalid] = torch.arange(k, dtype=torch.int64, device=dev)
    weights = _read_weights(routes, rank_rows, covered, cols, want, dev) if routes.has_weights else None
    if counts is not None:
        seq = rank_rows.seq
        counts.append(ReadCounts(np.bincount(seq[covered], minlength=n)[:n] * len(want),
                                 np.bincount(seq[degenerate_rows], minlength=n)[:n] * len(want)))
    return ShardedTargets({lid: out[j] for j, lid in enumerate(want)}, valid_t.to(dev), tuple(want), k,
                          int(covered.sum()), weights)


def _gather(routes: HandedRoutes, rr: RankRows, covered: np.ndarray, cols: list[int]) -> torch.Tensor:
    """This rank's rows of the layer positions ``cols``, layer-major ``[nl, T, K]``, in a dtype that
    holds the source ids exactly (rows not covered: whatever the source holds there; never read)."""
    t = rr.num_rows
    if routes.arrays is not None:
        return _fill_from_arrays(routes, rr, covered, cols)
    grid = routes.grid
    src_cols = routes._source_cols(cols)
    if grid.shape[0] * grid.shape[1] == 0 or t == 0:
        return torch.zeros((len(cols), t, routes.topk), dtype=_exact_dtype(grid.dtype), device=grid.device)
    seq = rr.seq
    b = routes.seq_b[seq]
    s = np.where(covered, routes.seq_s0[seq] + rr.src, 0)
    b = np.where(covered, b, 0)
    flat = _flat_rows(grid)
    if flat is not None:
        row = torch.from_numpy(b * grid.shape[1] + s).to(grid.device)
        return _gather_layer_major(flat, row, src_cols if src_cols is not None else list(range(grid.shape[2])))
    return _pick(grid, b, s, src_cols).permute(1, 0, 2).contiguous()       # [T, nl, K] -> [nl, T, K]


def _unrouted_rows(compact: torch.Tensor, routes: HandedRoutes, covered: np.ndarray) -> np.ndarray:
    """Rows the transport writes as "no route" in-band, read from the ids gathered: a sentinel
    in every id, or (a zero-row transport at top-1, where expert 0 and "no route" look alike) a
    zero in every layer read."""
    if not covered.any():
        return np.zeros_like(covered)
    if routes.no_route == "sentinel":
        return (compact == routes.sentinel).all(-1).all(0).cpu().numpy()
    if routes.no_route == "zero" and routes.topk == 1:
        return (compact == 0).all(-1).all(0).cpu().numpy()
    return np.zeros_like(covered)


def _pick(grid: torch.Tensor, b: np.ndarray, s: np.ndarray, cols: Optional[list[int]]) -> torch.Tensor:
    """``grid[b, s]`` of the source columns ``cols`` (``[T, nl, K]``), without copying the grid:
    consecutive columns are sliced (a view), others indexed together with the rows (indexing a
    list of columns first would copy every row of the grid)."""
    b_t = torch.from_numpy(np.ascontiguousarray(b)).to(grid.device)
    s_t = torch.from_numpy(np.ascontiguousarray(s)).to(grid.device)
    sel = layer_columns(cols)
    if isinstance(sel, list):
        c = torch.tensor(sel, dtype=torch.int64, device=grid.device)
        return grid[b_t[:, None], s_t[:, None], c[None, :]]
    return (grid if sel is None else grid[:, :, sel])[b_t, s_t]


def _flat_rows(grid: torch.Tensor) -> Optional[torch.Tensor]:
    """``grid [B, S, L, K]`` as ``[B*S, L, K]`` without a copy, where its strides allow."""
    b, s = grid.shape[:2]
    if b == 1:
        return grid[0]
    if grid.stride(0) == s * grid.stride(1):
        return grid.flatten(0, 1)           # a view: the batch and sequence dims are one stride apart
    return None


def _gather_layer_major(src: torch.Tensor, row: torch.Tensor, cols: list[int]) -> torch.Tensor:
    """``src[row][:, cols].permute(1, 0, 2).contiguous()`` (``[nl, T, K]``, src's dtype).

    Speed (P1 in docs/benchmarks.md), same result: the ``K`` ids of one (row, layer) move as one
    machine word (``src`` viewed as ``[rows, L, words]`` of the widest int type dividing ``K *
    itemsize``), and a stage's consecutive layer columns are sliced (a view) before one
    ``index_select`` on rows (advanced indexing with two index tensors is ~20x slower on CPU).
    Plain element gathers where ``src`` cannot be viewed as words."""
    rows, num_layers, topk = src.shape
    nbytes = topk * src.element_size()
    word, word_dtype = next((w, dt) for w, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16),
                                                   (1, torch.uint8)) if nbytes % w == 0)
    words = src
    if word > src.element_size() and src.is_contiguous():
        try:
            words = src.view(rows, num_layers * topk).view(word_dtype).view(rows, num_layers, nbytes // word)
        except RuntimeError:       # storage offset not aligned to the word size: keep elements
            words = src
    first_col = cols[0]
    if cols == list(range(first_col, first_col + len(cols))):
        part = words[:, first_col:first_col + len(cols)].index_select(0, row)    # [T, nl, n]
    else:
        part = words.index_select(0, row).index_select(1, torch.tensor(cols, device=src.device))
    gathered = part.permute(1, 0, 2).contiguous()                         # [nl, T, n]
    if words is not src:
        gathered = gathered.view(torch.uint8).view(src.dtype).view(len(cols), row.numel(), topk)
    return gathered


def _runs(rr: RankRows, covered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends of the runs of consecutive covered source rows of one sequence."""
    t = rr.num_rows
    brk = np.ones(t, dtype=bool)
    brk[1:] = (rr.seq[1:] != rr.seq[:-1]) | (rr.src[1:] != rr.src[:-1] + 1) | (covered[1:] != covered[:-1])
    run_start = np.flatnonzero(brk)
    return run_start, np.append(run_start[1:], t)


def _fill_from_arrays(routes: HandedRoutes, rr: RankRows, covered: np.ndarray, cols: list[int]) -> torch.Tensor:
    """Engine arrays: one strided copy per run of consecutive covered rows (a view of the
    engine's array, its layer columns sliced where consecutive) into a layer-major buffer."""
    t, k = rr.num_rows, routes.topk
    dtypes = {a.dtype for a in routes.arrays} or {np.dtype(np.uint8)}
    dt = max((_exact_dtype(d) for d in dtypes), key=lambda d: torch.iinfo(d).bits - (d == torch.uint8))
    if len(dtypes) > 1:
        dt = torch.int64
    out = allocate((len(cols), t, k), dt, what="rank targets")
    if t == 0:
        return out
    dst = out.numpy().transpose(1, 0, 2)                           # [T, nl, K] view
    sel = layer_columns(routes._source_cols(cols))
    run_start, run_end = _runs(rr, covered)
    for r0, r1 in zip(run_start.tolist(), run_end.tolist()):
        if not covered[r0]:
            continue           # rows without a route: filled with fillers after the check
        a = routes.arrays[int(rr.seq[r0])]
        s0 = int(rr.src[r0])
        src = a[s0:s0 + r1 - r0]
        np.copyto(dst[r0:r1], src if sel is None else src[:, sel], casting="unsafe")
    return out


def _check(compact: torch.Tensor, covered: np.ndarray, routes: HandedRoutes, rr: RankRows, want: list[int],
           cols: list[int], degenerate: str) -> tuple[np.ndarray, np.ndarray]:
    """Range and distinct-within-row of every covered (row, layer) read, one pass where the ids
    are (the device: a sort of the K ids; the host: a sorting network). Raises on an id out of
    range; a row whose ids repeat is degenerate: refused (raises) or routed natively (returned)."""
    if compact.device.type != "cpu" and not _any_fault(compact, covered, routes.num_experts):
        return covered, np.zeros(0, dtype=np.int64)       # the usual case: one scalar back from the device
    rng, dup = _faults(compact, routes.num_experts)                   # bool [T, nl] on the host
    rng &= covered[:, None]
    dup &= covered[:, None]
    if rng.any():
        r, c = (int(x) for x in np.argwhere(rng)[0])
        i, row = int(rr.seq[r]), int(rr.src[r])
        raise _named(route_value_error("range", seq=i, row=row, tok=routes.starts[i] + row, layer=want[c],
                                       values=compact[c, r].tolist(), num_experts=routes.num_experts,
                                       total=int(rng.sum())), routes, i)
    bad_rows = np.flatnonzero(dup.any(1))
    if bad_rows.size and degenerate == "refuse":
        r = int(bad_rows[0])
        c = int(np.flatnonzero(dup[r])[0])
        i, row = int(rr.seq[r]), int(rr.src[r])
        raise _named(route_value_error("duplicate", seq=i, row=row, tok=routes.starts[i] + row, layer=want[c],
                                       values=compact[c, r].tolist(), num_experts=routes.num_experts,
                                       total=int(dup.sum())), routes, i)
    if bad_rows.size:
        covered = covered.copy()
        covered[bad_rows] = False
    return covered, bad_rows


def _named(err: Exception, routes: HandedRoutes, i: int) -> Exception:
    if not routes.names or i >= len(routes.names):
        return err
    if routes.framework is not None:            # an adapter's sample: its name first
        return type(err)(f"{routes.name(i)}: " + str(err).replace(f"sequence {i}", "", 1).lstrip(", :"))
    return type(err)(str(err).replace(f"sequence {i}", routes.names[i], 1))


_SEQUENCE = re.compile(r"\bsequence (\d+)")


@contextlib.contextmanager
def naming_samples(names: Sequence[str]) -> Iterator[None]:
    """Inside the block, a :class:`~r3bridge.ReplayError` naming "sequence i" (the core's name:
    the position in the batch it was given) is raised again, same class, chained, leading with
    ``names[i]`` (how the framework knows the sample) instead."""
    try:
        yield
    except ReplayError as e:
        msg = str(e)
        hit = _SEQUENCE.search(msg)
        if hit is None or int(hit.group(1)) >= len(names):
            raise
        raise type(e)(f"{names[int(hit.group(1))]}: " + _SEQUENCE.sub("", msg, count=1).lstrip(", :")) from e


def _faults_torch(compact: torch.Tensor, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_faults` where the ids are (the router's device): min / max and a sort of the K ids."""
    lo, hi = compact.amin(-1), compact.amax(-1)
    rng = (lo < 0) | (hi >= num_experts)
    if compact.shape[-1] > 1:
        s = compact.sort(-1).values
        dup = (s[..., 1:] == s[..., :-1]).any(-1)
    else:
        dup = torch.zeros_like(rng)
    both = torch.stack([rng, dup]).transpose(1, 2).cpu().numpy()
    return both[0], both[1]


def _any_fault(compact: torch.Tensor, covered: np.ndarray, num_experts: int) -> bool:
    """Whether any covered (row, layer) of a device tensor ``[nl, T, K]`` is out of range or repeats
    an id: min / max and a sort of the K ids on the device, one host sync."""
    bad = (compact.amin(-1) < 0) | (compact.amax(-1) >= num_experts)
    if compact.shape[-1] > 1:
        s = compact.sort(-1).values
        bad |= (s[..., 1:] == s[..., :-1]).any(-1)
    return bool((bad & torch.from_numpy(covered).to(compact.device)[None]).any())


def _faults(compact: torch.Tensor, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(out of range, repeats an id) per (row, layer) of ``compact`` ``[nl, T, K]``, as host
    ``[T, nl]`` bools. On a device: min / max and a sort of the K ids (one kernel each, the
    rank's compact ids only). On the host: the sorting network of :mod:`r3bridge.route_scan`,
    in cache-sized blocks on a thread pool."""
    nl, t, k = compact.shape
    if compact.device.type != "cpu":
        return _faults_torch(compact, num_experts)
    arr = compact.numpy().transpose(1, 0, 2)              # [T, nl, K] view
    rng, dup = np.zeros((t, nl), dtype=bool), np.zeros((t, nl), dtype=bool)
    step = block_rows(nl * k)

    def task(a: int):
        def run():
            r, d = row_faults(arr[a:a + step], num_experts)
            rng[a:a + step], dup[a:a + step] = r, d
        return run
    run_blocks([task(a) for a in range(0, t, step)])
    return rng, dup


def _read_weights(routes: HandedRoutes, rr: RankRows, covered: np.ndarray, cols: list[int], want: list[int],
                  dev: torch.device) -> dict[int, torch.Tensor]:
    """This rank's rows of the routing weights by the same row map (float32 ``[T, K]`` per layer,
    rounded through the schema's float16, 0 on rows without a route), checked as the schema
    checks weights where they were not checked before."""
    t, k = rr.num_rows, routes.topk
    if routes.weights_arrays is not None:
        out = np.zeros((len(cols), t, k), dtype=np.float32)
        dst = out.transpose(1, 0, 2)
        sel = layer_columns(routes._source_cols(cols))
        run_start, run_end = _runs(rr, covered)
        for r0, r1 in zip(run_start.tolist(), run_end.tolist()):
            if covered[r0]:
                w = routes.weights_arrays[int(rr.seq[r0])]
                s0 = int(rr.src[r0])
                src = w[s0:s0 + r1 - r0]
                dst[r0:r1] = src if sel is None else src[:, sel]
        w_t = torch.from_numpy(out)
    else:
        g = routes.weights_grid
        src_cols = routes._source_cols(cols)
        b = np.where(covered, routes.seq_b[rr.seq], 0)
        s = np.where(covered, routes.seq_s0[rr.seq] + rr.src, 0)
        if g.shape[0] * g.shape[1] == 0 or t == 0:
            w_t = torch.zeros((len(cols), t, k), dtype=torch.float32)
        else:
            w_t = _pick(g, b, s, src_cols).permute(1, 0, 2)
    w_t = w_t.to(dev)
    if not routes.trusted:
        w32 = w_t.float()
        narrow = w32.to(torch.float16)
        bad = (~torch.isfinite(w32) | (w32 < 0) | ~torch.isfinite(narrow)).any(-1).cpu().numpy().T & covered[:, None]
        if bad.any():
            r, c = (int(x) for x in np.argwhere(bad)[0])
            i, row = int(rr.seq[r]), int(rr.src[r])
            raise RouteWeightsError(f"sequence {i}, row {row} (token {routes.starts[i] + row}), layer {want[c]}: "
                                    f"weights {w32[c, r].tolist()} must be finite, non-negative and within float16 "
                                    f"range")
        w_t = narrow
    out_w = w_t.to(torch.float32).clone()
    if not covered.all():
        out_w[:, torch.from_numpy(np.flatnonzero(~covered)).to(dev)] = 0
    return {lid: out_w[j] for j, lid in enumerate(want)}


# ------------------------------------------------------------------------------------ engine entry
def rank_targets(items: Sequence[Any], layout: ParallelLayout, seq_lens: Sequence[int], *, num_experts: int,
                 moe_layer_ids: Sequence[int] | None = None, start_rows: Sequence[int] | None = None,
                 tp_rank: int = 0, cp_rank: int = 0, pp_rank: int = 0, vp_stage: int = 0, format: str = "thd",
                 cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None, seq_length: int | None = None,
                 device: torch.device | str | None = None, layer_ids: Sequence[int] | None = None,
                 weights: Sequence[Any] | None = None, degenerate: str = "refuse") -> ShardedTargets:
    """Targets of rank (tp_rank, cp_rank, pp_rank, vp_stage) straight from the micro-batch's vLLM
    routes ``items`` (:meth:`HandedRoutes.from_engine`): equals ``shard(ReplayBatch.from_vllm(items,
    ...), ...)`` but reads only this rank's stage layers and CP / SP rows (~1/30 of the ids at
    TP4 x CP2 x PP4), and checks what it reads (a bad id elsewhere raises on the rank that reads
    it, with the same message)."""
    tp_rank, cp_rank, pp_rank, vp_stage, layer_ids, dev = checked_rank_args(
        tp_rank, cp_rank, pp_rank, vp_stage, layer_ids, device, what="rank_targets")
    routes = HandedRoutes.from_engine(items, num_experts=num_experts, moe_layer_ids=moe_layer_ids,
                                      start_rows=start_rows, weights=weights)
    lens = as_index_list(seq_lens, what="seq_lens", error=CoverageError)
    rows = RankRows.build(layout, lens, tp_rank=tp_rank, cp_rank=cp_rank, format=format,
                          cu_seqlens_padded=cu_seqlens_padded, seq_length=seq_length).cover(routes)
    want = list(layout.moe_layers(pp_rank, vp_stage) if layer_ids is None else layer_ids)
    return read_targets(routes, rows, want, device=dev or torch.device("cpu"), degenerate=degenerate,
                        where=f"rank (pp={pp_rank}, vp={vp_stage})", model_layers=layout.moe_layer_ids)


# ------------------------------------------------------------------------------------ engine payload report
@dataclass
class EngineRowReport:
    """What :func:`engine_row_report` found in engine payloads: per sequence, rows handed and rows
    whose MoE-layer ids repeat (degenerate), and the first degenerate (sequence, row, layer)."""

    rows: list[int]
    degenerate_rows: list[int]
    first: Optional[tuple[int, int, int]] = None      # (sequence, row, layer id)

    @property
    def total_degenerate(self) -> int:
        return sum(self.degenerate_rows)


def engine_row_report(items: Sequence[Any], *, num_experts: int, moe_layer_ids: Optional[Sequence[int]] = None,
                      layer_axis: Optional[str] = ALL_HIDDEN, refuse: bool = False) -> EngineRowReport:
    """Classify every row of engine payloads (vLLM's ``routed_experts`` in any transport; e.g.
    recorded payloads under ``tests/fixtures/vllm/``) as the reader does: a row whose MoE-layer
    ids repeat is degenerate (vLLM #54730: all zero). ``refuse``: raise the reader's
    :class:`r3bridge.errors.DegenerateRouteError` naming the first one instead of reporting.
    Ids out of range raise ``RouteValueError`` either way."""
    routes = HandedRoutes.from_engine(items, num_experts=num_experts, moe_layer_ids=moe_layer_ids,
                                      layer_axis=layer_axis)
    report = EngineRowReport(list(routes.rows), [0] * routes.num_seqs)
    for i, a in enumerate(routes.arrays):
        if not a.shape[0]:
            continue
        sel = layer_columns(routes.columns)
        ids = a if sel is None else a[:, sel]
        rng, dup = row_faults(ids, routes.num_experts)
        if rng.any():
            r, c = (int(x) for x in np.argwhere(rng)[0])
            raise route_value_error("range", seq=i, row=r, tok=routes.starts[i] + r, layer=routes.layer_ids[c],
                                    values=ids[r, c].tolist(), num_experts=routes.num_experts, total=int(rng.sum()))
        bad = dup.any(1)
        report.degenerate_rows[i] = int(bad.sum())
        if bad.any() and report.first is None:
            r = int(np.flatnonzero(bad)[0])
            report.first = (i, r, routes.layer_ids[int(np.flatnonzero(dup[r])[0])])
    if refuse and report.first is not None:
        i, r, lid = report.first
        c = routes.layer_ids.index(lid)
        sel = routes.columns[c] if routes.columns is not None else c
        raise route_value_error("duplicate", seq=i, row=r, tok=routes.starts[i] + r, layer=lid,
                                values=routes.arrays[i][r, sel].tolist(), num_experts=routes.num_experts,
                                total=report.total_degenerate)
    return report

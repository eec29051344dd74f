"""What a framework hands over for one micro-batch, viewed: :class:`HandedRoutes`, the start of
the one reader (docs/architecture.md, "One reader").

Every route that reaches a router comes through one: the public ``shard`` (a validated
``ReplayBatch``), ``rank_targets`` (vLLM's engine arrays), the driver's install of every adapter's
micro-batch (a nested or packed field, a padded field with or without its own mask, a sequence-last
field, the template's padded dict) for R3 and R2 alike. A ``HandedRoutes`` holds the framework's own buffers,
*viewed* (no copy, no id read): where row ``j`` of sequence ``i`` lives, which source column holds
each MoE layer, how the transport writes "no route" (an explicit mask, zero rows past what the
engine captured, a sentinel, or nothing: every handed row is a route). Metadata is checked here,
once. The rank's rows are then mapped by :class:`r3bridge.parallel.rank_rows.RankRows` and read
by :func:`r3bridge.parallel.read.read_targets`; :meth:`HandedRoutes.to_batch` is the whole-batch
form, by the same rules.

**Degenerate routes** (vLLM #54730: a kernel skipped the capture and every token "took expert
0"): inside a sample's captured rows, a row whose ids repeat is a *degenerate* route, not a
missing one. ``degenerate="refuse"`` (the default, ``ReplayConfig.degenerate_routes``) raises a
:class:`r3bridge.errors.DegenerateRouteError` naming the sample, row, token and layer before
anything is installed; ``"native"`` routes those rows natively and counts them. Rows past what
the engine captured (tail padding, multi-turn tails, padding samples) are "no route", decided by
the sample's captured range, never by a row's content alone: in a zero-row transport the
captured range ends at the sample's last non-zero row (:meth:`HandedRoutes.captured_rows`).
With top-1 an expert-0 row cannot be told from a zero row: zero rows stay "no route" there.
"""
from __future__ import annotations

import contextlib
import functools
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from r3bridge._validate import as_index, as_index_list, as_mask, check_readable, native_order
from r3bridge.batch.meta import checked_meta
from r3bridge.batch.route_weights import as_weights_tensor
from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.engines.decoders import decode_vllm_routes, decode_vllm_weights
from r3bridge.engines.engine_pack import check_shapes, host_array
from r3bridge.engines.layer_axis import ALL_HIDDEN, MOE_ONLY, axis_columns, check_layer_axis
from r3bridge.engines.route_checks import check_read, led_by_name
from r3bridge.errors import (
    ConfigError,
    CoverageError,
    LayerMappingError,
    ReplayError,
    RouteShapeError,
    RouteWeightsError,
)
from r3bridge.parallel.gather import TORCH_INT, exact_dtype, gather_rows, pick, read_weights, unrouted_rows

__all__ = ["HandedRoutes", "NO_ROUTE_KINDS", "zero_row_rule", "padded_spans", "naming_samples", "shown_names"]

# How a transport writes "no route": "none" every handed row is a route (vLLM arrays); "mask" an
# explicit per-row mask; "zero" rows past the sample's last non-zero row (nested and padded fields);
# "sentinel" rows whose ids all equal a value no expert id takes (sequence-last fields).
NO_ROUTE_KINDS = ("none", "mask", "zero", "sentinel")


def shown_names(names: Optional[Sequence[str]], framework: Optional[str]) -> list[str]:
    """How errors name each sequence: ``names`` (the adapter's), led by ``"<framework> sample"``
    when a framework is given; ``[]`` without names (errors keep the core's "sequence i")."""
    if not names:
        return []
    return [str(n) if framework is None else f"{framework} sample {n}" for n in names]


def _named_by_caller(build: Any) -> Any:
    """A constructor whose every error naming "sequence i" names the caller's sample instead
    (``names=``, ``framework=``)."""
    @functools.wraps(build)
    def named(cls: Any, *args: Any, names: Optional[Sequence[str]] = None, framework: Optional[str] = None,
              **kwargs: Any) -> Any:
        with naming_samples(shown_names(names, framework)):
            return build(cls, *args, names=names, framework=framework, **kwargs)
    return named


def zero_row_rule(route_kind: str, topk: int) -> str:
    """A zero-row transport's ``no_route``: recorded routes hold a real route on every token, so at
    top-1 an expert-0 row is a route (``"none"``); otherwise ``"zero"``."""
    return "none" if route_kind == "recorded" and int(topk) == 1 else "zero"


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
    route_kind: str = "rollout"        # "rollout" (an engine's routes) or "recorded" (R2)
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
    engine: Optional[str] = None                   # rollout routes: the engine that produced them, if said
    _captured: Optional[np.ndarray] = field(default=None, repr=False)
    _without: Optional[np.ndarray] = field(default=None, repr=False)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_batch(cls, batch: Any) -> "HandedRoutes":
        """A validated :class:`r3bridge.ReplayBatch` (its ids are not checked again)."""
        check_readable(batch.routes, what="shard: batch routes", error=RouteShapeError)
        valid = batch.valid
        all_valid = bool(valid.all()) if valid.numel() else True
        return cls(list(batch.rows_per_seq), list(batch.start_rows), tuple(batch.layer_ids), None,
                   batch.num_experts, batch.topk, "none" if all_valid else "mask", batch.route_kind, True, "batch",
                   grid=batch.routes[None], seq_b=np.zeros(batch.num_seqs, dtype=np.int64),
                   seq_s0=batch.offsets[:-1].numpy().astype(np.int64),
                   mask=None if all_valid else valid[None],
                   weights_grid=None if batch.weights is None else batch.weights[None], engine=batch.engine)

    @classmethod
    @_named_by_caller
    def from_engine(cls, items: Sequence[Any], *, num_experts: int, moe_layer_ids: Optional[Sequence[int]] = None,
                    start_rows: Optional[Sequence[int]] = None, layer_axis: Optional[str] = ALL_HIDDEN,
                    weights: Optional[Sequence[Any]] = None, route_kind: str = "rollout",
                    names: Optional[Sequence[str]] = None, engine: Optional[str] = None,
                    framework: Optional[str] = None) -> "HandedRoutes":
        """vLLM-style per-sequence engine outputs (any transport
        :func:`r3bridge.engines.decoders.decode_vllm_routes` reads: ``[rows, num_hidden_layers, K]``), every
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
        return cls(rows, starts, layer_ids, cols, num_experts, k, "none", route_kind, False, "engine", arrays=arrays,
                   names=None if names is None else list(names), framework=framework, weights_arrays=w, engine=engine)

    @classmethod
    @_named_by_caller
    def from_packed(cls, values: Any, rows_per_seq: Sequence[int], *, num_experts: int, layer_ids: Sequence[int],
                    columns: Optional[Sequence[int]] = None, no_route: str = "none", valid: Any = None,
                    sentinel: Optional[int] = None, route_kind: str = "rollout", names: Optional[Sequence[str]] = None,
                    weights: Any = None, engine: Optional[str] = None,
                    framework: Optional[str] = None) -> "HandedRoutes":
        """One packed buffer ``[sum rows, L_src, K]`` (a nested field's values, a packed
        tensor), sequences consecutive; ``valid`` ``[sum rows]`` with ``no_route="mask"``."""
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
                            num_experts, layer_ids, columns, no_route, m, sentinel, route_kind, engine, names, w, framework)

    @classmethod
    @_named_by_caller
    def from_padded(cls, routes: Any, attention_mask: Any, *, num_experts: int, layer_ids: Sequence[int],
                    columns: Optional[Sequence[int]] = None, no_route: str = "none", valid: Any = None,
                    sentinel: Optional[int] = None, route_kind: str = "rollout",
                    names: Optional[Sequence[str]] = None, engine: Optional[str] = None,
                    framework: Optional[str] = None) -> "HandedRoutes":
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
                            layer_ids, columns, no_route, m, sentinel, route_kind, engine, names, None, framework)

    @classmethod
    @_named_by_caller
    def from_sequence_last(cls, routes: Any, rows: Sequence[int], lens: Sequence[int], *, num_experts: int,
                           layer_ids: Sequence[int], sentinel: int, route_kind: str = "rollout",
                           names: Optional[Sequence[str]] = None, engine: Optional[str] = None,
                           framework: Optional[str] = None) -> "HandedRoutes":
        """Rows ``rows`` of a ``[B, L, K, S]`` field (sequence last), tokens
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
                            num_experts, layer_ids, None, "sentinel", None, sentinel, route_kind, engine, names, None, framework)

    @classmethod
    def _checked(cls, form, grid, seq_b, seq_s0, rows, starts, num_experts, layer_ids, columns, no_route, mask,
                 sentinel, route_kind, engine, names, weights_grid, framework=None) -> "HandedRoutes":
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
        if route_kind not in ("rollout", "recorded"):
            raise RouteShapeError(f"route_kind must be 'rollout' or 'recorded', got {route_kind!r} (an engine's name "
                                  f"goes in engine=)")
        return cls(rows, starts, layer_ids, cols, num_experts, k, no_route, route_kind, False, form, grid=grid,
                   seq_b=np.asarray(seq_b, dtype=np.int64), seq_s0=np.asarray(seq_s0, dtype=np.int64), mask=mask,
                   sentinel=sentinel, names=None if names is None else list(names), framework=framework,
                   weights_grid=weights_grid, engine=engine)

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
        out = HandedRoutes(**{f: getattr(self, f) for f in self.__dataclass_fields__ if f not in ("_captured", "_without")})
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

    def without_routes(self) -> np.ndarray:
        """bool per sequence: handed without any route, so routed natively and counted apart from
        the coverage guards (design.md: samples without routes): 0 rows, or an explicit mask that
        says "no route" on every row. Zero rows past what the engine captured are not explicit (a
        broken capture writes them too, vLLM #54730): such a sequence stays under the guards."""
        if self._without is not None:
            return self._without
        rows = np.asarray(self.rows, dtype=np.int64)
        out = rows == 0
        if self.no_route == "mask" and rows.size and not out.all():
            m = self.mask.reshape(-1).to(torch.int64)
            width = self.mask.shape[1]
            start = torch.from_numpy(self.seq_b * width + self.seq_s0).to(m.device)
            csum = torch.cat([m.new_zeros(1), m.cumsum(0)])
            routed = (csum[start + torch.from_numpy(rows).to(m.device)] - csum[start]).cpu().numpy()
            out |= routed == 0
        self._without = out
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
        drop = self.route_kind != "recorded" if drop_final_invalid is None else drop_final_invalid
        with naming_samples(shown_names(self.names, self.framework)):
            batch = self._whole_batch("native" if invalid_rows == "error" else degenerate, drop)
            if invalid_rows == "error" and not bool(batch.valid.all()):
                bad = int((~batch.valid).nonzero()[0])
                seq = int((batch.offsets[1:] <= bad).sum())
                token = batch.start_rows[seq] + bad - int(batch.offsets[seq])
                raise CoverageError(f"sequence {seq}: token {token} has no route and r3bridge.invalid_rows='error'")
        return batch

    def _whole_batch(self, degenerate: str, drop_final_invalid: bool) -> Any:
        if self.arrays is not None and self.no_route == "none" and self.weights_arrays is None:
            return ReplayBatch._from_host(self.arrays, self.columns, num_experts=self.num_experts,
                                          layer_ids=self.layer_ids, start_rows=self.starts, route_kind=self.route_kind,
                                          engine=self.engine)
        n, rows = self.num_seqs, np.asarray(self.rows, dtype=np.int64)
        offs = np.zeros(n + 1, dtype=np.int64)
        offs[1:] = np.cumsum(rows)
        seq = np.repeat(np.arange(n, dtype=np.int64), rows)
        j = np.arange(int(offs[-1]), dtype=np.int64) - np.repeat(offs[:-1], rows)
        covered = j < self.captured_rows()[seq]
        if self.no_route == "mask" and covered.any():
            b = torch.from_numpy(self.seq_b[seq]).to(self.mask.device)
            covered &= self.mask[b, torch.from_numpy(self.seq_s0[seq] + j).to(self.mask.device)].cpu().numpy()
        cols = list(range(len(self.layer_ids)))
        compact = gather_rows(self, seq, j, covered, cols)                     # [nl, N, K]
        covered &= ~unrouted_rows(compact, self, covered)
        if not self.trusted and covered.any():
            covered, _ = check_read(compact, covered, seq=seq, row=j, starts=self.starts, layer_ids=self.layer_ids,
                                    num_experts=self.num_experts, degenerate=degenerate, names=self.names,
                                    framework=self.framework)
        routes = compact.permute(1, 0, 2).to(route_dtype(self.num_experts))     # exact: checked in range
        weights = None
        if self.has_weights:
            weights = torch.stack(list(read_weights(self, seq, j, covered, cols, list(self.layer_ids),
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
                            self.topk, self.route_kind, engine=self.engine)
        return batch if weights is None else ReplayBatch(
            batch.routes, batch.valid, batch.rows_per_seq, batch.start_rows, batch.layer_ids, batch.num_experts,
            batch.topk, batch.route_kind, weights=weights, engine=self.engine)

    # ------------------------------------------------------------------ gathers
    def _gather_rows(self, seq: np.ndarray, j: np.ndarray, cols: Optional[list[int]]) -> torch.Tensor:
        """``[T, nl, K]`` rows ``j`` of sequences ``seq`` (row-major; small reads)."""
        cols = self.source_columns(cols)
        if self.grid is not None:
            return pick(self.grid, self.seq_b[seq], self.seq_s0[seq] + j, cols)
        out = [self.arrays[int(i)][int(r)] for i, r in zip(seq, j)]
        a = np.stack(out) if out else np.zeros((0,) + self.arrays[0].shape[1:], dtype=self.arrays[0].dtype)
        return torch.from_numpy(native_order(a if cols is None else a[:, cols]))

    def source_columns(self, cols: Optional[list[int]]) -> Optional[list[int]]:
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
        if t.dtype not in TORCH_INT:
            t = t.to(exact_dtype(t.dtype))
        return t
    a = np.asarray(x)
    dt = exact_dtype(a.dtype)
    a = native_order(a)
    held = torch.empty((), dtype=dt).numpy().dtype
    if a.dtype != held:
        a = a.astype(held)                  # exact widening (uint16 -> int32, ...)
    with warnings.catch_warnings():         # a read-only engine buffer is shared, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _mask_tensor(x: Any, *, what: str) -> torch.Tensor:
    return as_mask(x, what=what, error=CoverageError)


def _weights_tensor(w: Any, like: torch.Tensor) -> torch.Tensor:
    t = as_weights_tensor(w, what="weights")
    if tuple(t.shape) != tuple(like.shape):
        raise RouteWeightsError(f"weights have shape {tuple(t.shape)}, routes {tuple(like.shape)}: one weight per "
                                f"(row, layer, k)")
    return t


_SEQUENCE = re.compile(r"\bsequence (\d+)")


@contextlib.contextmanager
def naming_samples(names: Sequence[str]) -> Iterator[None]:
    """Inside the block, a :class:`~r3bridge.ReplayError` naming "sequence i" (the core's name:
    the position in the batch it was given) is raised again, same class, chained, leading with
    ``names[i]`` (how the framework knows the sample) instead."""
    try:
        yield
    except ReplayError as e:
        hit = _SEQUENCE.search(str(e))
        if hit is None or int(hit.group(1)) >= len(names):
            raise
        i = int(hit.group(1))
        raise led_by_name(e, i, names[i]) from e

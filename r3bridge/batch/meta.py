"""Metadata checks of a route batch, before any expert id is read: row counts, layer ids, top-k,
number of experts, start rows, policy versions, and coverage against the token counts the trainer
sees. Shared by ``ReplayBatch``'s constructors and the rank-direct ingest
(docs/architecture.md, "One reader"), which has no batch to call methods on.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from r3bridge._validate import as_index, as_index_list
from r3bridge.errors import CoverageError, LayerMappingError, RouteShapeError

__all__ = ["checked_meta", "check_coverage", "check_layer_ids"]


def check_coverage(start_rows: Sequence[int], rows_per_seq: Sequence[int], seq_lens: Sequence[int]) -> None:
    """:meth:`ReplayBatch.check_seq_lens` on the metadata alone (the rank-direct ingest has no batch).

    A sequence with rows ends at its last token or the one before (``start + rows`` is ``seq_len``
    or ``seq_len - 1``); a sequence with 0 rows (the engine returned no routes for it: an aborted
    or interrupted sample, a multi-turn tail) is allowed whatever its start row: it has no route."""
    n = len(rows_per_seq)
    if len(seq_lens) != n:
        raise CoverageError(f"batch has {n} sequences but {len(seq_lens)} seq_lens were given")
    if not n:
        return
    # host arrays: a few entries per micro-batch (small torch ops cost more than the check)
    lens = np.asarray(as_index_list(seq_lens, what="seq_lens", error=CoverageError), dtype=np.int64)
    rows = np.asarray(rows_per_seq, dtype=np.int64)
    end = np.asarray(start_rows, dtype=np.int64) + rows
    bad = np.flatnonzero((rows > 0) & (end != lens) & (end != lens - 1))
    if bad.size:
        i = int(bad[0])
        raise CoverageError(
            f"sequence {i}: start row {start_rows[i]} + {rows_per_seq[i]} rows ends at "
            f"token {int(end[i])}, but the trainer sees {int(lens[i])} tokens (must end at "
            f"{int(lens[i]) - 1} or {int(lens[i])}; a sample the engine returned no routes for is handed "
            f"as 0 rows)")


def checked_meta(shape: tuple[int, ...], rows_per_seq, num_experts, layer_ids, start_rows, policy_versions):
    """The metadata checks of ``from_packed`` for routes of ``shape`` ``[rows, L, K]`` (before any
    value is read): (rows_per_seq, layer_ids, topk, num_experts, start_rows, policy_versions)."""
    rows_per_seq = as_index_list(rows_per_seq, what="rows_per_seq", error=CoverageError)
    n = len(rows_per_seq)
    if sum(rows_per_seq) != shape[0]:
        raise CoverageError(f"rows_per_seq sums to {sum(rows_per_seq)} but routes have {shape[0]} rows")
    if any(r < 0 for r in rows_per_seq):
        raise CoverageError(f"negative row count in rows_per_seq {rows_per_seq}")
    layer_ids = tuple(as_index_list(layer_ids, what="layer_ids", error=LayerMappingError))
    check_layer_ids(layer_ids, shape[1])
    topk = int(shape[2])
    num_experts = as_index(num_experts, what="num_experts", error=RouteShapeError)
    if num_experts <= 0:
        raise RouteShapeError(f"num_experts must be positive, got {num_experts}")
    if topk < 1 or topk > num_experts:
        raise RouteShapeError(f"topk {topk} must be in [1, num_experts={num_experts}]")
    starts = [0] * n if start_rows is None else as_index_list(start_rows, what="start_rows", error=CoverageError)
    if len(starts) != n:
        raise CoverageError(f"start_rows has {len(starts)} entries for {n} sequences")
    if any(s < 0 for s in starts):
        bad = next(i for i, s in enumerate(starts) if s < 0)
        raise CoverageError(f"sequence {bad}: negative start row {starts[bad]}")
    if policy_versions is not None:
        policy_versions = as_index_list(policy_versions, what="policy_versions", error=CoverageError)
        if len(policy_versions) != n:
            raise CoverageError(f"policy_versions has {len(policy_versions)} entries for {n} sequences")
    return rows_per_seq, layer_ids, topk, num_experts, starts, policy_versions


def check_layer_ids(layer_ids: tuple[int, ...], num_layer_axis: int) -> None:
    """``layer_ids`` name each of the routes' ``num_layer_axis`` layers once, none negative."""
    if len(layer_ids) != num_layer_axis:
        raise LayerMappingError(
            f"layer_ids has {len(layer_ids)} entries but routes have {num_layer_axis} layers")
    if any(x < 0 for x in layer_ids):
        raise LayerMappingError(f"negative layer id in {list(layer_ids)}")
    if len(set(layer_ids)) != len(layer_ids):
        dup = sorted({x for x in layer_ids if layer_ids.count(x) > 1})
        raise LayerMappingError(f"duplicate layer ids {dup} in {list(layer_ids)}")

"""Engine payloads classified row by row as the one reader classifies them, without a trainer (tests only):
how many rows each sequence hands over and how many are degenerate (ids repeat inside a captured
row: vLLM #54730), for checking recorded payloads (``r3bridge inspect``-style, docs/metrics.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from r3bridge.engines.engine_pack import layer_columns
from r3bridge.engines.layer_axis import ALL_HIDDEN
from r3bridge.engines.route_checks import route_value_error
from r3bridge.engines.route_scan import row_faults
from r3bridge.parallel.handed import HandedRoutes

__all__ = ["EngineRowReport", "engine_row_report"]


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

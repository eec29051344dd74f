"""What ``r3bridge inspect`` / ``diff`` report of merged passes: per layer coverage, agreement and
expert load of one pass (:func:`pass_summary`), and two views of two passes compared sample by
sample (:func:`compare`)."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from r3bridge.metrics import expert_load, route_agreement, topk_sets_equal
from r3bridge.trace.format import TraceError
from r3bridge.trace.reading import MergedPass, TracePass

__all__ = ["pass_summary", "compare", "handed_check", "finite"]


def _nan_div(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _per_sample(eq: torch.Tensor, rows_ok: torch.Tensor, offsets: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per sequence: (agreeing (row, layer) pairs, compared pairs) over rows where ``rows_ok``."""
    n = offsets.numel() - 1
    seq = torch.repeat_interleave(torch.arange(n), offsets[1:] - offsets[:-1])
    agree = torch.zeros(n, dtype=torch.int64).index_add_(0, seq, (eq & rows_ok[:, None]).sum(1))
    comp = torch.zeros(n, dtype=torch.int64).index_add_(0, seq, rows_ok.to(torch.int64) * eq.shape[1])
    return agree.tolist(), comp.tolist()


def _lowest(keys: Sequence[tuple[int, int]], agree: list[int], comp: list[int], n: int,
            uids: Optional[Sequence[Optional[str]]] = None) -> list[dict[str, Any]]:
    names = dict(zip(keys, uids)) if uids else {}
    rows = [(a / c, dp, s, c) for (dp, s), a, c in zip(keys, agree, comp) if c]
    rows.sort()
    return [{"sample": s, "dp_rank": dp, "uid": names.get((dp, s)), "agreement": frac, "pairs": c}
            for frac, dp, s, c in rows[:n]]


def pass_summary(tp: TracePass, merged: MergedPass, *, lowest: int = 5) -> dict[str, Any]:
    """Per layer of one pass: coverage (replayed / real-token rows), agreement (native top-k set
    equals the replayed one, over replayed rows: the driver's ``agreement/layer_<id>``), the
    expert load of the dispatched routes; the samples with the lowest agreement; and the
    metrics the driver logged for the pass (``logged``)."""
    e0 = tp.first
    nat, rep = merged.native, merged.replayed
    rows = int(nat.valid.sum())
    disp = merged.dispatched
    load = expert_load(disp)
    K, E = nat.topk, nat.num_experts
    out: dict[str, Any] = {"step": tp.step, "pass": tp.label, "action": e0["action"], "route_kind": e0["route_kind"],
                           "ranks": [int(rp.entry["rank"]) for rp in tp.ranks], "samples": nat.num_seqs,
                           "tokens": rows, "logged": e0.get("metrics", {})}
    out["handed"] = None if merged.handed is None else handed_check(disp, merged.handed)
    per_layer = []
    if rep is not None:
        eq = topk_sets_equal(nat.routes, rep.routes)                   # [rows, L]
        ok = rep.valid
        compared = int(ok.sum())
        agree_l = (eq & ok[:, None]).sum(0).tolist()
        out["coverage"] = _nan_div(compared, rows)
        out["agreement"] = _nan_div(sum(agree_l), compared * nat.num_layers)
        a, c = _per_sample(eq, ok, nat.offsets)
        out["lowest_samples"] = _lowest(merged.keys, a, c, lowest, merged.uids)
    else:
        compared, agree_l = 0, [0] * nat.num_layers
        out["coverage"] = out["agreement"] = float("nan")
        out["lowest_samples"] = []
    uniform = rows * K / E if E else 0.0
    for j, lid in enumerate(nat.layer_ids):
        counts = load[j]
        per_layer.append({"layer": lid, "compared": compared, "agree": int(agree_l[j]),
                          "agreement": _nan_div(agree_l[j], compared) if rep is not None else float("nan"),
                          "coverage": out["coverage"],
                          "load_max": int(counts.max()) if counts.numel() else 0,
                          "imbalance": _nan_div(float(counts.max()), uniform) if counts.numel() else float("nan"),
                          "unused_experts": int((counts == 0).sum()), "load": counts.tolist()})
    out["per_layer"] = per_layer
    return out


def handed_check(dispatched: Any, handed: Any) -> dict[str, Any]:
    """What the routers dispatched against the routes the framework handed over, on every (token,
    layer) pair that had a handed route: ``differing`` should be 0 (replay exact)."""
    rep = route_agreement(handed, dispatched)
    pairs = rep.rows_compared * len(rep.layer_ids)
    differing = pairs - sum(rep.agree)
    return {"pairs": pairs, "differing": differing, "tokens": rep.rows_compared,
            "layers_not_compared": sorted(set(rep.layers_only_reference) | set(rep.layers_only_other)),
            "per_layer": {lid: rep.rows_compared - ag for lid, ag in zip(rep.layer_ids, rep.agree)}}


def _pairs(a: MergedPass, b: MergedPass) -> tuple[list[int], list[int], int, int, str]:
    """Positions of the samples both sides hold, in A and in B, the counts only in A / only in B,
    and what paired them: the uids when every sample of both sides has one and none repeats
    (stable across passes and runs), else ``(dp rank, sample id)`` (meaningful where the framework
    keeps its numbering)."""
    ua, ub = a.uids, b.uids
    unique = all(len(u) == len(k) and None not in u and len(set(u)) == len(u) for u, k in ((ua, a.keys), (ub, b.keys)))
    if unique:
        keys_a, keys_b, by = list(ua), list(ub), "uid"
    else:
        keys_a, keys_b, by = list(a.keys), list(b.keys), "dp rank, sample id"
    common = sorted(set(keys_a) & set(keys_b), key=keys_a.index)
    if not common:
        raise TraceError(f"the two sides share no sample ({by})")
    pos_a = {k: i for i, k in enumerate(keys_a)}
    pos_b = {k: i for i, k in enumerate(keys_b)}
    return ([pos_a[k] for k in common], [pos_b[k] for k in common], len(set(keys_a) - set(keys_b)),
            len(set(keys_b) - set(keys_a)), by)


def compare(a: MergedPass, view_a: str, b: MergedPass, view_b: str, *, lowest: int = 5) -> dict[str, Any]:
    """Top-k set agreement of two views over the samples both hold (paired by uid where both sides
    name every sample, else by ``(dp rank, sample id)``), per layer and per sample (rows matched by
    token position, compared where valid in both)."""

    ba, bb = a.view(view_a), b.view(view_b)
    ia, ib, only_a, only_b, paired_by = _pairs(a, b)
    common = [a.keys[i] for i in ia]
    sa = ba.select(ia)
    sb = bb.select(ib)
    rep = route_agreement(sa, sb)
    layers = list(rep.layer_ids)
    xa, xb = sa.with_layers(layers), sb.with_layers(layers)
    n = min(xa.routes.shape[0], xb.routes.shape[0])
    if xa.rows_per_seq == xb.rows_per_seq and xa.start_rows == xb.start_rows:
        eq = topk_sets_equal(xa.routes[:n], xb.routes[:n])
        ok = xa.valid & xb.valid
        ag, cp = _per_sample(eq, ok, xa.offsets)
        low = _lowest(common, ag, cp, lowest, [a.uids[i] for i in ia] if a.uids else None)
    else:                                       # other token coverage: per-sample figures are skipped
        low = []
    return {"samples": len(common), "paired_by": paired_by, "samples_only_a": only_a,
            "samples_only_b": only_b, "tokens_compared": rep.rows_compared,
            "agreement": rep.mean, "tokens_differing_any_layer": rep.tokens_differing_any_layer,
            "per_layer": [{"layer": lid, "agreement": frac, "agree": ag_,
                           "differing_tokens": rep.rows_compared - ag_}
                          for (lid, frac), ag_ in zip(rep.per_layer.items(), rep.agree)],
            "lowest_samples": low}


def finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)

"""Route traces: the on-disk format, reading them back and merging ranks (core: torch only).

A trace is a folder written by the Megatron driver when the ``r3bridge`` section sets
``trace_dir`` (writer: :mod:`r3bridge.megatron.trace`). Each rank writes only what its routers
routed (its layers, its token rows, in router order) and never touches another rank's files:

* ``index.rank<NNNNN>.jsonl``: one JSON object per line, ``kind`` ``"pass"`` (one traced schedule
  run: step, pass name and index, action, route source, the rank's coordinates, the layout, the
  framework, the model's MoE layer ids, every micro-batch's packing and sample ids, the files, the
  driver's metrics of that pass) or ``"stopped"`` (the rank's share of ``trace_max_bytes`` is
  spent: nothing more was written, and why);
* ``step<SSSSSS>/<pass>.<index>/rank<NNNNN>.<view>.r3b``: ``ReplayBatch.to_bytes()`` payloads
  (CRC-checked) whose "sequences" are the pass's micro-batches and whose rows are the rank's
  router rows. Views: ``native`` (the router's own top-k under replay; valid on real-token rows)
  and, in a replay pass, ``replayed`` (the routes dispatched where valid: rollout or recorded).

:func:`load_trace` reads the indexes; :meth:`TracePass.merge` puts the ranks of one pass back
into per-sample batches with :func:`r3bridge.parallel.unsharding.unshard` (the exact inverse of the rank
distribution), so a multi-rank trace reads the same as a one-rank trace. Every problem with the
files raises :class:`TraceError` naming the file.
"""
from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from r3bridge.batch.schema import ReplayBatch, route_dtype
from r3bridge.errors import PayloadError, ReplayError
from r3bridge.metrics import expert_load, route_agreement, topk_sets_equal
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.packing import PackPlan, rank_positions
from r3bridge.parallel.targets import ShardedTargets
from r3bridge.parallel.unsharding import unshard

__all__ = ["TraceError", "FORMAT_VERSION", "VIEWS", "index_name", "payload_name", "layout_to_json",
           "layout_from_json", "micro_batch_entry", "rank_batch", "write_payload", "append_index", "Trace", "TracePass", "MergedPass", "load_trace", "pass_summary", "compare",
           "token_uid"]

FORMAT_VERSION = 1
VIEWS = ("replayed", "native", "dispatched")


class TraceError(PayloadError):
    """A trace folder, index or payload file is missing, truncated, corrupted or inconsistent
    (the message names the file)."""


def index_name(rank: int) -> str:
    return f"index.rank{rank:05d}.jsonl"


def payload_name(step: int, pass_name: str, pass_index: int, rank: int, view: str) -> str:
    return f"step{step:06d}/{pass_name}.{pass_index}/rank{rank:05d}.{view}.r3b"


def layout_to_json(layout: ParallelLayout) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(layout):
        if f.name.startswith("_"):
            continue
        v = getattr(layout, f.name)
        if f.name == "pipeline_model_parallel_layout" and v is not None:
            v = layout._stages                      # the parsed stage list: plain names
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def layout_from_json(d: dict[str, Any]) -> ParallelLayout:
    return ParallelLayout(**d)


# ===================================================================================== writing
def micro_batch_entry(seq_lens: Sequence[int], sample_ids: Sequence[Optional[int]], rows: int, *, format: str = "thd",
                      cu_seqlens_padded: Any = None, seq_length: Optional[int] = None,
                      uids: Optional[Sequence[Optional[str]]] = None) -> dict[str, Any]:
    """A micro-batch as the index records it: the packing :func:`r3bridge.parallel.unsharding.unshard` needs to
    place each router row, the sample of each sequence (``None``: a padding sequence) and, when the
    adapter passes them, the framework's own sample names (``uids``)."""
    cu = cu_seqlens_padded
    if isinstance(cu, torch.Tensor):
        cu = cu.tolist()
    return {"seq_lens": [int(x) for x in seq_lens], "sample_ids": [None if s is None else int(s) for s in sample_ids],
            "rows": int(rows), "format": format, "cu_seqlens_padded": None if cu is None else [int(x) for x in cu],
            "seq_length": None if seq_length is None else int(seq_length),
            "uids": None if uids is None else [None if u is None else str(u) for u in uids]}


def rank_batch(layout: ParallelLayout, tp_rank: int, cp_rank: int, micro_batches: Sequence[dict[str, Any]],
               ids: Sequence[dict[int, torch.Tensor]], valid: Sequence[Optional[torch.Tensor]], *, num_experts: int,
               source: str) -> ReplayBatch:
    """One rank's rows of one pass as a payload: sequence ``k`` = micro-batch ``k``'s router rows
    (``ids[k][layer]`` ``[rows, K]``), start row 0. A row is valid where it is a real token (packing
    padding never is) and, with ``valid[k]`` given, where that mask holds (rows that had a route)."""
    layers = sorted({lid for per in ids for lid in per})
    dtype = route_dtype(num_experts)
    parts, masks = [], []
    for mb, per, v in zip(micro_batches, ids, valid):
        plan = PackPlan.build(layout, mb["seq_lens"], format=mb["format"], cu_seqlens_padded=mb["cu_seqlens_padded"],
                              seq_length=mb["seq_length"])
        seq, pos = rank_positions(plan, layout, tp_rank, cp_rank)
        real = pos < plan.seq_lens[seq]
        parts.append(torch.stack([per[lid].to(dtype).cpu() for lid in layers], 1) if layers else
                     torch.zeros((int(seq.numel()), 0, 1), dtype=dtype))
        masks.append(real if v is None else v.cpu() & real)
    rows = [int(m["rows"]) for m in micro_batches]
    return ReplayBatch.from_trusted(torch.cat(parts), rows, [0] * len(rows), torch.cat(masks), tuple(layers),
                                    num_experts, source)


def write_payload(root: Path, name: str, data: bytes) -> None:
    """Write one payload file whole (a temporary file renamed: a reader never sees half of it)."""
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def append_index(root: Path, rank: int, entry: dict[str, Any]) -> int:
    """Append one line to the rank's index (one write call per line); returns its size in bytes."""
    root.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"version": FORMAT_VERSION, **entry}, allow_nan=True) + "\n"
    with open(root / index_name(rank), "a") as f:
        f.write(line)
    return len(line.encode())


# ===================================================================================== reading
@dataclass
class RankPass:
    """One rank's record of one traced pass (an index line) and where its payloads are."""

    root: Path
    entry: dict[str, Any]
    index_file: Path

    def load(self, view: str) -> ReplayBatch:
        name = self.entry["files"].get(view)
        if name is None:
            raise TraceError(f"{self.index_file}: step {self.entry['step']} {self.entry['pass']} has no "
                             f"{view!r} routes (action {self.entry['action']})")
        path = self.root / name
        try:
            data = path.read_bytes()
        except OSError as e:
            raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
        try:
            batch = ReplayBatch.from_bytes(data)
        except ReplayError as e:
            raise TraceError(f"{path}: not a valid r3bridge route file: {e}") from None
        mbs = self.entry["micro_batches"]
        if batch.rows_per_seq != [m["rows"] for m in mbs] or list(batch.layer_ids) != self.entry["layer_ids"]:
            raise TraceError(f"{path}: holds {batch.rows_per_seq} rows of layers {list(batch.layer_ids)}, its "
                             f"index {self.index_file.name} says {[m['rows'] for m in mbs]} of {self.entry['layer_ids']}")
        return batch


@dataclass
class MergedPass:
    """One pass, every rank merged: one sequence per sample (all its tokens, start row 0), samples
    in ``(dp_rank, sample id)`` order. ``native``: valid on every token; ``replayed``: valid where
    a route was replayed (``None`` in a recording pass)."""

    keys: list[tuple[int, int]]                 # (dp_rank, sample id) per sequence
    native: ReplayBatch
    replayed: Optional[ReplayBatch]
    uids: list[Optional[str]] = field(default_factory=list)   # the framework's sample names, if given

    @property
    def sample_ids(self) -> list[int]:
        return [s for _, s in self.keys]

    @property
    def dispatched(self) -> ReplayBatch:
        """What the experts computed: the replayed route where there was one, else native."""
        if self.replayed is None:
            return self.native
        r, n = self.replayed, self.native
        routes = torch.where(r.valid[:, None, None], r.routes, n.routes)
        return ReplayBatch(routes, n.valid.clone(), n.rows_per_seq, n.start_rows, n.layer_ids, n.num_experts,
                           n.topk, "dispatched")

    def view(self, name: str) -> ReplayBatch:
        if name == "native":
            return self.native
        if name == "dispatched":
            return self.dispatched
        if name == "replayed":
            if self.replayed is None:
                raise TraceError("a recording pass (R2 compute_log_prob) has no replayed routes: use "
                                 "the native view")
            return self.replayed
        raise TraceError(f"unknown view {name!r}; one of {list(VIEWS)}")


@dataclass
class TracePass:
    """One traced pass (a schedule run) and the ranks that wrote it."""

    step: int
    name: str                                   # compute_log_prob / update
    index: int                                  # the n-th pass of that name in the step
    ranks: list[RankPass] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name}.{self.index}"

    @property
    def first(self) -> dict[str, Any]:
        return self.ranks[0].entry

    def merge(self) -> MergedPass:
        """Every rank's rows and layers back into one per-sample batch (``unshard`` per micro-batch
        and data-parallel rank). A rank missing from the pass (or files that disagree) raises
        :class:`TraceError` naming the pass."""
        where = f"step {self.step} {self.label}"
        e0 = self.first
        layout = layout_from_json(e0["layout"])
        E = int(e0["num_experts"])
        by_dp: dict[int, list[RankPass]] = {}
        for rp in self.ranks:
            by_dp.setdefault(int(rp.entry["dp_rank"]), []).append(rp)
        keyed: dict[tuple[int, int], tuple[ReplayBatch, Optional[ReplayBatch]]] = {}
        uid_of: dict[tuple[int, int], Optional[str]] = {}
        has_replay = "replayed" in e0["files"]
        for dp, rps in sorted(by_dp.items()):
            loaded = [(rp, rp.load("native"), rp.load("replayed") if has_replay else None) for rp in rps]
            mbs = rps[0].entry["micro_batches"]
            for rp in rps[1:]:
                if [(m["seq_lens"], m["sample_ids"]) for m in rp.entry["micro_batches"]] != \
                        [(m["seq_lens"], m["sample_ids"]) for m in mbs]:
                    raise TraceError(f"{rp.index_file}: {where}: micro-batches differ from rank "
                                     f"{rps[0].entry['rank']}'s in the same data-parallel group")
            for k, mb in enumerate(mbs):
                views = []
                for v in ("native", "replayed") if has_replay else ("native",):
                    targets = {}
                    for rp, nat, rep in loaded:
                        b = nat if v == "native" else rep
                        routes, valid = b.sequence(k)
                        key = (int(rp.entry["tp_rank"]), int(rp.entry["cp_rank"]), int(rp.entry["pp_rank"]), 0)
                        if key in targets:
                            raise TraceError(f"{rp.index_file}: {where}: two ranks claim (tp, cp, pp) = {key[:3]}")
                        targets[key] = ShardedTargets({lid: routes[:, j] for j, lid in enumerate(b.layer_ids)},
                                                      valid, tuple(b.layer_ids), b.topk)
                    try:
                        views.append(unshard(targets, layout, mb["seq_lens"], num_experts=E, format=mb["format"],
                                             cu_seqlens_padded=mb["cu_seqlens_padded"],
                                             seq_length=mb["seq_length"], source=loaded[0][1 if v == "native" else 2].source))
                    except ReplayError as e:
                        ranks = sorted(int(rp.entry["rank"]) for rp in rps)
                        raise TraceError(f"{self.ranks[0].root}: {where}, micro-batch {k}: ranks {ranks} do not "
                                         f"make up the model ({e})") from None
                for i, sid in enumerate(mb["sample_ids"]):
                    if sid is None:
                        continue                # a padding sequence: no sample
                    if (dp, sid) in keyed:
                        raise TraceError(f"{rps[0].index_file}: {where}: sample {sid} appears twice")
                    keyed[(dp, sid)] = (views[0].select([i]), views[1].select([i]) if has_replay else None)
                    uid_of[(dp, sid)] = (mb.get("uids") or [None] * len(mb["sample_ids"]))[i]
        keys = sorted(keyed)
        if not keys:
            raise TraceError(f"{self.ranks[0].index_file}: {where}: no sample was traced")
        native = ReplayBatch.concat([keyed[k][0] for k in keys])
        replayed = ReplayBatch.concat([keyed[k][1] for k in keys]) if has_replay else None  # type: ignore[misc]
        return MergedPass(keys, native, replayed, [uid_of[k] for k in keys])


@dataclass
class Trace:
    root: Path
    passes: list[TracePass]
    stops: list[dict[str, Any]]                 # "stopped" index lines, one per rank that stopped
    ranks: list[int]

    @property
    def meta(self) -> dict[str, Any]:
        return self.passes[0].first if self.passes else {}

    def find(self, step: int, label: str) -> TracePass:
        name, _, idx = label.partition(".")
        for p in self.passes:
            if p.step == step and p.name == name and p.index == int(idx or 0):
                return p
        raise TraceError(f"{self.root}: no traced pass {label!r} in step {step} (traced: "
                         f"{sorted({(p.step, p.label) for p in self.passes})})")


def load_trace(path: str | Path) -> Trace:
    """Read every rank's index of a trace folder. :class:`TraceError` (naming the file) on a
    folder without index, a line that is not complete JSON (a truncated index), or a pass that
    two ranks describe differently."""
    root = Path(path)
    if not root.is_dir():
        raise TraceError(f"{root}: not a trace folder")
    files = sorted(root.glob("index.rank*.jsonl"))
    if not files:
        raise TraceError(f"{root}: no index.rank*.jsonl: not a trace folder (set the r3bridge option trace_dir)")
    by_key: dict[tuple[int, str, int], TracePass] = {}
    order: dict[tuple[int, str, int], int] = {}
    stops: list[dict[str, Any]] = []
    ranks: set[int] = set()
    for f in files:
        try:
            text = f.read_text()
        except OSError as e:
            raise TraceError(f"{f}: cannot read: {e.strerror or e}") from None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                if not isinstance(entry, dict):
                    raise ValueError("not an object")
                kind = entry["kind"]
                if entry.get("version") != FORMAT_VERSION:
                    raise ValueError(f"format version {entry.get('version')!r}, this r3bridge reads {FORMAT_VERSION}")
                ranks.add(int(entry["rank"]))
                if kind == "stopped":
                    stops.append(entry)
                    continue
                key = (int(entry["step"]), str(entry["pass"]), int(entry["pass_index"]))
                seq = int(entry["seq"])
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{f}: line {n} is not a valid trace index entry (truncated or corrupted): "
                                 f"{type(e).__name__}: {e}") from None
            tp = by_key.setdefault(key, TracePass(*key))
            order.setdefault(key, seq)
            tp.ranks.append(RankPass(root, entry, f))
    passes = sorted(by_key.values(), key=lambda p: (p.step, order[(p.step, p.name, p.index)]))
    for p in passes:
        p.ranks.sort(key=lambda rp: int(rp.entry["rank"]))
    return Trace(root, passes, stops, sorted(ranks))


# ===================================================================================== analysis
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
    out: dict[str, Any] = {"step": tp.step, "pass": tp.label, "action": e0["action"], "source": e0["source"],
                           "ranks": [int(rp.entry["rank"]) for rp in tp.ranks], "samples": nat.num_seqs,
                           "rows": rows, "logged": e0.get("metrics", {})}
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


def token_uid(tokens: Any) -> str:
    """A sample's name from its tokens (``"<length>:<crc32>"``): the same in every pass of a step
    and in every run that trains the same trajectory, whatever a framework numbers, shuffles or
    re-partitions. Adapters pass it as :attr:`r3bridge.megatron.MicroBatch.uids` when tracing, so
    ``r3bridge diff`` pairs samples by it."""
    arr = np.ascontiguousarray(torch.as_tensor(tokens).detach().cpu().to(torch.int64).numpy(), dtype="<i8")
    return f"{arr.size}:{zlib.crc32(arr.tobytes()):08x}"


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
            "samples_only_b": only_b, "rows_compared": rep.rows_compared,
            "agreement": rep.mean, "tokens_differing_any_layer": rep.tokens_differing_any_layer,
            "per_layer": [{"layer": lid, "agreement": frac, "agree": ag_,
                           "differing_rows": rep.rows_compared - ag_}
                          for (lid, frac), ag_ in zip(rep.per_layer.items(), rep.agree)],
            "lowest_samples": low}


def finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)

"""Reading a route trace back (:func:`load_trace`) and merging its ranks: :meth:`TracePass.merge`
puts the ranks of one pass back into per-sample batches with
:func:`r3bridge.parallel.unsharding.unshard` (the exact inverse of the rank distribution), so a
multi-rank trace reads the same as a one-rank trace. Every problem with the files raises
:class:`r3bridge.trace.format.TraceError` naming the file. The format: :mod:`r3bridge.trace.format`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.errors import ReplayError
from r3bridge.parallel.targets import ShardedTargets
from r3bridge.parallel.unsharding import unshard
from r3bridge.trace.format import FORMAT_VERSION, VIEWS, TraceError, layout_from_json

__all__ = ["RankPass", "MergedPass", "TracePass", "Trace", "load_trace"]


@dataclass
class RankPass:
    """One rank's record of one traced pass (an index line) and where its payloads are."""

    root: Path
    entry: dict[str, Any]
    index_file: Path

    def load(self, view: str) -> ReplayBatch:
        name = self.entry["files"].get(view)
        if name is None:
            raise TraceError(f"{self.index_file}: step {self.entry['step']} {self.entry['phase']} has no "
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
        if view == "handed":                    # one sequence per sample, not per micro-batch
            samples = self.entry.get("handed_sample_ids") or []
            if batch.num_seqs != len(samples):
                raise TraceError(f"{path}: holds {batch.num_seqs} samples, its index {self.index_file.name} names "
                                 f"{len(samples)}")
            return batch
        mbs = self.entry["micro_batches"]
        if batch.rows_per_seq != [m["rows"] for m in mbs] or list(batch.layer_ids) != self.entry["layer_ids"]:
            raise TraceError(f"{path}: holds {batch.rows_per_seq} rows of layers {list(batch.layer_ids)}, its "
                             f"index {self.index_file.name} says {[m['rows'] for m in mbs]} of {self.entry['layer_ids']}")
        return batch


@dataclass
class MergedPass:
    """One pass, every rank merged: one sequence per sample (all its tokens, start row 0), samples
    in ``(dp_rank, sample id)`` order. ``native``: valid on every token; ``replayed``: valid where
    a route was replayed (``None`` in a recording pass); ``handed``: the routes as the framework
    handed them over, rows from each sample's start row (``None`` where the pass wrote none)."""

    keys: list[tuple[int, int]]                 # (dp_rank, sample id) per sequence
    native: ReplayBatch
    replayed: Optional[ReplayBatch]
    uids: list[Optional[str]] = field(default_factory=list)   # the framework's sample names, if given
    handed: Optional[ReplayBatch] = None

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
        if name == "handed":
            if self.handed is None:
                raise TraceError("this pass has no handed routes (a recording pass replays none; a trace of a pass "
                                 "whose handed routes were not kept)")
            return self.handed
        raise TraceError(f"unknown view {name!r}; one of {list(VIEWS)}")


@dataclass
class TracePass:
    """One traced pass (a schedule run) and the ranks that wrote it."""

    step: int
    name: str                                   # its phase: compute_log_prob / update
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
        handed_of: dict[tuple[int, int], ReplayBatch] = {}
        has_replay = "replayed" in e0["files"]
        for dp, rps in sorted(by_dp.items()):
            for rp in rps:
                if "handed" in rp.entry["files"]:
                    hb = rp.load("handed")
                    for i, sid in enumerate(rp.entry["handed_sample_ids"]):
                        handed_of[(dp, int(sid))] = hb.select([i])
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
                                             seq_length=mb["seq_length"],
                                             route_kind=loaded[0][1 if v == "native" else 2].route_kind))
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
        handed = None
        if handed_of:
            missing = [k for k in keys if k not in handed_of]
            if missing:
                raise TraceError(f"{self.ranks[0].root}: {where}: the handed routes lack samples {missing[:5]} "
                                 f"((dp rank, sample id)) that the routers saw")
            handed = ReplayBatch.concat([handed_of[k] for k in keys])
        return MergedPass(keys, native, replayed, [uid_of[k] for k in keys], handed)


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
                key = (int(entry["step"]), str(entry["phase"]), int(entry["pass_index"]))
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

"""``r3bridge.trace``: per-rank trace payloads merge back into the batch every rank routed a part
of, for layouts the harness trace tests do not run (TP x CP x PP with SP, VPP, BSHD), with
``shard`` producing each rank's rows (the router's row order); and damaged traces are refused
naming the file. Core only: no megatron."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from r3bridge.batch.schema import ReplayBatch
from r3bridge.parallel.layout import ParallelLayout
from r3bridge.parallel.sharding import shard
from r3bridge.trace import (
    TraceError,
    append_index,
    layout_to_json,
    load_trace,
    micro_batch_entry,
    pass_summary,
    payload_name,
    rank_batch,
    write_payload,
)

E, K = 16, 4


def _batch(lens, layers, seed, *, start_last=False, invalid_every=0) -> ReplayBatch:
    g = torch.Generator().manual_seed(seed)
    rows = [n - 1 if start_last else n for n in lens]
    total = sum(rows)
    routes = torch.rand((total, len(layers), E), generator=g).topk(K, dim=-1).indices
    valid = None
    if invalid_every:
        valid = torch.ones(total, dtype=torch.bool)
        valid[::invalid_every] = False
    return ReplayBatch.from_packed(routes, rows, num_experts=E, layer_ids=layers, valid=valid, route_kind="rollout")


def _write(root: Path, layout: ParallelLayout, mbs, natives, replays, sample_ids) -> None:
    """Every rank's files, as the driver's tracer writes them (one rank per (tp, cp, pp))."""
    rank = 0
    for pp in range(layout.pp):
        for cp in range(layout.cp):
            for tp in range(layout.tp):
                entries, nat_ids, rep_ids, rep_valid = [], [], [], []
                for k, (mb, nat, rep) in enumerate(zip(mbs, natives, replays)):
                    nt = [shard(nat, layout, mb["seq_lens"], tp_rank=tp, cp_rank=cp, pp_rank=pp, vp_stage=v,
                                format=mb["format"], seq_length=mb["seq_length"]) for v in range(layout.vp_size)]
                    rt = [shard(rep, layout, mb["seq_lens"], tp_rank=tp, cp_rank=cp, pp_rank=pp, vp_stage=v,
                                format=mb["format"], seq_length=mb["seq_length"]) for v in range(layout.vp_size)]
                    entries.append(micro_batch_entry(mb["seq_lens"], sample_ids[k], nt[0].num_rows,
                                                     format=mb["format"], seq_length=mb["seq_length"],
                                                     uids=[None if s is None else f"u{s}" for s in sample_ids[k]]))
                    nat_ids.append({lid: t for s in nt for lid, t in s.indices.items()})
                    rep_ids.append({lid: t for s in rt for lid, t in s.indices.items()})
                    rep_valid.append(rt[0].valid)
                args = (layout, tp, cp, entries)
                native = rank_batch(*args, nat_ids, [None] * len(mbs), num_experts=E, route_kind="native")
                replayed = rank_batch(*args, rep_ids, rep_valid, num_experts=E, route_kind="rollout")
                files = {}
                for view, b in (("native", native), ("replayed", replayed)):
                    files[view] = payload_name(1, "update", 0, rank, view)
                    write_payload(root, files[view], b.to_bytes())
                append_index(root, rank, {
                    "kind": "pass", "step": 1, "phase": "update", "pass_index": 0, "seq": 0, "action": "replay",
                    "route_kind": "rollout", "mode": "R3", "framework": "test", "rank": rank,
                    "world_size": layout.tp * layout.cp * layout.pp, "dp_rank": 0, "tp_rank": tp, "cp_rank": cp,
                    "pp_rank": pp, "layout": layout_to_json(layout), "moe_layer_ids": layout.moe_layer_ids,
                    "layer_ids": list(native.layer_ids), "num_experts": E, "topk": K, "micro_batches": entries,
                    "files": files, "bytes": 0, "metrics": {}})
                rank += 1


LAYOUTS = {
    "tp2_cp2_pp2_sp": (ParallelLayout(num_layers=4, tp=2, cp=2, pp=2, sequence_parallel=True), "thd"),
    "tp2_no_sp_pp2_vpp2": (ParallelLayout(num_layers=8, moe_layer_freq=[0, 1] * 4, tp=2, pp=2, vpp=2,
                                          sequence_parallel=False), "thd"),
    "bshd_tp2_cp2": (ParallelLayout(num_layers=2, tp=2, cp=2, sequence_parallel=True), "bshd"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ranks_merge_back_into_the_batch(tmp_path, name):
    layout, fmt = LAYOUTS[name]
    layers = layout.moe_layer_ids
    lens = [[9, 14, 5], [12, 7]]
    seq_length = 16 if fmt == "bshd" else None
    mbs = [{"seq_lens": x, "format": fmt, "seq_length": seq_length} for x in lens]
    # native: a route for every token; replayed: engine-style (no last token), some rows without one
    natives = [_batch(x, layers, 10 + k) for k, x in enumerate(lens)]
    replays = [_batch(x, layers, 20 + k, start_last=True, invalid_every=4) for k, x in enumerate(lens)]
    # micro-batch 1 holds a padding sequence (sample None) after sample 0; sample ids out of order
    sample_ids = [[4, 2, 3], [0, None]]
    _write(tmp_path, layout, mbs, natives, replays, sample_ids)
    trace = load_trace(tmp_path)
    assert trace.ranks == list(range(layout.tp * layout.cp * layout.pp))
    (p,) = trace.passes
    m = p.merge()
    assert m.sample_ids == [0, 2, 3, 4] and m.uids == ["u0", "u2", "u3", "u4"]
    where = {4: (0, 0), 2: (0, 1), 3: (0, 2), 0: (1, 0)}
    for i, s in enumerate(m.sample_ids):
        k, j = where[s]
        want, _ = natives[k].sequence(j)
        got, gv = m.native.sequence(i)
        assert bool(gv.all()) and torch.equal(got, want), (name, s)
        want, wv = replays[k].sequence(j)
        got, gv = m.replayed.sequence(i)
        n = want.shape[0]
        assert torch.equal(gv[:n], wv) and not bool(gv[n:].any()), (name, s)
        assert torch.equal(got[:n][wv], want[wv]), (name, s)
    # dispatched = replayed where there was a route, else native
    d = m.dispatched
    rv = m.replayed.valid
    assert torch.equal(d.routes[rv], m.replayed.routes[rv]) and torch.equal(d.routes[~rv], m.native.routes[~rv])
    s = pass_summary(p, m)
    assert s["samples"] == 4 and s["tokens"] == 9 + 14 + 5 + 12
    assert s["coverage"] == pytest.approx(int(rv.sum()) / s["tokens"])


def test_a_missing_rank_a_bad_payload_and_a_torn_index_are_refused_naming_the_file(tmp_path):
    layout, fmt = LAYOUTS["tp2_cp2_pp2_sp"]
    lens = [[9, 14, 5]]
    mbs = [{"seq_lens": lens[0], "format": fmt, "seq_length": None}]
    _write(tmp_path, layout, mbs, [_batch(lens[0], layout.moe_layer_ids, 1)],
           [_batch(lens[0], layout.moe_layer_ids, 2, start_last=True)], [[0, 1, 2]])
    payload = tmp_path / payload_name(1, "update", 0, 5, "native")
    data = payload.read_bytes()
    payload.write_bytes(data[:-7])                                # truncated
    with pytest.raises(TraceError, match=str(payload)):
        load_trace(tmp_path).passes[0].merge()
    payload.write_bytes(data)
    index = tmp_path / "index.rank00003.jsonl"
    line = index.read_text()
    index.unlink()                                               # a rank missing: the model is not whole
    with pytest.raises(TraceError, match="do not make up the model"):
        load_trace(tmp_path).passes[0].merge()
    index.write_text(line[: len(line) // 2])                     # a torn line
    with pytest.raises(TraceError, match=f"{index}: line 1"):
        load_trace(tmp_path)
    entry = json.loads(line)
    entry["version"] = 99
    index.write_text(json.dumps(entry) + "\n")
    with pytest.raises(TraceError, match="format version 99"):
        load_trace(tmp_path)
    with pytest.raises(TraceError, match="no index"):
        load_trace(tmp_path / "step000001")

"""Route traces (``trace_dir``) written by the driver through :class:`r3bridge.session.PhaseRunner`
and read back by :mod:`r3bridge.trace` and the CLI, on real harness models (megatron-core GPT, MoE
on every layer, identity attention, megatron's schedules).

One spawn of 2 gloo ranks runs the same job (R3: compute_log_prob, two update mini-batches, then a
second step; then R2) under PP2 and serially (tp = pp = 1, each rank its own one-rank trace). The
routing probe records what every router dispatched; the trace read back must equal it, row by row,
for every sample; the PP2 trace, merged over its ranks, must equal the one-rank trace; the
agreement the trace gives per layer and pass must equal the metrics the driver reported.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from r3bridge.testing.harness.dist import Layout, spawn_layouts

V, E, K = 128, 8, 2
BASE = dict(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=V, num_moe_experts=E,
            moe_router_topk=K, moe_aux_loss_coeff=0.0, attention="identity")
# four micro-batches of two samples each; sample ids 0..7 (mini-batch k holds samples 2k, 2k+1)
LENS = [[9, 7], [6, 10], [12, 4], [5, 11]]
PAD_TO = 32                      # equal packed totals: megatron refuses variable lengths under PP
LAYOUTS = [Layout(pp=2), Layout()]


def _job(ctx, root: str) -> dict:
    from replay_grid import make_routes

    from r3bridge.config import Phase, ReplayConfig
    from r3bridge.megatron import MicroBatch, Replayer
    from r3bridge.session import PhaseRunner
    from r3bridge.testing.harness.data import make_packed_batch
    from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
    from r3bridge.testing.harness.probe import RoutingProbe
    from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

    serial = ctx.pp == 1
    where = f"{root}/{'serial' if serial else 'pp2'}"
    chunks = build_model_chunks(ModelSpec(**BASE, num_layers=4), ctx)
    fstep = make_forward_step(ctx, thd=True)
    batches = [make_packed_batch(lens, V, seed=20 + i, pad_to=PAD_TO) for i, lens in enumerate(LENS)]
    ids = [[2 * k, 2 * k + 1] for k in range(len(batches))]
    out: dict = {"passes": {}}

    def run(runner, mode, routes, state, phase, mb_idx, *, forward_only, label):
        if mode == "R2" and phase is Phase.UPDATE:
            mbs = [MicroBatch(batches[k].seq_lens, state["recorded"].select(ids[k]), ids[k],
                              cu_seqlens_padded=batches[k].cu_seqlens_padded) for k in mb_idx]
        else:
            mbs = [MicroBatch(batches[k].seq_lens, routes[k] if mode == "R3" else None, ids[k],
                              cu_seqlens_padded=batches[k].cu_seqlens_padded, uids=[f"uid-{s}" for s in ids[k]])
                   for k in mb_idx]
        with RoutingProbe(chunks) as probe:
            with runner.run(phase, forward_only=forward_only, targets=mbs) as ps:
                run_schedule(chunks, [batches[k] for k in mb_idx], fstep, forward_only=forward_only)
        if ps.result.recorded is not None:
            state["recorded"] = ps.result.recorded
        # what the routers dispatched (first passes only: a recompute dispatches the same), per
        # (sample, layer): [tokens, K] sorted, on a rank that routes every token (serial)
        calls = [c for c in probe.calls if c.grad_enabled or forward_only]
        disp = {}
        if serial:
            per_layer: dict[int, list] = {}
            for c in calls:
                per_layer.setdefault(c.layer_id, []).append(c.topk())
            for lid, tops in per_layer.items():
                assert len(tops) == len(mb_idx), (label, lid, len(tops))
                for k, top in zip(mb_idx, tops):
                    cu = batches[k].cu_seqlens_padded.tolist()
                    for j, s in enumerate(ids[k]):
                        disp[(s, lid)] = top[cu[j]:cu[j] + batches[k].seq_lens[j]].clone()
        out["passes"][(mode, label)] = {"metrics": dict(ps.result.metrics), "tagged": dict(ps.result.tagged),
                                        "dispatched": disp}

    for mode in ("R3", "R2"):
        trace_dir = f"{where}/{mode}" + (f"/rank{ctx.rank}" if serial else "")
        cfg = ReplayConfig(replay_mode=mode, trace_dir=trace_dir, agreement=(mode == "R3"),
                           per_layer_metrics=True)     # every layer logged, to compare with the trace
        rep = Replayer.from_config(chunks, cfg)
        runner = PhaseRunner(rep, cfg, framework="harness")
        routes = [make_routes(rep.layout, b.seq_lens, E, K, 60 + i, invalid_every=5 if i == 1 else 0)
                  for i, b in enumerate(batches)]
        state: dict = {}
        for step in range(2):
            run(runner, mode, routes, state, Phase.OLD_LOG_PROB, [0, 1, 2, 3], forward_only=True,
                label=f"{step + 1}/compute_log_prob.0")      # the trace counts RL steps from 1
            run(runner, mode, routes, state, Phase.UPDATE, [0, 1], forward_only=False, label=f"{step + 1}/update.0")
            if step == 0:
                run(runner, mode, routes, state, Phase.UPDATE, [2, 3], forward_only=False, label=f"{step + 1}/update.1")
        rep.detach()
        out[mode] = {"routes": [r.to_bytes() for r in routes], "trace_dir": trace_dir}
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    pp, serial = spawn_layouts(_job, world_size=2, layouts=LAYOUTS, args=(str(root),), timeout=900)
    return root, pp, serial


def _merged(trace_dir, step, label):
    from r3bridge.trace import load_trace

    return load_trace(trace_dir).find(step, label).merge()


def _passes(res):
    return [(mode, label) for mode, label in res["passes"]]


def test_trace_holds_what_the_routers_dispatched(job):
    from r3bridge.batch.schema import ReplayBatch

    _, _, serial = job
    for r in serial:
        for (mode, label), p in r["passes"].items():
            step, name = label.split("/")
            m = _merged(r[mode]["trace_dir"], int(step), name)
            assert m.sample_ids == sorted({s for s, _ in p["dispatched"]}), (mode, label)
            # the adapter's sample names (R3 passes and R2's recording pass here) travel with them
            named = mode == "R3" or name.startswith("compute_log_prob")
            assert m.uids == [f"uid-{s}" if named else None for s in m.sample_ids], (mode, label)
            disp = m.dispatched
            for i, s in enumerate(m.sample_ids):
                got, _ = disp.sequence(i)
                for j, lid in enumerate(disp.layer_ids):
                    want = p["dispatched"][(s, lid)]
                    assert torch.equal(got[:, j].to(torch.int64).sort(-1).values, want), (mode, label, s, lid)
            if mode == "R3":
                # the replayed view is the rollout routes (rows with a route), whatever was native
                routes = ReplayBatch.concat([ReplayBatch.from_bytes(b) for b in r["R3"]["routes"]])
                rep = m.replayed
                assert rep is not None and rep.route_kind == "rollout"
                # what the framework handed over is kept per sample: the routes, and the routers
                # dispatched exactly them
                assert m.handed is not None and m.handed.route_kind == "rollout"
                for i, s in enumerate(m.sample_ids):
                    want, wv = routes.sequence(s)
                    got, gv = rep.sequence(i)
                    n = want.shape[0]
                    assert torch.equal(gv[:n], wv) and not bool(gv[n:].any()), (label, s)
                    assert torch.equal(got[:n][wv].sort(-1).values, want[wv].sort(-1).values), (label, s)
                    hr, hv = m.handed.sequence(i)
                    assert torch.equal(hv, wv[:hv.shape[0]]) and torch.equal(hr[hv], want[:hr.shape[0]][hv]), (label, s)
            else:
                assert (m.replayed is None) == name.startswith("compute_log_prob"), label


def test_r2_recording_pass_traces_the_native_routes_and_the_update_replays_them(job):
    _, _, serial = job
    r = serial[0]
    rec = _merged(r["R2"]["trace_dir"], 1, "compute_log_prob.0")
    upd = _merged(r["R2"]["trace_dir"], 1, "update.1")
    assert rec.replayed is None and upd.replayed is not None and upd.replayed.route_kind == "recorded"
    assert rec.handed is None and upd.handed is not None and upd.handed.route_kind == "recorded"
    # the update replays, for its samples, exactly what compute_log_prob's routers chose
    for i, s in enumerate(upd.sample_ids):
        got, gv = upd.replayed.sequence(i)
        want, _ = rec.native.sequence(rec.sample_ids.index(s))
        assert bool(gv.all()) and torch.equal(got, want), s


def test_multi_rank_trace_merges_to_the_one_rank_trace(job):
    _, pp, serial = job
    ranks_dirs = {r["R3"]["trace_dir"] for r in pp}
    assert len(ranks_dirs) == 1                 # one trace folder written by both PP ranks
    from r3bridge.trace import load_trace

    t = load_trace(pp[0]["R3"]["trace_dir"])
    assert t.ranks == [0, 1]
    # each PP rank wrote only its own layers
    first = t.passes[0]
    assert sorted(tuple(rp.entry["layer_ids"]) for rp in first.ranks) == [(0, 1), (2, 3)]
    for mode in ("R3", "R2"):
        for (m, label) in serial[0]["passes"]:
            if m != mode:
                continue
            step, name = label.split("/")
            a = _merged(pp[0][mode]["trace_dir"], int(step), name)
            b = _merged(serial[0][mode]["trace_dir"], int(step), name)
            assert a.sample_ids == b.sample_ids
            assert a.native.equals(b.native), (mode, label)
            assert (a.replayed is None and b.replayed is None) or a.replayed.equals(b.replayed), (mode, label)


def test_trace_agreement_equals_the_logged_metrics(job):
    from r3bridge.trace import load_trace, pass_summary

    _, pp, serial = job
    for res in (pp[0], serial[0]):
        trace = load_trace(res["R3"]["trace_dir"])
        for (mode, label), p in res["passes"].items():
            if mode != "R3":
                continue
            step, name = label.split("/")
            tp = trace.find(int(step), name)
            s = pass_summary(tp, tp.merge())
            logged = p["metrics"]
            assert s["agreement"] == pytest.approx(logged["r3bridge/agreement/mean"], abs=1e-12), label
            assert s["coverage"] == pytest.approx(logged["r3bridge/coverage"], abs=1e-12), label
            for row in s["per_layer"]:
                assert row["agreement"] == pytest.approx(logged[f"r3bridge/agreement/layer_{row['layer']}"],
                                                         abs=1e-12), (label, row["layer"])
            assert min(row["agreement"] for row in s["per_layer"]) == pytest.approx(
                logged["r3bridge/agreement/layer_min"], abs=1e-12), label
            assert 0.0 < s["agreement"] < 0.8        # random routes: replay really overrode the router
            assert logged["r3bridge/trace/bytes"] > 0 and "r3bridge/trace/stopped" not in logged


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "r3bridge.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_inspect_and_diff_read_a_multi_rank_trace(job):
    _, pp, serial = job
    d = pp[0]["R3"]["trace_dir"]
    r = _cli("inspect", d, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["ranks"] == [0, 1] and s["framework"] == "harness" and s["moe_layer_ids"] == [0, 1, 2, 3]
    labels = [(p["step"], p["pass"]) for p in s["passes"]]
    assert labels == [(1, "compute_log_prob.0"), (1, "update.0"), (1, "update.1"), (2, "compute_log_prob.0"),
                      (2, "update.0")]
    # every pass compared what the routers dispatched with what the framework handed over: exact
    for p in s["passes"]:
        assert p["handed"]["differing"] == 0 and p["handed"]["pairs"] > 0, p["pass"]
        assert p["handed"]["layers_not_compared"] == []
    for p in s["passes"]:
        logged = p["logged"]
        assert p["agreement"] == pytest.approx(logged["r3bridge/agreement/mean"], abs=1e-12)
        assert len(p["lowest_samples"]) == min(5, p["samples"])
        assert p["lowest_samples"] == sorted(p["lowest_samples"], key=lambda x: (x["agreement"], x["dp_rank"],
                                                                                    x["sample"]))
    # the serial one-rank trace reads the same
    r1 = _cli("inspect", serial[0]["R3"]["trace_dir"], "--json")
    s1 = json.loads(r1.stdout)
    for a, b in zip(s["passes"], s1["passes"]):
        assert {k: a[k] for k in ("agreement", "coverage", "per_layer", "samples", "tokens")} == \
            {k: b[k] for k in ("agreement", "coverage", "per_layer", "samples", "tokens")}
    text = _cli("inspect", d)
    assert text.returncode == 0 and "per-layer agreement" in text.stdout and "lowest agreement" in text.stdout
    pairs = sum(p["handed"]["pairs"] for p in s["passes"])
    assert f"replay exact: 0 of {pairs} (token, layer) pairs" in text.stdout
    # the routes replayed here are random, not the trainer's model's: inspect says the two are different
    # models (not a replay failure); a model served by the engine it trains agrees far more
    from r3bridge.cli.trace_view import models_note

    assert len(s["notes"]) == 1 and "so the engine and the trainer are different models" in s["notes"][0]
    assert s["notes"][0] in text.stdout and models_note(0.97) is None
    # diff: rollout vs native in each pass equals the agreement; compute_log_prob vs update (native)
    r = _cli("diff", d, "--json")
    assert r.returncode == 0, r.stderr
    dd = json.loads(r.stdout)
    for c, p in zip(dd["comparisons"], s["passes"]):
        assert c["view_a"] == "replayed" and c["view_b"] == "native"
        assert c["agreement"] == pytest.approx(p["agreement"], abs=1e-12)
    assert dd["notes"] == s["notes"]
    r = _cli("diff", d, "--pass", "compute_log_prob", "--vs-pass", "update.1", "--step", "1", "--json")
    assert r.returncode == 0, r.stderr
    c = json.loads(r.stdout)["comparisons"]
    assert len(c) == 1 and c[0]["samples"] == 4 and c[0]["view_a"] == c[0]["view_b"] == "native"
    # two traces: the PP2 run against the serial run, dispatched routes: identical
    r = _cli("diff", d, serial[0]["R3"]["trace_dir"], "--json")
    assert r.returncode == 0, r.stderr
    assert all(c["agreement"] == 1.0 for c in json.loads(r.stdout)["comparisons"])
    # dispatched vs handed through diff: the same pairs, none differing
    r = _cli("diff", d, "--view", "dispatched", "--vs-view", "handed", "--json")
    assert r.returncode == 0, r.stderr
    comps = json.loads(r.stdout)["comparisons"]
    assert [c["agreement"] for c in comps] == [1.0] * len(s["passes"])
    assert [c["tokens_compared"] for c in comps] == [p["handed"]["tokens"] for p in s["passes"]]


def test_inspect_says_not_exact_when_the_dispatched_routes_differ_from_the_handed_ones(job, tmp_path):
    import shutil

    from r3bridge.batch.schema import ReplayBatch

    _, pp, _ = job
    d = tmp_path / "t"
    shutil.copytree(pp[0]["R3"]["trace_dir"], d)
    # one (token, layer) pair of the handed routes changed to an expert the row does not hold, as if
    # the trainer had dispatched something else than the framework handed over
    payload = sorted(d.glob("step000001/update.0/rank*.handed.r3b"))[0]
    b = ReplayBatch.from_bytes(payload.read_bytes())
    routes = b.routes.clone()
    row = int(b.valid.nonzero()[0])
    routes[row, 0, 0] = next(e for e in range(E) if e not in routes[row, 0].tolist())
    payload.write_bytes(ReplayBatch(routes, b.valid, b.rows_per_seq, b.start_rows, b.layer_ids, b.num_experts,
                                    b.topk, b.route_kind).to_bytes())
    r = _cli("inspect", str(d), "--json")
    s = json.loads(r.stdout)
    bad = [(p["step"], p["pass"], p["handed"]["differing"]) for p in s["passes"] if p["handed"]["differing"]]
    assert bad == [(1, "update.0", 1)], bad
    text = _cli("inspect", str(d)).stdout
    assert "replay NOT EXACT: 1 of" in text


def test_a_corrupted_or_truncated_trace_file_is_refused_naming_it(job, tmp_path):
    import shutil

    _, pp, _ = job
    d = tmp_path / "t"
    shutil.copytree(pp[0]["R3"]["trace_dir"], d)
    payload = sorted(d.glob("step000001/update.0/rank00001.native.r3b"))[0]
    data = bytearray(payload.read_bytes())
    data[-3] ^= 0xFF
    payload.write_bytes(bytes(data))
    r = _cli("inspect", str(d))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and str(payload) in r.stderr, r.stderr
    assert "checksum" in r.stderr
    payload.write_bytes(bytes(data[:40]))         # truncated
    r = _cli("inspect", str(d))
    assert r.returncode == 2 and str(payload) in r.stderr, r.stderr
    index = d / "index.rank00000.jsonl"
    index.write_text(index.read_text()[:-30])     # a torn last line
    r = _cli("diff", str(d))
    assert r.returncode == 2 and str(index) in r.stderr and "line" in r.stderr, r.stderr


# ------------------------------------------------------------------- disk budget and trace_every
def _budget(ctx, root: str, max_bytes: int, every: int) -> dict:
    from replay_grid import make_routes

    from r3bridge.config import Phase, ReplayConfig
    from r3bridge.megatron import MicroBatch, Replayer
    from r3bridge.session import PhaseRunner
    from r3bridge.testing.harness.data import make_packed_batch
    from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
    from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

    chunks = build_model_chunks(ModelSpec(**BASE, num_layers=2), ctx)
    fstep = make_forward_step(ctx, thd=True)
    b = make_packed_batch([9, 7], V, seed=3)
    cfg = ReplayConfig(replay_mode="R3", trace_dir=root, trace_max_bytes=max_bytes, trace_every=every)
    rep = Replayer.from_config(chunks, cfg)
    runner = PhaseRunner(rep, cfg)
    mb = MicroBatch(b.seq_lens, make_routes(rep.layout, b.seq_lens, E, K, 5), cu_seqlens_padded=b.cu_seqlens_padded)
    logged = []
    for _ in range(4):
        for phase in (Phase.OLD_LOG_PROB, Phase.UPDATE):
            with runner.run(phase, forward_only=phase is Phase.OLD_LOG_PROB, targets=[mb]) as ps:
                run_schedule(chunks, [b], fstep, forward_only=phase is Phase.OLD_LOG_PROB)
            logged.append(ps.result.tagged)
    rep.detach()
    return {"logged": logged}


def test_disk_budget_stops_tracing_and_says_so(tmp_path):
    from r3bridge.trace import load_trace

    big, small = tmp_path / "every2", tmp_path / "small"
    (a,), = spawn_layouts(_budget, world_size=1, layouts=[Layout()], args=(str(big), 1 << 30, 2), timeout=600)
    (b,), = spawn_layouts(_budget, world_size=1, layouts=[Layout()], args=(str(small), 2500, 1), timeout=600)
    t = load_trace(big)
    assert [(p.step, p.label) for p in t.passes] == [(1, "compute_log_prob.0"), (1, "update.0"),
                                                      (3, "compute_log_prob.0"), (3, "update.0")]
    assert not t.stops
    t = load_trace(small)
    written = sum(f.stat().st_size for f in Path(small).rglob("*.r3b"))
    assert t.passes and written <= 2500
    assert len(t.stops) == 1 and "trace_max_bytes=2500" in t.stops[0]["reason"]
    stopped_at = len(t.passes)
    assert stopped_at < 8
    logged = b["logged"]
    assert all("r3bridge/old_log_prob/trace/stopped" not in m and "r3bridge/update/trace/stopped" not in m
               for m in logged[:stopped_at])
    last = logged[-1]
    assert last["r3bridge/update/trace/stopped"] == 1.0
    assert last["r3bridge/update/trace/dropped_passes"] == 8 - stopped_at
    r = _cli("inspect", str(small))
    assert r.returncode == 0 and "stopped" in r.stdout and "trace_max_bytes=2500" in r.stdout

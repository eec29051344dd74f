"""``r3bridge.session.PhaseRunner``, the phase loop every adapter shares, tested on its own.

Real harness models (megatron-core GPT with MoE layers, identity attention so that packed THD
micro-batches run on CPU and every token's routing depends on that token alone), megatron's own
schedules, :class:`r3bridge.testing.harness.probe.RoutingProbe` for what each router dispatched. One rank
runs every single-chunk scenario in one spawn; one 2-rank spawn (PP2 x VPP2, forward-only) runs
the per-chunk install hooks under the interleaved schedule, the R2 gather across stages and a
micro-batch whose sequence count differs between the chunks. The rank functions return picklable
summaries (counts, flags, the phases' results); the tests below read them.
"""
from __future__ import annotations

import dataclasses
import traceback
from typing import Any, Callable

import pytest
import torch
from replay_grid import make_routes

from r3bridge.config import Action, Phase, PhasePlan, ReplayConfig
from r3bridge.metrics import tag_phase
from r3bridge.session.phase import PhaseResult, PhaseRunner, phase_tag
from r3bridge.testing.harness import dist
from r3bridge.testing.harness.data import PackedBatch, make_packed_batch
from r3bridge.testing.harness.models import ModelSpec, build_model_chunks
from r3bridge.testing.harness.probe import RoutingProbe
from r3bridge.testing.harness.schedule import make_forward_step, run_schedule

V, E, K = 128, 8, 2
BASE = dict(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=V, num_moe_experts=E,
            moe_router_topk=K, moe_aux_loss_coeff=0.0, attention="identity")
PREFIX = "r3bridge/"
# R2 samples by id: the recording packs them out of order, with a padding sequence between two
SAMPLE_LENS = {0: 5, 1: 8, 2: 6, 3: 7}
PAD_LEN = 4
RECORD_PACKING = [[3, 1], [0, None, 2]]         # both 15 tokens: PP without variable lengths needs equal ones


# ------------------------------------------------------------------------------------------ helpers
def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"ok": True, "value": fn()}
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return {"ok": False, "type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                "message": str(e), "trace": traceback.format_exc()[-3000:]}


def _hooks(chunks) -> int:
    """Forward (pre-)hooks on every module of the chunks: what a phase must leave as it found."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for c in chunks for m in c.modules())


def _pack(parts: list[PackedBatch]) -> PackedBatch:
    """Single-sequence batches packed into one micro-batch, in order: a sample keeps its tokens
    whichever micro-batch it lands in (R2 re-partitions between recording and update)."""
    def cu(lens: list[int]) -> torch.Tensor:
        out = torch.zeros(len(lens) + 1, dtype=torch.int32)
        out[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
        return out
    lens = [p.seq_lens[0] for p in parts]
    padded = [p.padded_lens[0] for p in parts]
    return PackedBatch(lens, padded, *(torch.cat([getattr(p, f) for p in parts])
                                       for f in ("input_ids", "labels", "loss_mask", "position_ids")),
                       cu(lens), cu(padded))


def _samples() -> tuple[dict[int, PackedBatch], PackedBatch]:
    return ({s: make_packed_batch([n], V, seed=100 + s) for s, n in SAMPLE_LENS.items()},
            make_packed_batch([PAD_LEN], V, seed=99))


def _by_chunk_and_mb(calls, layers_of_chunk: dict[int, list[int]], n_mb: int) -> dict[tuple[int, int], dict]:
    """Probe calls -> {(chunk, micro-batch): {layer: top-k [T, K]}}. Megatron's schedules run each
    chunk's forwards in micro-batch order and each forward calls the chunk's routers in layer
    order (forward-only, or training without recompute: one call per router)."""
    out: dict[tuple[int, int], dict] = {}
    for c, layers in layers_of_chunk.items():
        mine = [x for x in calls if x.chunk == c and not x.mtp]
        assert len(mine) == n_mb * len(layers), f"chunk {c}: {len(mine)} router calls for {n_mb} micro-batches"
        for k in range(n_mb):
            group = mine[k * len(layers):(k + 1) * len(layers)]
            assert [x.layer_id for x in group] == layers, f"chunk {c}, micro-batch {k}: {group}"
            out[(c, k)] = {x.layer_id: x.topk() for x in group}
    return out


def _route_rows(batch: PackedBatch, routes, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [T, K] ascending, has_route [T]) of one micro-batch on a rank without TP / CP
    (router row i is packed token i); ``routes`` covers the leading sequences only."""
    cu = batch.cu_seqlens_padded.tolist()
    col = routes.layer_ids.index(layer)
    want = torch.zeros((batch.total, routes.topk), dtype=torch.int64)
    has = torch.zeros(batch.total, dtype=torch.bool)
    for s in range(routes.num_seqs):
        r, v = routes.sequence(s)
        pos = cu[s] + routes.start_rows[s] + torch.arange(r.shape[0])
        want[pos[v]] = r[v][:, col].to(torch.int64).sort(dim=-1).values
        has[pos[v]] = True
    return want, has


def _check_rows(got: dict, batch: PackedBatch, routes, native: dict | None) -> dict[str, Any]:
    """Rows with a route must dispatch it; rows without one (last token, padding sequences) must
    dispatch what the model routes natively (``native``: the same micro-batch without replay)."""
    out = {"replayed": 0, "replayed_bad": 0, "native": 0, "native_bad": 0}
    for layer, topk in got.items():
        want, has = _route_rows(batch, routes, layer)
        out["replayed"] += int(has.sum())
        out["replayed_bad"] += int((topk[has] != want[has]).any(dim=-1).sum())
        if native is not None:
            out["native"] += int((~has).sum())
            out["native_bad"] += int((topk[~has] != native[layer][~has]).any(dim=-1).sum())
    return out


def _result(ps) -> dict[str, Any]:
    r = ps.result
    return {"phase": r.phase, "action": r.action, "metrics": r.metrics, "tagged": r.tagged, "plan": ps.plan,
            "result": r}


# ------------------------------------------------------------------------------------ one rank
class _OneRank:
    """One harness model with one Replayer; every scenario runs megatron's no-pipelining schedule."""

    def __init__(self, ctx) -> None:
        from r3bridge.megatron import Replayer

        assert ctx.world_size == 1
        self.chunks = build_model_chunks(ModelSpec(**BASE, num_layers=2), ctx)
        self.fstep = make_forward_step(ctx, thd=True)
        self.a = make_packed_batch([9, 6], V, seed=1)
        self.b = make_packed_batch([7, 5, 4], V, seed=2)
        self.pa = make_packed_batch([9, 6, PAD_LEN], V, seed=3)       # last sequence: padding
        self.pb = make_packed_batch([7, PAD_LEN], V, seed=4)          # last sequence: padding
        samples, pad = _samples()
        self.rec_batches = [_pack([samples[s] if s is not None else pad for s in ids]) for ids in RECORD_PACKING]
        self.upd_ids = [[0, 1], [2, 3, None]]
        self.upd_batches = [_pack([samples[s] if s is not None else pad for s in ids]) for ids in self.upd_ids]
        self.all = [self.a, self.b, self.pa, self.pb, *self.rec_batches, *self.upd_batches]
        self.native = self.routing(self.all)          # before any r3bridge object touches the routers
        self.cfg = {m: ReplayConfig(replay_mode=m) for m in ("off", "R2", "R3")}
        self.rep = Replayer.from_config(self.chunks, self.cfg["R3"])
        self.layers = self.rep.layer_ids
        lay = self.rep.layout
        self.routes = {id(b): make_routes(lay, b.seq_lens, E, K, 40 + i) for i, b in enumerate(self.all)}
        # padding batches: routes for the real (leading) sequences only
        self.routes[id(self.pa)] = make_routes(lay, [9, 6], E, K, 50)
        self.routes[id(self.pb)] = make_routes(lay, [7], E, K, 51)

    def native_of(self, batch) -> dict:
        return self.native[next(i for i, b in enumerate(self.all) if b is batch)]

    def routing(self, batches, *, forward_only: bool = True) -> list[dict]:
        with RoutingProbe(self.chunks) as p:
            run_schedule(self.chunks, batches, self.fstep, forward_only=forward_only)
        got = _by_chunk_and_mb(p.calls, {0: [r.layer_id for r in p.routers]}, len(batches))
        return [got[(0, k)] for k in range(len(batches))]

    def mb(self, batch, *, sample_ids=None, routes: bool = True):
        from r3bridge.megatron import MicroBatch

        return MicroBatch(batch.seq_lens, self.routes[id(batch)] if routes else None, sample_ids,
                          cu_seqlens_padded=batch.cu_seqlens_padded)

    def run(self, runner, phase, batches, *, forward_only: bool, step=None, **kw) -> dict[str, Any]:
        """``runner.run`` around one schedule under a probe: hooks before / inside / after, and
        the dispatched top-k per micro-batch. ``step(phase_step)``: the schedule's forward_step
        (an adapter that installs itself), else the harness's."""
        active = []
        with RoutingProbe(self.chunks) as probe:
            h0 = _hooks(self.chunks)
            with runner.run(phase, forward_only=forward_only, **kw) as ps:
                h_in = _hooks(self.chunks)
                active.append(self.rep.active_pass is not None)
                forward_step = self.fstep if step is None else step(ps)
                run_schedule(self.chunks, batches, forward_step, forward_only=forward_only)
            h_out = _hooks(self.chunks)
        got = _by_chunk_and_mb(probe.calls, {0: self.layers}, len(batches))
        return {"ps": ps, "hooks": (h0, h_in, h_out), "active": active[0],
                "got": [got[(0, k)] for k in range(len(batches))]}

    # -------------------------------------------------------------------------- scenarios
    def native_phases(self) -> dict[str, Any]:
        """Replay off, the reference model, and no replayer: nothing may be installed."""
        cases = {"off": (PhaseRunner(self.rep, self.cfg["off"]), Phase.UPDATE),
                 "reference": (PhaseRunner(self.rep, self.cfg["R3"]), Phase.REF_LOG_PROB),
                 "no_replayer": (PhaseRunner(None, self.cfg["R3"]), Phase.OLD_LOG_PROB)}
        out = {}
        batches = [self.a, self.b]
        for name, (runner, phase) in cases.items():
            installs: list[tuple[int, int]] = []

            def targets(c, k, args, kwargs, installs=installs):
                installs.append((c, k))
                return self.mb(batches[k])
            unmanaged = self.rep.unmanaged_calls
            r = self.run(runner, phase, batches, forward_only=True, targets=targets, num_micro_batches=2)
            out[name] = {"yielded": type(r["ps"]).__name__, "plan": runner.plan(phase), "installs": installs,
                         "hooks": r["hooks"], "active": r["active"], "unmanaged": self.rep.unmanaged_calls - unmanaged,
                         "same_as_native": all(torch.equal(g[lid], self.native_of(b)[lid])
                                               for g, b in zip(r["got"], batches) for lid in self.layers)}
        return out

    def replay(self, how: str) -> dict[str, Any]:
        """R3 replay with the targets as a list (update), a callable (compute_log_prob) or
        installed by the adapter's own forward_step (update, forward-only)."""
        runner = PhaseRunner(self.rep, self.cfg["R3"])
        batches = [self.a, self.b]
        mbs = [self.mb(b) for b in batches]
        calls: list[tuple[int, int, str]] = []
        if how == "list":
            r = self.run(runner, Phase.UPDATE, batches, forward_only=False, targets=mbs)
        elif how == "callable":
            def targets(c, k, args, kwargs):
                calls.append((c, k, type(kwargs.get("packed_seq_params")).__name__))
                return mbs[k]
            r = self.run(runner, Phase.OLD_LOG_PROB, batches, forward_only=True, targets=targets,
                         num_micro_batches=len(mbs))
        else:
            def adapter_step(ps):
                def forward_step(it, model):
                    batch = next(it)
                    k = next(i for i, b in enumerate(batches) if b is batch)
                    calls.append((0, k, "install"))
                    ps.install(model, mbs[k])
                    return self.fstep(iter([batch]), model)
                return forward_step
            r = self.run(runner, Phase.UPDATE, batches, forward_only=True, step=adapter_step)
        rows = [_check_rows(g, b, self.routes[id(b)], self.native_of(b)) for g, b in zip(r["got"], batches)]
        return {**_result(r["ps"]), "rows": rows, "calls": calls, "hooks": r["hooks"], "active": r["active"]}

    def padding(self) -> dict[str, Any]:
        """Padding sequences (sample id None) after the real ones: routed natively, no route needed."""
        runner = PhaseRunner(self.rep, self.cfg["R3"])
        batches = [self.pa, self.pb]
        mbs = [self.mb(self.pa, sample_ids=[0, 1, None]), self.mb(self.pb, sample_ids=[2, None])]
        r = self.run(runner, Phase.OLD_LOG_PROB, batches, forward_only=True, targets=mbs)
        rows = [_check_rows(g, b, self.routes[id(b)], self.native_of(b)) for g, b in zip(r["got"], batches)]
        return {**_result(r["ps"]), "rows": rows}

    def errors(self) -> dict[str, Any]:
        """Each bad input raises from inside the schedule; the phase then leaves no hook and no step."""
        from r3bridge.megatron import MicroBatch

        r3 = PhaseRunner(self.rep, self.cfg["R3"])
        r2 = PhaseRunner(self.rep, self.cfg["R2"])
        a, pa = self.a, self.pa
        lay = self.rep.layout

        def fail_at_second(ps):
            seen = []

            def forward_step(it, model):
                seen.append(1)
                if len(seen) == 2:
                    raise RuntimeError("data loader failed")
                return self.fstep(it, model)
            return forward_step
        cases = {
            # micro-batch 1: three sequences, ids [2, 3, None], routes for one: sample 3 has none
            "uncovered_sample": (r3, Phase.OLD_LOG_PROB, [a, pa], dict(targets=[
                self.mb(a, sample_ids=[0, 1]),
                MicroBatch(pa.seq_lens, make_routes(lay, [9], E, K, 52), [2, 3, None],
                           cu_seqlens_padded=pa.cu_seqlens_padded)])),
            "more_routes_than_sequences": (r3, Phase.OLD_LOG_PROB, [a], dict(targets=[
                MicroBatch(a.seq_lens, make_routes(lay, [9, 6, 5], E, K, 53), cu_seqlens_padded=a.cu_seqlens_padded)])),
            "negative_sample_id": (r2, Phase.OLD_LOG_PROB, [a], dict(targets=[
                self.mb(a, sample_ids=[0, -1], routes=False)])),
            "wrong_sample_id_count": (r2, Phase.OLD_LOG_PROB, [a], dict(targets=[
                self.mb(a, sample_ids=[0], routes=False)])),
            "replay_without_routes": (r3, Phase.UPDATE, [a], dict(targets=[self.mb(a, routes=False)])),
            "more_forwards_than_micro_batches": (r3, Phase.OLD_LOG_PROB, [a, self.b], dict(
                targets=lambda c, k, args, kwargs: self.mb([a, self.b][k]), num_micro_batches=1)),
            "schedule_raises": (r3, Phase.OLD_LOG_PROB, [a, self.b], dict(
                targets=[self.mb(a), self.mb(self.b)])),
            "targets_list_shorter_than_schedule": (r3, Phase.OLD_LOG_PROB, [a, self.b], dict(targets=[self.mb(a)])),
            # the plan's source reaches the driver: R2 never replays the rollout engine's routes
            "r2_update_with_rollout_routes": (r2, Phase.UPDATE, [a], dict(targets=[self.mb(a)])),
        }
        out = {}
        for name, (runner, phase, batches, kw) in cases.items():
            h0 = _hooks(self.chunks)
            step = fail_at_second if name == "schedule_raises" else None
            o = _outcome(lambda r=runner, p=phase, b=batches, s=step, kw=kw: self.run(r, p, b, forward_only=True,
                                                                                      step=s, **kw))
            o.pop("value", None)
            o["hooks_left"] = _hooks(self.chunks) - h0
            o["step_left"] = self.rep.active_pass is not None
            out[name] = o
        return out

    def record_then_replay(self) -> dict[str, Any]:
        """R2: record micro-batches holding samples out of order and a padding sequence, then
        replay the recording in an update re-partitioned by sample id."""
        from r3bridge.megatron import MicroBatch

        r2 = PhaseRunner(self.rep, self.cfg["R2"])
        mbs = [MicroBatch(b.seq_lens, sample_ids=ids) for b, ids in zip(self.rec_batches, RECORD_PACKING)]
        r = self.run(r2, Phase.OLD_LOG_PROB, self.rec_batches, forward_only=True, targets=mbs)
        rec = r["ps"].result.recorded
        checked = _recorded_vs_dispatched(rec, r["got"], self.rec_batches, RECORD_PACKING, self.layers)
        upd = [MicroBatch(b.seq_lens, rec.select([s for s in ids if s is not None]), ids)
               for b, ids in zip(self.upd_batches, self.upd_ids)]
        for m, b in zip(upd, self.upd_batches):
            self.routes[id(b)] = m.routes
        u = self.run(r2, Phase.UPDATE, self.upd_batches, forward_only=False, targets=upd)
        rows = [_check_rows(g, b, self.routes[id(b)], self.native_of(b)) for g, b in zip(u["got"], self.upd_batches)]
        # no sample ids: sequences numbered in install order across the micro-batches
        plain = [self.a, self.b]
        d = self.run(r2, Phase.OLD_LOG_PROB, plain, forward_only=True,
                     targets=[self.mb(b, routes=False) for b in plain])
        default = _recorded_vs_dispatched(d["ps"].result.recorded, d["got"], plain, [[0, 1], [2, 3, 4]], self.layers)
        return {"record": {**_result(r["ps"]), **checked}, "update": {**_result(u["ps"]), "rows": rows},
                "default_ids": default}

    def install_before_forward(self) -> dict[str, Any]:
        """The pre-hook directly: prepended before a hook already there, counts per chunk,
        removed after the context, also when the schedule raises inside it."""
        from r3bridge.session import install_before_forward

        model = self.chunks[0]
        order: list[Any] = []
        h = model.register_forward_pre_hook(lambda m, args: order.append("existing"))
        h0 = _hooks(self.chunks)
        try:
            with install_before_forward(self.chunks, lambda c, k, a, kw: lambda m: order.append((c, k))) as counts:
                inside = _hooks(self.chunks)
                run_schedule(self.chunks, [self.a, self.b], self.fstep, forward_only=True)
            after, seen = _hooks(self.chunks), list(order)

            def raising():
                with install_before_forward(self.chunks, lambda c, k, a, kw: lambda m: None, 2):
                    run_schedule(self.chunks, [self.a, self.b, self.a], self.fstep, forward_only=True)
            raised = _outcome(raising)
            after_raise = _hooks(self.chunks)
        finally:
            h.remove()
        return {"order": seen, "counts": list(counts), "hooks": (h0, inside, after, after_raise),
                "raised": {k: v for k, v in raised.items() if k != "value"}}


def _recorded_vs_dispatched(rec, got, batches, packing, layers) -> dict[str, Any]:
    """Per sample id: do the recorded rows equal what the routers dispatched for that sample?"""
    out = {"num_seqs": rec.num_seqs, "rows_per_seq": list(rec.rows_per_seq), "route_kind": rec.route_kind,
           "all_valid": bool(rec.valid.all()), "bad": []}
    for k, ids in enumerate(packing):
        cu = batches[k].cu_seqlens_padded.tolist()
        for j, s in enumerate(ids):
            if s is None or s >= rec.num_seqs:
                continue
            r, _ = rec.sequence(s)
            for lid in layers:
                want = got[k][lid][cu[j]:cu[j + 1]]
                mine = r[:, rec.layer_ids.index(lid)].to(torch.int64).sort(dim=-1).values
                if mine.shape != want.shape or not torch.equal(mine, want):
                    out["bad"].append((s, lid))
    return out


def one_rank(ctx) -> dict[str, Any]:
    s = _OneRank(ctx)
    out = {"layers": s.layers}
    out["native"] = _outcome(s.native_phases)
    for how in ("list", "callable", "adapter"):
        out[f"replay_{how}"] = _outcome(lambda how=how: s.replay(how))
    out["padding"] = _outcome(s.padding)
    out["errors"] = _outcome(s.errors)
    out["r2"] = _outcome(s.record_then_replay)       # after the errors: nothing stale survives them
    out["install_before_forward"] = _outcome(s.install_before_forward)
    return out


# --------------------------------------------------------------------------- PP2 x VPP2, two ranks
def pp_ranks(ctx) -> dict[str, Any]:
    """Forward-only under the interleaved schedule (4 micro-batches, so the two chunks of a rank
    alternate in groups of 2): installs per (chunk, micro-batch) from the pre-hooks."""
    from r3bridge.megatron import MicroBatch, Replayer

    chunks = build_model_chunks(ModelSpec(**BASE, num_layers=4), ctx)
    fstep = make_forward_step(ctx, thd=True)
    cfg = {m: ReplayConfig(replay_mode=m) for m in ("R2", "R3")}
    rep = Replayer.from_config(chunks, cfg["R3"])
    layers_of = {i: sorted(c.routers) for i, c in enumerate(rep.chunks)}
    batches = [make_packed_batch(lens, V, seed=20 + i) for i, lens in enumerate([[9, 7], [6, 10], [12, 4], [5, 11]])]
    routes = [make_routes(rep.layout, b.seq_lens, E, K, 60 + i) for i, b in enumerate(batches)]
    mbs = [MicroBatch(b.seq_lens, r, cu_seqlens_padded=b.cu_seqlens_padded) for b, r in zip(batches, routes)]
    out: dict[str, Any] = {"layers_of": layers_of}

    def replay():
        order: list[tuple[int, int]] = []

        def targets(c, k, args, kwargs):
            order.append((c, k))
            return mbs[k]
        with RoutingProbe(chunks) as probe:
            h0 = _hooks(chunks)
            with PhaseRunner(rep, cfg["R3"]).run(Phase.OLD_LOG_PROB, forward_only=True, targets=targets,
                                                 num_micro_batches=len(mbs)) as ps:
                run_schedule(chunks, batches, fstep, forward_only=True)
            h1 = _hooks(chunks)
        got = _by_chunk_and_mb(probe.calls, layers_of, len(batches))
        rows = {f"{c},{k}": _check_rows(got[(c, k)], batches[k], routes[k], None) for (c, k) in got}
        return {**_result(ps), "order": order, "rows": rows, "hooks": (h0, h1)}

    def record():
        samples, pad = _samples()
        rec_batches = [_pack([samples[s] if s is not None else pad for s in ids]) for ids in RECORD_PACKING]
        targets = [MicroBatch(b.seq_lens, sample_ids=ids) for b, ids in zip(rec_batches, RECORD_PACKING)]
        with RoutingProbe(chunks) as probe:
            with PhaseRunner(rep, cfg["R2"]).run(Phase.OLD_LOG_PROB, forward_only=True, targets=targets) as ps:
                run_schedule(chunks, rec_batches, fstep, forward_only=True)
        got = _by_chunk_and_mb(probe.calls, layers_of, len(rec_batches))
        per_mb = [{lid: t for c in layers_of for lid, t in got[(c, k)].items()} for k in range(len(rec_batches))]
        mine = [lid for c in layers_of for lid in layers_of[c]]
        rec = ps.result.recorded
        return {**_recorded_vs_dispatched(rec, per_mb, rec_batches, RECORD_PACKING, mine),
                "layer_ids": list(rec.layer_ids)}

    def changed_count():
        """Chunk 1 installs micro-batch 0 with another sequence count than chunk 0 did."""
        h0 = _hooks(chunks)
        other = make_packed_batch([9, 4, 3], V, seed=30)

        def go():
            with PhaseRunner(rep, cfg["R3"]).run(Phase.OLD_LOG_PROB, forward_only=True) as ps:
                ps.install(chunks[0], mbs[0], index=0)
                ps.install(chunks[1], MicroBatch(other.seq_lens, make_routes(rep.layout, other.seq_lens, E, K, 70),
                                                 cu_seqlens_padded=other.cu_seqlens_padded), index=0)
        o = _outcome(go)
        o["hooks_left"] = _hooks(chunks) - h0
        o["step_left"] = rep.active_pass is not None
        return o

    def changed_ids():
        """Chunk 1 installs micro-batch 0 with the same count but other sample ids than chunk 0."""
        h0 = _hooks(chunks)

        def go():
            with PhaseRunner(rep, cfg["R3"]).run(Phase.OLD_LOG_PROB, forward_only=True) as ps:
                ps.install(chunks[0], dataclasses.replace(mbs[0], sample_ids=[0, 1]), index=0)
                ps.install(chunks[1], dataclasses.replace(mbs[0], sample_ids=[1, 0]), index=0)
        o = _outcome(go)
        o["hooks_left"] = _hooks(chunks) - h0
        o["step_left"] = rep.active_pass is not None
        return o

    out["replay"] = _outcome(replay)
    out["record"] = _outcome(record)
    out["changed_count"] = changed_count()
    out["changed_ids"] = changed_ids()
    return out


# ------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def one():
    return dist.spawn(one_rank, world_size=1, timeout=600)[0]


@pytest.fixture(scope="module")
def pp():
    return dist.spawn(pp_ranks, world_size=2, pp=2, vpp=2, timeout=600)


def _value(o):
    assert o["ok"], o.get("trace")
    return o["value"]


def _raised(o, error: str, *words: str) -> None:
    assert not o["ok"], f"expected {error}, nothing was raised"
    assert error in o["mro"], o["trace"]
    for w in words:
        assert w in o["message"], o["message"]


def _all_replayed(rows) -> None:
    for r in rows:
        assert r["replayed"] > 0 and r["replayed_bad"] == 0, rows


def _tagged_as(res, tag: str) -> None:
    assert res["tagged"] == tag_phase(res["metrics"], PREFIX, tag)
    assert res["tagged"] and all(k.startswith(f"{PREFIX}{tag}/") for k in res["tagged"]), res["tagged"]
    assert res["tagged"][f"{PREFIX}{tag}/agreement/pairs_compared"] > 0


def test_phase_tag():
    assert phase_tag(Phase.UPDATE) == "update" and phase_tag("update") == "update"
    assert phase_tag(Phase.OLD_LOG_PROB) == "old_log_prob" and phase_tag("compute_log_prob") == "old_log_prob"
    assert phase_tag(Phase.REF_LOG_PROB) == "ref_log_prob"


@pytest.mark.parametrize("name", ["off", "reference", "no_replayer"])
def test_native_phase_installs_nothing_and_routes_as_without_runner(one, name):
    r = _value(one["native"])[name]
    assert r["yielded"] == "NoneType" and r["plan"] is None
    assert r["installs"] == [], "a native phase called the targets"
    assert not r["active"], "a native phase opened a replay step"
    h0, h_in, h_out = r["hooks"]
    assert h_in == h0 and h_out == h0, f"hooks before / inside / after: {r['hooks']}"
    assert r["same_as_native"], "routing differs from the model's run without r3bridge"
    assert r["unmanaged"] == 2 * len(one["layers"])        # every router call went through no step


def test_replay_targets_list_dispatches_routes_and_tags_update(one):
    r = _value(one["replay_list"])
    assert r["action"] is Action.REPLAY and r["plan"] == PhasePlan(Action.REPLAY, "rollout")
    assert r["active"]
    h0, h_in, h_out = r["hooks"]
    assert h_in > h0 and h_out == h0
    _all_replayed(r["rows"])
    for x in r["rows"]:                                    # each sequence's last token has no route
        assert x["native"] > 0 and x["native_bad"] == 0
    _tagged_as(r, "update")
    assert r["tagged"][f"{PREFIX}update/coverage"] < 1.0
    assert r["result"].recorded is None


def test_replay_callable_targets_get_each_chunk_forward(one):
    r = _value(one["replay_callable"])
    _all_replayed(r["rows"])
    assert r["calls"] == [(0, 0, "PackedSeqParams"), (0, 1, "PackedSeqParams")]
    _tagged_as(r, "old_log_prob")


def test_replay_installed_by_the_adapter(one):
    r = _value(one["replay_adapter"])
    _all_replayed(r["rows"])
    assert [c[:2] for c in r["calls"]] == [(0, 0), (0, 1)]
    assert r["hooks"][2] == r["hooks"][0]
    _tagged_as(r, "update")


def test_padding_sequences_route_natively_without_routes(one):
    r = _value(one["padding"])
    _all_replayed(r["rows"])
    nlayers = len(one["layers"])
    # not replayed: the padding sequence and the last token of each real sequence
    assert [x["native"] for x in r["rows"]] == [nlayers * (PAD_LEN + 2), nlayers * (PAD_LEN + 1)]
    assert all(x["native_bad"] == 0 for x in r["rows"]), r["rows"]
    # the driver's counts are over the samples' tokens, as a route trace counts them (`r3bridge inspect`):
    # the padding sequences are routed natively but are no sample's tokens (issue 50, AReaL's page padding)
    assert r["metrics"][f"{PREFIX}native_pairs"] == nlayers * 3


@pytest.mark.parametrize("name, error, words", [
    ("uncovered_sample", "CoverageError", ("chunk 0, micro-batch 1", "routes for 1 sequences")),
    ("more_routes_than_sequences", "CoverageError", ("chunk 0, micro-batch 0", "routes for 3 sequences")),
    ("negative_sample_id", "CoverageError", ("micro-batch 0", "negative sample id")),
    ("wrong_sample_id_count", "CoverageError", ("micro-batch 0", "1 sample ids for 2 sequences")),
    ("replay_without_routes", "ReplayStateError", ("chunk 0, micro-batch 0", "R3 replay without routes")),
    ("more_forwards_than_micro_batches", "ReplayStateError", ("chunk 0", "forward #2", "only 1 micro-batches")),
    ("schedule_raises", "RuntimeError", ("data loader failed",)),
    ("targets_list_shorter_than_schedule", "ReplayStateError", ("chunk 0", "forward #2", "only 1 micro-batches")),
    ("r2_update_with_rollout_routes", "ConfigError", ("R2 update must replay the routes recorded",)),
])
def test_bad_input_raises_and_leaves_nothing(one, name, error, words):
    o = _value(one["errors"])[name]
    _raised(o, error, *words)
    if error != "RuntimeError":
        assert "ReplayError" in o["mro"]
    assert o["hooks_left"] == 0, "a hook survived the failed phase"
    assert not o["step_left"]


def test_r2_records_real_samples_in_sample_id_order(one):
    r = _value(one["r2"])["record"]
    assert r["action"] is Action.RECORD and r["tagged"] == {}
    assert r["num_seqs"] == len(SAMPLE_LENS), "padding sequences must not be recorded"
    assert r["rows_per_seq"] == [SAMPLE_LENS[s] for s in sorted(SAMPLE_LENS)]
    assert r["route_kind"] == "recorded" and r["all_valid"]
    assert r["bad"] == [], "recorded rows differ from what the routers dispatched for that sample"


def test_r2_without_sample_ids_records_in_install_order(one):
    r = _value(one["r2"])["default_ids"]
    assert r["num_seqs"] == 5 and r["rows_per_seq"] == [9, 6, 7, 5, 4]
    assert r["all_valid"] and r["bad"] == []


def test_r2_update_replays_the_recording_with_agreement_one(one):
    u = _value(one["r2"])["update"]
    assert u["plan"] == PhasePlan(Action.REPLAY, "recorded")
    _all_replayed(u["rows"])
    assert all(x["native_bad"] == 0 for x in u["rows"])
    assert [x["native"] for x in u["rows"]] == [0, len(one["layers"]) * PAD_LEN]
    assert u["tagged"][f"{PREFIX}update/agreement/mean"] == 1.0
    assert u["metrics"][f"{PREFIX}native_pairs"] == 0 and u["metrics"][f"{PREFIX}coverage"] == 1.0   # samples' tokens


def test_install_before_forward_prepends_counts_and_cleans_up(one):
    r = _value(one["install_before_forward"])
    assert r["order"] == [(0, 0), "existing", (0, 1), "existing"], "install must run before the hooks already there"
    assert r["counts"] == [2]
    h0, inside, after, after_raise = r["hooks"]
    assert inside == h0 + 1 and after == h0 and after_raise == h0
    _raised(r["raised"], "ReplayStateError", "forward #3", "only 2 micro-batches")


def _results(one, tag: str) -> PhaseResult:
    return _value(one["replay_callable" if tag == "old_log_prob" else "replay_list"])["result"]


def test_metrics_carried_from_log_prob_to_the_next_update(one):
    lp, upd = _results(one, "old_log_prob"), _results(one, "update")
    assert lp.phase is Phase.OLD_LOG_PROB and upd.phase is Phase.UPDATE
    runner = PhaseRunner(None, ReplayConfig(replay_mode="R3"), carry_log_prob_metrics=True)
    assert runner.metrics_to_log(lp) == {}
    assert runner.metrics_to_log(lp) == {}
    out = runner.metrics_to_log(upd, extra={"x": 1.0})
    want = {**{k: [v, v] for k, v in lp.tagged.items()}, **{k: [v] for k, v in upd.tagged.items()}, "x": [1.0]}
    assert out == want
    assert runner.metrics_to_log(upd) == {k: [v] for k, v in upd.tagged.items()}, "held metrics logged twice"


def test_metrics_without_carry_come_out_at_once(one):
    lp, upd = _results(one, "old_log_prob"), _results(one, "update")
    runner = PhaseRunner(None, ReplayConfig(replay_mode="R3"))
    assert runner.metrics_to_log(lp) == {k: [v] for k, v in lp.tagged.items()}
    assert runner.metrics_to_log(upd) == {k: [v] for k, v in upd.tagged.items()}
    assert runner.metrics_to_log(None) == {}
    assert runner.metrics_to_log(None, {"x": 1.0}) == {"x": [1.0]}      # a native pass's own extras


def test_interleaved_schedule_installs_each_chunk_in_micro_batch_order(pp):
    for rank, out in enumerate(pp):
        r = _value(out["replay"])
        order = r["order"]
        for c in (0, 1):
            assert [k for cc, k in order if cc == c] == [0, 1, 2, 3], f"rank {rank}: {order}"
        assert order[:4] != [(0, 0), (0, 1), (0, 2), (0, 3)], f"rank {rank}: chunks did not alternate: {order}"
        assert len(r["rows"]) == 8
        _all_replayed(r["rows"].values())
        assert r["hooks"][1] == r["hooks"][0]
        _tagged_as(r, "old_log_prob")
        assert r["tagged"][f"{PREFIX}old_log_prob/agreement/pairs_compared"] > 0


def test_interleaved_r2_recording_gathers_samples_in_order(pp):
    mine = set()
    for out in pp:
        r = _value(out["record"])
        assert r["layer_ids"] == [0, 1, 2, 3]
        assert r["num_seqs"] == len(SAMPLE_LENS) and r["rows_per_seq"] == [SAMPLE_LENS[s] for s in sorted(SAMPLE_LENS)]
        assert r["bad"] == []
        mine |= {lid for ls in out["layers_of"].values() for lid in ls}
    assert mine == {0, 1, 2, 3}


def test_chunk_installing_another_sequence_count_is_refused(pp):
    for out in pp:
        o = out["changed_count"]
        _raised(o, "ReplayStateError", "chunk 1, micro-batch 0", "3 sequences", "another chunk installed 2")
        assert o["hooks_left"] == 0 and not o["step_left"]


def test_chunk_installing_other_sample_ids_is_refused(pp):
    for out in pp:
        o = out["changed_ids"]
        _raised(o, "ReplayStateError", "chunk 1, micro-batch 0", "sample ids [1, 0]", "another chunk installed [0, 1]")
        assert o["hooks_left"] == 0 and not o["step_left"]

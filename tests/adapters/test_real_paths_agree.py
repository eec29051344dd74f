"""One canonical rollout through verl's, SkyRL's and AReaL's real training paths: the same routes
at every router call (docs/testing-harness.md, "Same rollout, three real frameworks").

Layouts: TP2 + sequence parallelism, and PP2 x VPP2 (interleaved 1F1B, one layer per chunk), on 2
gloo ranks, full recompute, R3, one step (compute_log_prob and one update) per framework and layout.
Each framework runs both layouts in its own spawned process group (``spawn_layouts``), one framework
after another (rank functions: ``testlab.real_paths``, shared with scripts/gpu/cross_framework.py):

* verl 0.9.1: ``TrainingWorker.infer_batch`` / ``train_mini_batch`` on verl's Megatron engine
  (mbridge-built tiny Qwen3-MoE), routes in verl's padded ``routed_experts`` through its
  ``left_right_2_no_padding``, dynamic-bsz THD micro-batches (``testlab.verl_job``);
  later pipeline stages see verl's nested micro-batch, read in the same order;
* SkyRL 0.3.0: ``MegatronModelWrapper.forward`` / ``forward_backward_mini_batch``, SkyRL's
  ``TrainingInputBatch`` with left-padding removal (BSHD) under TP2, SkyRL's THD packing (identity
  attention, alltoall, ``variable_seq_lengths``, as ``test_skyrl_real.py`` trains it) under PP,
  the update re-ordered (``testlab.skyrl_real``);
* AReaL 1.0.4: ``MegatronPPOActor.compute_logp`` / ``ppo_update``, routes from SGLang ``meta_info``
  through AReaL's ``SGLangBackend`` (``testlab.areal_runner``).

Each runner maps every router row back to (sample, token) with the packing its framework really
used, per chunk, and logs the dispatched top-k; the parent merges the ranks (under PP each stage
logs the layers it holds) and compares (``testlab.dispatch_records``).
SkyRL also runs a second step on the rollout with one route changed: its records must differ from
the other two at exactly that (sample, token, layer), in every pass.
"""
from __future__ import annotations

import importlib.util

import pytest

from r3bridge.testing.harness.dist import Layout, spawn_layouts
from testlab.dispatch_records import DispatchRecords, compare_dispatch, with_route_changed
from testlab.real_paths import rollout as _rollout
from testlab.real_paths import run_areal, run_skyrl, run_verl

for _mod in ("verl", "skyrl", "areal"):         # installed by `make install`: never skipped
    assert importlib.util.find_spec(_mod) is not None, f"{_mod} is not installed: run `make install`"

CHANGED = (3, 4, 2)                    # (sample, token, layer) whose route the second SkyRL step changes
PASSES = [(0, 0, 0), (0, 1, 0), (0, 1, 1)]   # (step, phase, grad): compute_log_prob, update + recompute
# the two layouts, each framework running both in one set of 2 processes (spawn_layouts)
LAYOUTS = {"tp2_sp": Layout(tp=2), "pp2_vpp2": Layout(pp=2, vpp=2)}
NAMES = list(LAYOUTS)


def _areal(ctx, workdir, rollout):
    return run_areal(ctx, f"{workdir}/{NAMES[ctx.layout_index]}", rollout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{layout: {framework: per-rank results}}: each framework spawned on its own 2 ranks in turn,
    running both layouts in that one set of processes."""
    from testlab.verl_job import write_tiny_qwen3_moe

    rollout = _rollout()
    changed = with_route_changed(rollout, *CHANGED)
    model_dir = write_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny_qwen3_moe")))
    per_fw = {
        "verl": spawn_layouts(run_verl, world_size=2, layouts=list(LAYOUTS.values()), args=(model_dir, rollout),
                              timeout=900),
        # etp = tp under TP2: megatron's default (test_skyrl_real.py)
        "skyrl": spawn_layouts(run_skyrl, world_size=2, layouts=[Layout(tp=2, etp=2), LAYOUTS["pp2_vpp2"]],
                               args=([rollout, changed],), timeout=900),
        "areal": spawn_layouts(_areal, world_size=2, layouts=list(LAYOUTS.values()),
                               args=(str(tmp_path_factory.mktemp("areal")), rollout), timeout=900),
    }
    return rollout, {name: {fw: res[i] for fw, res in per_fw.items()} for i, name in enumerate(NAMES)}


def _merged(per_rank) -> DispatchRecords:
    return DispatchRecords.merge([r["dispatch"] for r in per_rank])


@pytest.mark.slow
@pytest.mark.parametrize("layout", NAMES)
def test_each_runner_checked_its_router_calls(runs, layout):
    _, out = runs
    for name, per_rank in out[layout].items():
        for rank, r in enumerate(per_rank):
            assert r["errors"] == [], (name, rank, r["errors"][:5])
            assert r["checked"] > 0, (name, rank)


@pytest.mark.slow
def test_pipeline_passes_reach_a_steady_state(runs):
    """Under PP2 x VPP2 each framework split both passes into at least 2 * pp = 4 micro-batches: with
    2 chunks per stage the interleaved schedule's warm-up is 4 chunk forwards on stage 0, so the update
    also ran 1F1B steady-state steps (each chunk's router calls in micro-batch order)."""
    _, out = runs
    for name, per_rank in out["pp2_vpp2"].items():
        for rank, r in enumerate(per_rank):
            assert len(r["micro_batches"]) == 2 and min(r["micro_batches"]) >= 4, (name, rank, r["micro_batches"])


@pytest.mark.slow
def test_pipeline_stages_route_their_own_layers(runs):
    """PP2 x VPP2 (4 layers, 1 per chunk): stage 0 holds layers 0 and 2, stage 1 layers 1 and 3, so
    stage 0 logs MoE layer 2 only, stage 1 layers 1 and 3; the merged records hold all three."""
    rollout, out = runs
    for name, per_rank in out["pp2_vpp2"].items():
        layers = [sorted(set(r["dispatch"].keys[:, 5].tolist())) for r in per_rank]
        assert layers == [[2], [1, 3]], (name, layers)


@pytest.mark.slow
@pytest.mark.parametrize("layout", NAMES)
def test_three_frameworks_dispatch_identical_routes(runs, layout):
    rollout, out = runs
    recs = {name: _merged(per_rank).where(step=0) for name, per_rank in out[layout].items()}
    res = compare_dispatch(recs, rollout.expected(), [len(t) for t in rollout.tokens])
    assert res.errors == [], res.errors
    # every token of every sample on every MoE layer, in each of the three passes
    tokens = sum(len(t) for t in rollout.tokens)
    assert res.keys == {name: 3 * tokens * len(rollout.moe_layer_ids) for name in recs}, res.keys
    for name, r in recs.items():
        assert sorted({tuple(k[:3]) for k in r.keys.tolist()}) == PASSES, name
    # every routed (sample, token, layer), in each pass
    expected = rollout.expected()
    assert res.compared == 3 * int(expected.valid.sum()) * len(rollout.moe_layer_ids)


@pytest.mark.slow
@pytest.mark.parametrize("layout", NAMES)
def test_a_changed_route_is_named(runs, layout):
    """SkyRL's second step replayed the rollout with one route changed: the comparison names that
    (sample, token, layer) in each pass, and nothing else."""
    rollout, out = runs
    skyrl = _merged(out[layout]["skyrl"])
    recs = {"verl": _merged(out[layout]["verl"]), "skyrl": skyrl.where(step=1).relabel(step=0),
            "areal": _merged(out[layout]["areal"])}
    res = compare_dispatch(recs, rollout.expected(), [len(t) for t in rollout.tokens])
    s, t, layer = CHANGED
    want = sorted(int(x) for x in rollout.calls[s][0][t, layer])
    new = sorted(int(x) for x in with_route_changed(rollout, *CHANGED).calls[s][0][t, layer])
    assert new != want
    # verl and AReaL dispatched the rollout's route, SkyRL the changed one
    assert res.errors == [f"step 0 {phase} sample {s} token {t} layer {layer}: verl {want}, skyrl {new}, "
                          f"areal {want}, rollout {want}"
                          for phase in ("compute_log_prob grad=False", "update grad=False", "update grad=True")]


@pytest.mark.slow
def test_a_token_missing_from_one_framework_is_named(runs):
    rollout, out = runs
    recs = {name: _merged(per_rank).where(step=0) for name, per_rank in out["tp2_sp"].items()}
    a = recs["areal"]
    drop = (a.keys[:, 3] == 6) & (a.keys[:, 4] == 0) & (a.keys[:, 5] == 1)      # sample 6, token 0, layer 1
    recs["areal"] = DispatchRecords("areal", a.keys[~drop], a.ids[~drop])
    res = compare_dispatch(recs, rollout.expected(), [len(t) for t in rollout.tokens])
    assert int(drop.sum()) == 3 and len(res.errors) == 3, res.errors
    assert all(e.startswith("areal step 0") and "1 (sample, token, layer) missing, first [(6, 0, 1)]" in e
               for e in res.errors), res.errors


# ---------------------------------------------------------------------- the record format (fast)
def _layout(tp=2):
    from r3bridge.parallel.layout import ParallelLayout

    return ParallelLayout(4, [0, 1, 1, 1], tp=tp)


def test_router_rows_thd_sp():
    from testlab.dispatch_records import router_rows

    # samples 4 and 2 packed (3 and 5 tokens, padded to 4 and 6), then a padding "sequence" of 2
    got = [list(zip(*(t.tolist() for t in router_rows([4, 2], [3, 5, 2], _layout(), tp_rank=r,
                                                       cu_seqlens_padded=[0, 4, 10, 12]))))
           for r in range(2)]
    pad = (-1, -1)
    assert got == [[(4, 0), (4, 1), (4, 2), pad, (2, 0), (2, 1)],
                   [(2, 2), (2, 3), (2, 4), pad, pad, pad]]


def test_router_rows_bshd_sp():
    from testlab.dispatch_records import router_rows

    # [b=2, s=4] sequence-first rows (row = s * b + b_idx); SP splits s
    got = [list(zip(*(t.tolist() for t in router_rows([1, 0], [2, 3], _layout(), tp_rank=r, format="bshd",
                                                       seq_length=4))))
           for r in range(2)]
    pad = (-1, -1)
    assert got == [[(1, 0), (0, 0), (1, 1), (0, 1)], [pad, (0, 2), pad, pad]]


def test_log_and_merge_refuse_conflicts():
    import torch

    from testlab.dispatch_records import DispatchLog

    def log(ids, rows=((0, 0), (0, 1))):
        lg = DispatchLog("x")
        s, t = (torch.tensor(c) for c in zip(*rows))
        lg.add(step=0, phase="update", grad=True, layer=2, topk=torch.tensor(ids), sample=s, token=t)
        return lg

    a = log([[3, 1], [0, 5]]).records()
    assert a.ids.tolist() == [[1, 3], [0, 5]]                       # sorted
    assert len(DispatchRecords.merge([a, log([[1, 3], [5, 0]]).records()])) == 2   # SP off: same rows twice
    with pytest.raises(AssertionError, match=r"sample 0 token 1 layer 2 dispatched \[0, 5\] on one rank, \[5, 6\] on another"):
        DispatchRecords.merge([a, log([[1, 3], [5, 6]]).records()])
    with pytest.raises(AssertionError, match="routed 2 times in one pass"):
        log([[3, 1], [0, 5]], rows=((0, 1), (0, 1))).records()


def test_compare_names_the_differing_route():
    """On records built from the rollout itself: agreement, then one id changed in one framework."""
    import torch

    from testlab.dispatch_records import DispatchLog

    rollout = _rollout()
    exp, lens = rollout.expected(), [len(t) for t in rollout.tokens]

    def records(name, bump=None):
        lg = DispatchLog(name)
        for s, n in enumerate(lens):
            routes, _ = exp.sequence(s)
            for li, lid in enumerate(exp.layer_ids):
                ids = torch.zeros((n, exp.topk), dtype=torch.int64)
                ids[:routes.shape[0]] = routes[:, li].to(torch.int64)
                if bump == (s, lid):
                    ids[2] = (ids[2] + 1) % exp.num_experts       # another pair of distinct experts
                lg.add(step=0, phase="compute_log_prob", grad=False, layer=lid, topk=ids,
                       sample=torch.full((n,), s), token=torch.arange(n))
        return lg.records()

    ok = compare_dispatch({"a": records("a"), "b": records("b")}, exp, lens)
    assert ok.errors == [] and ok.compared == int(exp.valid.sum()) * 3
    bad = compare_dispatch({"a": records("a"), "b": records("b", bump=(5, 3))}, exp, lens)
    assert len(bad.errors) == 1 and "compute_log_prob grad=False sample 5 token 2 layer 3: a [" in bad.errors[0]

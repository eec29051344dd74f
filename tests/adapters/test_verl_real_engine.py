"""r3bridge inside verl 0.9.1's real Megatron engine and workers (CPU, gloo), R3 and R2.

Nothing of verl is stood in for: the job config is verl's own ``ppo_megatron_trainer.yaml``
(hydra), ``import verl`` loads the adapter through the ``verl.plugins`` entry point,
``EngineRegistry`` hands out ``R3BridgeMegatronEngine``, verl builds the model through mbridge
(TE-free spec swapped in by ``testlab.mbridge_spec``), splits mini-batches (shuffled)
and dynamic-bsz micro-batches (re-ordered), runs megatron's schedules (no pipelining,
interleaved 1F1B) and its optimizer. Workers: ``TrainingWorker`` (``infer_batch``,
``train_mini_batch`` -> ``train_batch``) and ``ActorRolloutRefWorker`` (actor and reference in one
process: ``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``). Every router call
is checked against the route it must dispatch (rollout routes in R3, the routes the same
sample's compute_log_prob chose in R2), wherever verl put the sample.
See docs/testing-harness.md ("verl 0.9.1: what the CPU tests prove").
"""
from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from r3bridge.testing.harness.dist import spawn
from testlab import verl_job as vj

ENGINE = "R3BridgeMegatronEngine"
STEPS = 2
# (layout, TrainingWorker mode, ActorRolloutRefWorker mode): each layout runs both modes and
# both workers; each mode runs with both workers across the layouts.
ONE = (vj.JobLayout(recompute=True), "R3", "R2")
TP2 = (vj.JobLayout(tp=2, recompute=True), "R2", "R3")
PP2_VPP2 = (vj.JobLayout(pp=2, vpp=2), "R3", "R2")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vj.write_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny_qwen3_moe")))


@pytest.fixture(scope="module")
def runs(model_dir):
    """All three layouts, once for the module: {name: (job, per-rank results)}."""
    out = {}
    lay, a, b = ONE
    out["one"] = (ONE, spawn(vj.run_layout, world_size=1, args=(model_dir, lay, a, b, STEPS), timeout=600))
    for name, job in (("tp2", TP2), ("pp2_vpp2", PP2_VPP2)):
        lay, a, b = job
        out[name] = (job, spawn(vj.run_layout, world_size=lay.world_size, tp=lay.tp, pp=lay.pp, vpp=lay.vpp,
                                args=(model_dir, lay, a, b, STEPS), timeout=900))
    return out


LAYOUTS = ["one", "tp2", "pp2_vpp2"]


def test_adapter_is_a_verl_plugin():
    eps = [ep for ep in entry_points(group="verl.plugins") if ep.value == "r3bridge.adapters.verl"]
    assert eps, "r3bridge.adapters.verl is not registered in the verl.plugins entry-point group"


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_engine_comes_from_verl_registry(runs, name):
    _, ranks = runs[name]
    for r in ranks:
        for worker in ("training_worker", "actor_ref"):
            assert r[worker]["from_registry"], f"{worker}: the engine is not verl's registry pick"
            assert r[worker]["engine_class"].startswith("r3bridge.adapters.verl.")
            assert r[worker]["engine_class"].endswith(ENGINE)
        # the reference engine is r3bridge's class too (verl picks it for every Megatron LM
        # engine), but it attaches nothing: no replayer, no hook on any of its routers
        assert r["actor_ref"]["ref_engine_class"] == r["actor_ref"]["engine_class"]
        assert r["actor_ref"]["ref_replayer"] is False
        assert r["actor_ref"]["ref_hooks"] == 0


def _passes(ranks, worker):
    return [p for r in ranks for p in r[worker]["passes"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("worker", ["training_worker", "actor_ref"])
def test_every_router_call_dispatches_its_target(runs, name, worker):
    (lay, tw_mode, ar_mode), ranks = runs[name]
    mode = tw_mode if worker == "training_worker" else ar_mode
    passes = _passes(ranks, worker)
    bad = [m for p in passes for m in p.mismatches]
    assert not bad, f"{name} {worker} {mode}: {len(bad)} mismatches, first: {bad[:5]}"
    phases = sorted({p.phase for p in passes})
    assert phases == sorted(f"step{s}/{ph}" for s in range(STEPS) for ph in ("compute_log_prob", "update"))
    for phase in phases:
        checked = sum(p.checked_rows for p in passes if p.phase == phase)
        if mode == "R2" and phase.endswith("compute_log_prob"):
            assert checked == 0            # R2 records there: nothing to compare yet
            continue
        # every valid row of every sample, on every MoE layer, split over the TP ranks
        assert checked >= 8 * 3 * 2, f"{name} {worker} {phase}: only {checked} (row, layer) pairs checked"
    kinds = {k for p in passes if p.phase.endswith("update") for k in p.kinds}
    assert kinds == ({"forward", "recompute"} if lay.recompute else {"forward"})


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_verl_reorders_samples_between_passes(runs, name):
    """Dynamic bsz and mini-batch shuffling really moved samples (so routes had to follow them)."""
    _, ranks = runs[name]
    for worker in ("training_worker", "actor_ref"):
        passes = {p.phase: p for p in ranks[0][worker]["passes"]}
        lp, up = passes["step0/compute_log_prob"].micro_batches, passes["step0/update"].micro_batches
        assert sorted(s for mb in lp for s in mb) == list(range(8))
        assert lp != up and any(mb != sorted(mb) for mb in up)


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_r2_routes_travel_in_verl_output(runs, name):
    (_, tw_mode, ar_mode), ranks = runs[name]
    worker = "training_worker" if tw_mode == "R2" else "actor_ref"
    sent = [r[worker]["r2_transport"] for r in ranks if r[worker]["r2_transport"]]
    assert sent and all(len(step) == STEPS for step in sent)
    assert all(not bad for step in sent for bad in step), sent


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_reference_routes_natively(runs, name):
    (_, _, ar_mode), ranks = runs[name]
    for r in ranks:
        refs = r["actor_ref"]["ref"]
        assert len(refs) == STEPS and all(not x["state"] for x in refs)
    ref0 = ranks[0]["actor_ref"]["ref"][0]
    if ar_mode == "R3":
        # the batch carries rollout routes; the reference ignores them (random routes agree
        # with a native top-2 of 8 experts on ~1/28 of the pairs)
        assert all(x["agree_rollout"] < 0.5 for x in ranks[0]["actor_ref"]["ref"])
    else:
        # same weights as the actor before its first update: exactly the actor's native routes
        assert ref0["equal_actor_native"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_metrics_and_no_state_left(runs, name):
    (_, tw_mode, ar_mode), ranks = runs[name]
    for r in ranks:
        for worker in ("training_worker", "actor_ref"):
            assert not r[worker]["state_left"], r[worker]["state_left"]
    for worker, mode in (("training_worker", tw_mode), ("actor_ref", ar_mode)):
        updates = [keys for r in ranks for tag, keys in r[worker]["metrics"] if tag == "update"]
        assert len(updates) == STEPS, f"{worker}: {len(updates)} update outputs"
        for keys in updates:
            _check_logged(keys)                # as docs/metrics.md names them (verl adds "actor/")
            for k in ("r3bridge/update/agreement/mean", "r3bridge/update/coverage",
                      "r3bridge/update/mismatch/k3_kl", "r3bridge/old_log_prob/mismatch/k3_kl"):
                assert k in keys, f"{worker} {mode}: {k} missing from verl's update metrics"
            if mode == "R3":
                assert "r3bridge/old_log_prob/agreement/mean" in keys


def _check_logged(*args, **kwargs) -> None:
    from _documented_metrics import check_logged  # tests/adapters helper (not importable in workers)
    check_logged(*args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_only_the_actor_replays(runs, name):
    """Roles (r3bridge.megatron.roles; miles #2226, NeMo RL #4083): in verl's colocated actor +
    reference worker each engine declares its model's role, actor routes installed on a reference
    chunk are refused, and a reference that holds megatron's RouterReplay is refused before its
    log-prob pass, each naming both roles."""
    _, ranks = runs[name]
    for r in ranks:
        roles = r["actor_ref"]["roles"]
        assert roles["actor"] == ["actor"] and roles["reference"] == ["reference"], roles
        for scenario in ("routes_to_reference", "reference_with_megatron_replay"):
            msg = roles[scenario]
            assert msg.startswith("RoleError: ") and "actor" in msg and "reference" in msg, (scenario, msg)
        assert "RouterReplay" in roles["reference_with_megatron_replay"]

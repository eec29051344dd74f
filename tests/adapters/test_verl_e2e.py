"""verl 0.9.1's whole job on CPU through r3bridge's launcher: Ray, agent loop, rollout server,
reward, compute_log_prob, reference, GRPO update, 2 steps, for replay_mode R3, R2 and off.

``python -m r3bridge.adapters.verl.main_ppo`` runs as a user runs it (a subprocess with verl's
overrides plus ``r3bridge.replay_mode``); the rollout backend is r3bridge's HF transformers engine
registered in verl's rollout registries (:mod:`testlab.verl_hf_rollout`); two prompts of each step
go through the tool agent loop (two server calls each) with r3bridge's first-seen stitching
(:class:`r3bridge.adapters.verl.agent_loop.FirstSeenToolAgentLoop`). Every router call of the
actor and the reference model is logged in the Ray workers (:mod:`testlab.verl_e2e_worker`) and
checked per (sample, token, layer) (:func:`testlab.verl_e2e.check_run`): R3 dispatches the routes
the server returned (first-seen) on every row it returned, R2's update dispatches what the same
sample's compute_log_prob chose, off and the reference model route natively. The control run
switches first-seen off (verl's own last-call behaviour): its R3 dispatch must then disagree with
the first-seen routes. See docs/use-with-verl.md ("End to end").
"""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from testlab import verl_e2e as E

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 2


def _run(tmp_path_factory, mode: str, *, first_seen: bool = True) -> E.RunResult:
    root = str(tmp_path_factory.mktemp(f"verl_e2e_{mode}_{'first' if first_seen else 'last'}"))
    paths = E.write_job(root, first_seen=first_seen)
    t0 = time.monotonic()
    proc = subprocess.run(E.job_command(paths, mode, steps=STEPS), env=E.job_env(paths, REPO), cwd=root,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
    res = E.read_run(paths, proc.returncode, proc.stdout[-6000:])
    print(f"verl e2e {mode} first_seen={first_seen}: rc {proc.returncode}, {time.monotonic() - t0:.0f} s, "
          f"{len(res.calls)} server calls, {len(res.dispatch)} router calls")
    assert proc.returncode == 0, res.output
    return res


@pytest.fixture(scope="module")
def r3(tmp_path_factory):
    return _run(tmp_path_factory, "R3")


@pytest.fixture(scope="module")
def r3_last_call(tmp_path_factory):
    return _run(tmp_path_factory, "R3", first_seen=False)


@pytest.fixture(scope="module")
def r2(tmp_path_factory):
    return _run(tmp_path_factory, "R2")


@pytest.fixture(scope="module")
def off(tmp_path_factory):
    return _run(tmp_path_factory, "off")


def _checked(res: E.RunResult, mode: str, **kw) -> list[E.StepCheck]:
    checks = E.check_run(res, mode, **kw)
    assert len(checks) == STEPS, [c.step for c in checks]
    for c in checks:
        assert c.samples == E.BATCH * E.N, c
        assert c.compared["compute_log_prob"] > 0 and c.compared["update"] > 0, c
        # the reference model: no hook, its own top-k on every row
        assert c.ref_native[0] == c.ref_native[1] > 0, c
    return checks


def test_r3_dispatches_the_servers_first_seen_routes(r3):
    checks = _checked(r3, "R3")
    for c in checks:
        assert c.errors == [], c.errors
        assert c.multi_turn == 2 * E.N, c    # two tool-agent prompts per step, N samples each
        # the reference model ignores the rollout routes (it would match them everywhere if it replayed)
        same, total = c.ref_equal_rollout
        assert total > 0 and same < total / 2, c
    # the re-prefill of the second turn routed some first-turn tokens differently (bf16 engine)
    assert sum(c.reprefill[0] for c in checks) > 0, [c.reprefill for c in checks]
    # trainer-native top-k vs the rollout's routes, per step (on a GPU with real weight sync: near 1.0)
    assert all(c.native_vs_rollout[1] > 0 for c in checks), [c.native_vs_rollout for c in checks]
    # what the agent loops recorded of the server's answers (the only log when verl's own vLLM server
    # serves, R3E2E_ROLLOUT=vllm) is the HF server's own log, call for call, routes included
    server = sorted((c.prompt, c.output, c.routes.tobytes()) for c in r3.calls)
    agent = sorted((c.prompt, c.output, c.routes.tobytes()) for c in r3.agent_calls)
    assert len(server) == len(agent) > 0 and server == agent
    mets = E.r3bridge_metrics(r3)
    assert len(mets) == STEPS
    for m in mets:
        assert m["actor/r3bridge/update/coverage"] > 0.9, m
        assert "actor/r3bridge/old_log_prob/coverage" in m and "actor/r3bridge/update/agreement/mean" in m, m


def test_r3_with_last_call_routes_fails_the_check(r3_last_call):
    """First-seen off: the agent loop keeps the last call's routes (verl 0.9.1's behaviour); the
    trainer replays exactly those, and the first-seen check fails on the re-prefilled rows."""
    last = _checked(r3_last_call, "R3", first_seen=False)
    assert all(c.errors == [] for c in last), [c.errors for c in last]
    first = E.check_run(r3_last_call, "R3", first_seen=True)
    wrong = [e for c in first for e in c.errors]
    assert wrong, "the last call's routes passed the first-seen check"
    assert sum(c.reprefill[0] for c in first) > 0


def test_r2_update_replays_what_compute_log_prob_chose(r2):
    checks = _checked(r2, "R2")
    for c in checks:
        assert c.errors == [], c.errors
    for m in E.r3bridge_metrics(r2):
        assert m["actor/r3bridge/update/agreement/mean"] == pytest.approx(1.0), m
        assert m["actor/r3bridge/update/coverage"] == pytest.approx(1.0), m


def test_off_routes_natively_and_logs_nothing(off):
    checks = _checked(off, "off")
    for c in checks:
        assert c.errors == [], c.errors
    assert all(m == {} for m in E.r3bridge_metrics(off)), E.r3bridge_metrics(off)


def test_rank_rows_and_padded_lengths_of_several_ranks():
    """The multi-rank checker's row map (testlab.verl_e2e_parallel; the device runs at TP2 + SP):
    a TP rank's sequence-parallel slice of verl's packed stream, every sequence padded to a multiple
    of TP; the first stage's padded sequences resolved to the rollout's real ones; the layout knobs."""
    from testlab.verl_e2e_parallel import Parallel, apply_overrides, rank_rows, resolve_lengths

    par = {"tp": 2, "sp": True, "cp": 1}
    # verl 0.9.1's first stage: cu_seqlens_q == the padded offsets, so lens are the padded lengths
    batch = {"seqs": [[5, 6, 7, 0], [8, 9], [4, 0]], "lens": [4, 2, 2], "padded": [4, 2, 2], "lens_exact": False,
             "parallel": {**par, "tp_rank": 0}}
    resolve_lengths(batch, [[5, 6, 7], [8, 9], [4, 0]])      # sample 2 really ends in the pad id
    assert batch["lens"] == [3, 2, 2] and batch["seqs"][0] == [5, 6, 7]
    assert rank_rows(batch) == ([0, 0, 0, -1], [0, 1, 2, -1])
    assert rank_rows({**batch, "parallel": {**par, "tp_rank": 1}}) == ([1, 1, 2, 2], [0, 1, 0, 1])
    # without sequence parallelism every TP rank routes every row
    assert rank_rows({**batch, "parallel": {**par, "sp": False, "tp_rank": 1}})[0] == [0, 0, 0, -1, 1, 1, 2, 2]

    p = Parallel.from_env({"R3E2E_GPUS": "4", "R3E2E_TP": "2", "R3E2E_EP": "2"})
    assert p.label == "tp2_sp_ep2" and p.sequence_parallel
    cmd = apply_overrides(["trainer.n_gpus_per_node=1", "+ray_kwargs.ray_init.num_gpus=1", "x=1"], p.overrides())
    assert cmd[:3] == ["trainer.n_gpus_per_node=4", "+ray_kwargs.ray_init.num_gpus=4", "x=1"]
    assert "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2" in cmd
    with pytest.raises(ValueError, match="does not fit 2 rank"):
        Parallel.from_env({"R3E2E_GPUS": "2", "R3E2E_TP": "2", "R3E2E_EP": "2"})

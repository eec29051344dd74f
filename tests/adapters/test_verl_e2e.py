"""verl 0.9.1's whole job on CPU, launched as a user launches it: docs/use-with-verl.md's "Rehearse on
CPU" block, its run line as written (``cd "$(mktemp -d)" && bash "$R3BRIDGE/examples/verl/run_cpu_rehearsal.sh"``,
``python -m r3bridge.adapters.verl.main_ppo`` inside), from a folder outside the checkout, with the
installed r3bridge (nothing of the checkout on ``PYTHONPATH``). Ray, TransferQueue, verl's V1 trainer,
agent loop (two prompts of each step through the tool agent loop with r3bridge's first-seen stitching,
two server calls each), reward, compute_log_prob, reference, GRPO update, 2 steps; the rollout backend
is r3bridge's HF transformers engine (:mod:`testlab.verl_hf_rollout`). The R3 job is the block as
written; R2 and off append overrides to the same script, as a user would; the control (the last
call's routes, verl's own behaviour without first-seen stitching) is checked on the R3 job's record.
Routes by reference (``r3bridge.route_transport=handles``): a second R3 job, checked like the first
and against its counters, and the R2 job, each leaving no route file behind.

Every router call of the actor and the reference model is logged in the Ray workers
(:mod:`testlab.verl_e2e_worker`, switched on by ``R3E2E_LOG_DIR``: observation only) and checked per
(sample, token, layer) (:func:`testlab.verl_e2e.check_run`): R3 dispatches the routes the server
returned (first-seen) on every row it returned, R2's update dispatches what the same sample's
compute_log_prob chose, off and the reference model route natively. The R3 job also shows what the
guide promises: the launcher's and the workers' startup lines, the trace ``r3bridge inspect`` read
(saying the CPU harness's engine and trainer are different models), the provenance counters adding
up to the pass's samples; the R2 job's stall watchdog names its stages. See docs/use-with-verl.md.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testlab import verl_e2e as E

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
SAMPLES = E.BATCH * E.N          # per step, and per pass (one update mini-batch per step)


def guide_run_line() -> str:
    """The run line of the guide's fresh-virtualenv block (the line after its install lines)."""
    lines = (REPO / "docs" / "use-with-verl.md").read_text().splitlines()
    start = lines.index("<!-- fresh-venv: verl -->")
    assert lines[start + 1] == "```bash", lines[start + 1]
    block = lines[start + 2:lines.index("```", start + 2)]
    last_pip = max(i for i, line in enumerate(block) if line.startswith("pip install"))
    (line,) = [ln for ln in block[last_pip + 1:] if ln.strip() and not ln.startswith("#")]
    return line


def _kill_leftovers(root: str) -> None:
    """Ray's daemons a killed job may leave behind: those whose environment names this job's folder."""
    for d in glob.glob("/proc/[0-9]*"):
        try:
            if root.encode() in Path(d, "environ").read_bytes():
                os.kill(int(d[6:]), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _run(tmp_path_factory, name: str, extra: str = "", env_extra: dict | None = None) -> tuple[E.RunResult, str]:
    root = str(tmp_path_factory.mktemp(f"verl_e2e_{name}"))
    probe = os.path.join(root, "probe")
    env = {k: v for k, v in os.environ.items() if not k.startswith("R3BRIDGE_") and k not in ("PYTHONPATH",
                                                                                             "CUDA_VISIBLE_DEVICES")}
    # TMPDIR: the block's mktemp makes the job's folder here; Ray's own sockets stay in /tmp (a
    # socket path may not exceed 107 bytes)
    agent_calls = os.path.join(root, "agent_calls")       # the agent loops' log of the server's answers
    env.update(R3BRIDGE=str(REPO), TMPDIR=root, RAY_TMPDIR="/tmp", R3E2E_LOG_DIR=probe,
               R3E2E_AGENT_LOG_DIR=agent_calls, HYDRA_FULL_ERROR="1",
               RAY_DEDUP_LOGS="0",
               PATH=os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]]), **(env_extra or {}))
    # R3E2E_GPUS, R3E2E_TP, ... (manual multi-rank runs, testlab.verl_e2e_parallel): the layout's
    # overrides appended, as a user appends them (a later key wins; ++ for the keys given with +)
    from testlab.verl_e2e_parallel import Parallel

    layout = [("+" + o) if o.startswith("+") else o for o in Parallel.from_env().overrides()] \
        if os.environ.get("R3E2E_GPUS") else []
    line = " ".join([guide_run_line(), extra, *layout]).rstrip()
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", line], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    finally:
        _kill_leftovers(root)
    (job,) = glob.glob(os.path.join(root, "tmp.*"))           # the folder the block's mktemp made
    res = E.read_run({"logs": probe, "agent_calls": agent_calls, "metrics": os.path.join(job, "metrics.jsonl")},
                     proc.returncode, out)
    print(f"verl e2e {name}: rc {proc.returncode}, {time.monotonic() - t0:.0f} s, {len(res.calls)} server calls, "
          f"{len(res.dispatch)} router calls")
    assert proc.returncode == 0, out[-6000:]
    assert "Traceback" not in out, out[-6000:]
    return res, job


@pytest.fixture(scope="module")
def r3(tmp_path_factory):
    return _run(tmp_path_factory, "R3")


def _by_reference(tmp_path_factory, name: str) -> tuple[str, str]:
    """(the overrides that store routes by reference in a folder of this test's, the folder);
    route traces off, so the step's files are released (trace_dir keeps them)."""
    store = str(tmp_path_factory.mktemp(f"route_store_{name}"))
    return f"r3bridge.route_transport=handles r3bridge.route_store={store} r3bridge.trace_dir=null", store


@pytest.fixture(scope="module")
def r3_handles(tmp_path_factory):
    """The guide's R3 block with routes by reference (docs/use-with-verl.md, "Routes by reference")."""
    extra, store = _by_reference(tmp_path_factory, "R3")
    return _run(tmp_path_factory, "R3_handles", extra)[0], store


@pytest.fixture(scope="module")
def r2(tmp_path_factory):
    """R2, its recordings stored by reference (R2 inline: tests/adapters/test_verl_engine.py)."""
    extra, store = _by_reference(tmp_path_factory, "R2")
    return _run(tmp_path_factory, "R2", "r3bridge.replay_mode=R2 actor_rollout_ref.rollout.enable_rollout_routing_replay"
                f"=False r3bridge.stall_warning_s=20 {extra}")[0], store


@pytest.fixture(scope="module")
def off(tmp_path_factory):
    return _run(tmp_path_factory, "off", "r3bridge.replay_mode=off actor_rollout_ref.rollout.enable_rollout_routing_replay"
                "=False")[0]


def _checked(res: E.RunResult, mode: str, **kw) -> list[E.StepCheck]:
    checks = E.check_run(res, mode, **kw)
    assert len(checks) == STEPS, [c.step for c in checks]
    for c in checks:
        assert c.samples == SAMPLES, c
        assert c.compared["compute_log_prob"] > 0 and c.compared["update"] > 0, c
        # the reference model: no hook, its own top-k on every row
        assert c.ref_native[0] == c.ref_native[1] > 0, c
    return checks


def test_r3_dispatches_the_servers_first_seen_routes(r3):
    _check_r3(r3[0])


def test_r3_by_reference_replays_as_inline_and_leaves_no_route_files(r3, r3_handles):
    """route_transport: handles: the agent loops store each sample's routes once and verl's
    TransferQueue carries handles; every router dispatched the servers' first-seen routes, with the
    same counters as the inline job, and no route file is left after the two steps."""
    res, store = r3_handles
    _check_r3(res)
    counters = ("coverage", "replayed_pairs", "native_pairs", "samples/replayed", "samples/native",
                "provenance/checked_samples", "provenance/unchecked_samples", "provenance/mismatched_samples")
    inline = E.r3bridge_metrics(r3[0])
    for m_inline, m_handles in zip(inline, E.r3bridge_metrics(res)):
        for tag in ("old_log_prob", "update"):
            for c in counters:
                key = f"actor/r3bridge/{tag}/{c}"
                assert m_handles[key] == m_inline[key], (key, m_handles[key], m_inline[key])
    assert os.listdir(store) == []          # each step's files released after its update


def _check_r3(res: E.RunResult) -> None:
    checks = _checked(res, "R3")
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
    server = sorted((c.prompt, c.output, c.routes.tobytes()) for c in res.calls)
    agent = sorted((c.prompt, c.output, c.routes.tobytes()) for c in res.agent_calls)
    assert len(server) == len(agent) > 0 and server == agent
    mets = E.r3bridge_metrics(res)
    assert len(mets) == STEPS
    for m in mets:
        assert m["actor/r3bridge/update/coverage"] > 0.9, m
        assert "actor/r3bridge/old_log_prob/coverage" in m and "actor/r3bridge/update/agreement/mean" in m, m
        # every sample of a pass is counted: the tool loop's samples checked, the single-turn loop's
        # (verl's own, no provenance) unchecked
        for tag in ("old_log_prob", "update"):
            checked = m[f"actor/r3bridge/{tag}/provenance/checked_samples"]
            unchecked = m[f"actor/r3bridge/{tag}/provenance/unchecked_samples"]
            assert checked + unchecked == SAMPLES and checked == 2 * E.N, (tag, m)


def test_r3_guide_block_says_what_the_guide_promises(r3):
    """The startup lines, the forwarded options, the trace written and read by r3bridge inspect."""
    from r3bridge.trace import load_trace

    res, job = r3
    out = res.output
    assert "r3bridge (verl launcher, pid " in out and "replay_mode=R3 (from config)" in out
    assert "r3bridge (verl engine, pid " in out and "(from environment (R3BRIDGE_CONFIG from the verl launcher))" in out
    assert "r3bridge inspect: " + os.path.join(job, "routes") in out
    assert "so the engine and the trainer are different models" in out        # the CPU harness, said so
    trace = load_trace(os.path.join(job, "routes"))
    assert trace.meta["framework"] == "verl" and trace.meta["mode"] == "R3"
    assert {(p.step, p.name) for p in trace.passes} == {(s, n) for s in range(1, STEPS + 1)   # verl's numbering
                                                        for n in ("compute_log_prob", "update")}
    assert "replay exact: 0 of " in out        # the routers dispatched what verl handed over, pair by pair


def test_r3_with_last_call_routes_fails_the_check(r3):
    """The control, on the R3 job's own record: checked against the last call's routes (verl 0.9.1's
    behaviour without first-seen stitching), the rows the second turn re-prefilled differ, so the
    check tells the two apart (a job of its own with stitching off took two minutes of CI)."""
    res, _ = r3
    last = E.check_run(res, "R3", first_seen=False)
    wrong = [e for c in last for e in c.errors]
    assert wrong, "the first-seen routes passed the last-call check: the check cannot tell them apart"
    assert sum(c.reprefill[0] for c in last) > 0


def test_r2_update_replays_what_compute_log_prob_chose(r2):
    r2, store = r2
    assert os.listdir(store) == []          # the recordings, stored by reference, released with each step
    checks = _checked(r2, "R2")
    for c in checks:
        assert c.errors == [], c.errors
    for m in E.r3bridge_metrics(r2):
        assert m["actor/r3bridge/update/agreement/mean"] == pytest.approx(1.0), m
        assert m["actor/r3bridge/update/coverage"] == pytest.approx(1.0), m
    # the launcher's stall watchdog (r3bridge.stall_warning_s=20): the workers take longer than that
    # to start, so it names the stage and what it waits for, then sees the first replayed pass
    assert "in stage 'worker start' (1 of 2): waiting for Ray to place verl's TaskRunner" in r2.output
    assert "the first replayed pass ran" in r2.output


def test_off_routes_natively_and_logs_nothing(off):
    checks = _checked(off, "off")
    for c in checks:
        assert c.errors == [], c.errors
    assert all(m == {} for m in E.r3bridge_metrics(off)), E.r3bridge_metrics(off)
    assert "replay_mode=off (from config); routing replay is OFF" in off.output


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

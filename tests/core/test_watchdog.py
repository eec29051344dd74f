"""The stall watchdog (r3bridge.adapters.verl.watch): which stage is stuck, what it waits for, again every
bound while it stays stuck, quiet once the workers report progress (issue 39: a verl launch printed
its config and hung with no message)."""
from __future__ import annotations

import logging

import pytest

from r3bridge.adapters.verl.watch import Stage, StallWatchdog

STAGES = [Stage("worker start", "the workers to build the model", "engine_ready"),
          Stage("first replayed pass", "the first rollout and compute_log_prob", "first_pass")]


def test_names_the_stuck_stage_repeats_and_stops_when_done(caplog):
    now, reached = [0.0], set()
    dog = StallWatchdog("test launcher", STAGES, 60, progress=lambda: reached, describe=lambda: "Ray: 1 actor waiting.",
                        clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="r3bridge"):
        now[0] = 59
        assert dog.check() is None
        now[0] = 61
        line = dog.check()
        assert "no progress for 61 s in stage 'worker start' (1 of 2): waiting for the workers to build the model. " \
               "Ray: 1 actor waiting." in line and "stall_warning_s" in line
        now[0] = 100
        assert dog.check() is None                       # once per bound, not every look
        now[0] = 121
        assert "no progress for 121 s" in dog.check()
        reached.add("engine_ready")                      # a worker reported: the next stage starts now
        now[0] = 150
        assert dog.check() is None and dog.stages[dog.index].name == "first replayed pass"
        now[0] = 211
        assert "stage 'first replayed pass' (2 of 2)" in dog.check()
        reached.add("first_pass")
        assert dog.check() is None and dog.done
    assert "the first replayed pass ran, 211 s after launch" in caplog.text


def test_a_job_that_ends_within_one_tick_of_its_first_pass_is_still_said(caplog):
    """The thread looks every few seconds; a job whose first replayed pass came after the last look
    and which then ended (a short CPU rehearsal) still gets the line when the watch stops, and a
    stage stuck at the end gets no stall warning from the stop."""
    now, reached = [0.0], {"engine_ready"}
    dog = StallWatchdog("test launcher", STAGES, 60, progress=lambda: reached, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="r3bridge"):
        assert dog.check() is None and not dog.done
        reached.add("first_pass")                        # between two looks; then the job ends
        now[0] = 30
        dog.stop()
        assert dog.done
    assert "the first replayed pass ran, 30 s after launch" in caplog.text
    stuck = StallWatchdog("x", STAGES, 1, progress=set, clock=lambda: now[0])
    now[0] = 500
    with caplog.at_level(logging.INFO, logger="r3bridge"):
        caplog.clear()
        stuck.stop()
    assert not stuck.done and "no progress" not in caplog.text


def test_a_broken_progress_or_describe_never_takes_the_job_down():
    def broken():
        raise RuntimeError("GCS unreachable")

    now = [0.0]
    dog = StallWatchdog("x", STAGES, 1, progress=broken, describe=broken, clock=lambda: now[0])
    now[0] = 2
    assert "could not look at the cluster: RuntimeError: GCS unreachable" in dog.check()
    with pytest.raises(ValueError):
        StallWatchdog("x", STAGES, 0, progress=set)


def test_the_frameworks_launcher_runs_as_python_m_and_an_interrupt_exits_1(monkeypatch):
    """A launcher's last step (adapters/areal/parse_and_run.py): the framework's ``main`` sees ``sys.argv``
    as ``python -m`` sets it; ^C ends it with exit status 1; the server watch is stopped."""
    import sys
    import threading

    from r3bridge.adapters.areal.parse_and_run import run_framework_main

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    seen, stop = [], threading.Event()

    def interrupted():
        seen.append(list(sys.argv))
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        run_framework_main(interrupted, "/x/local.py", ["--config", "a.yaml"], stop=stop)
    assert exit_.value.code == 1 and seen == [["/x/local.py", "--config", "a.yaml"]] and stop.is_set()

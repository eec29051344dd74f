"""Say which stage a launched verl job is stuck in, instead of hanging silently.

r3bridge's verl launcher waits on stages it cannot see from its own process: Ray placing verl's
actors, the actor workers building the model with r3bridge's engine, then the first replayed pass.
When one does not progress within a bound (the option ``stall_warning_s``), :class:`StallWatchdog`
logs a WARNING naming the stage, what the job waits for there, and what Ray cannot place yet (the
actors and placement groups still pending, with the resources they ask for, next to the cluster's
totals). The line repeats every bound while the stage stays stuck; nothing is stopped or failed (a
slow model load is not an error), and the job's own errors stay the job's.

* Workers :func:`report` a progress key (``engine_ready``, ``first_pass``) into Ray's key-value
  store, under the job's watch id (``R3BRIDGE_WATCH``, which the launcher hands every worker with
  the rest of the r3bridge environment).
* The launcher reads them back (:func:`progress`) and, when a stage is stuck,
  :func:`describe_cluster` says what Ray cannot place: the usual reason a job that printed its config
  never starts on a small machine (Ray's scheduler waits, silently, for CPU slots that never free, or
  for GPUs the cluster does not have). The launcher passes its ``hints`` per resource.
* :class:`RayJobWatch` is the launcher's side of both, plus Ray's silent start failure explained.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from r3bridge.config import ReplayConfig, ReplayMode

__all__ = ["BLOCKED_AFTER_S", "Stage", "StallWatchdog", "RayJobWatch", "WATCH_ENV", "new_watch_id", "report", "progress",
           "describe_cluster", "ray_start_failure"]

logger = logging.getLogger("r3bridge")
BLOCKED_AFTER_S = 20.0      # how long Ray must have been unable to place something before it is said


@dataclass(frozen=True)
class Stage:
    name: str           # "worker start"
    waits_for: str      # what the job waits for in this stage, in the user's words
    reached_by: str     # the progress key that ends it


class StallWatchdog:
    """Stages in order; each ends when ``progress()`` holds its key. :meth:`check` is one look
    (tests call it with their own clock); :meth:`start` runs it in a daemon thread."""

    def __init__(self, where: str, stages: Sequence[Stage], bound_s: float, *,
                 progress: Callable[[], set[str]], describe: Callable[[], str] = lambda: "",
                 blocked: Callable[[], str] = lambda: "", blocked_after_s: float = BLOCKED_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if bound_s <= 0:
            raise ValueError(f"bound_s must be > 0, got {bound_s}")
        self.where, self.stages, self.bound_s = where, list(stages), float(bound_s)
        self.progress, self.describe, self.clock = progress, describe, clock
        # a job that cannot go on (``blocked()`` says why, '' while it can) is said after
        # ``blocked_after_s`` of it, sooner than a slow stage's bound
        self.blocked, self.blocked_after_s = blocked, min(float(blocked_after_s), self.bound_s)
        self.blocked_since: Optional[float] = None
        self.blocked_said = -1             # the stage whose blockage was said
        self.index = 0
        self.started = self.entered = clock()
        self.warned = 0                    # warnings said in the current stage
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def done(self) -> bool:
        return self.index >= len(self.stages)

    def _advance(self) -> None:
        """Move past every stage whose key was reported; say so when the last one is passed."""
        try:
            reached = self.progress()
        except Exception as e:  # noqa: BLE001  (a watchdog never takes the job down)
            reached = set()
            logger.debug("r3bridge watchdog: progress unreadable: %s", e)
        while not self.done and self.stages[self.index].reached_by in reached:
            self.index += 1
            self.entered, self.warned = self.clock(), 0
            if self.done:
                logger.info("r3bridge (%s, pid %d): the first replayed pass ran, %.0f s after launch",
                            self.where, os.getpid(), self.clock() - self.started)

    def check(self) -> Optional[str]:
        """Advance past every stage whose key was reported; return (and log) the warning when the
        current stage has been stuck for another ``bound_s``."""
        self._advance()
        if self.done:
            return None
        stuck = self.clock() - self.entered
        if self.blocked_said != self.index:
            line = self._blocked_line()
            if line:
                return line
        if stuck < self.bound_s * (self.warned + 1):
            return None
        self.warned += 1
        stage = self.stages[self.index]
        try:
            seen = self.describe()
        except Exception as e:  # noqa: BLE001
            seen = f"(could not look at the cluster: {type(e).__name__}: {e})"
        line = (f"r3bridge ({self.where}, pid {os.getpid()}): no progress for {stuck:.0f} s in stage "
                f"'{stage.name}' ({self.index + 1} of {len(self.stages)}): waiting for {stage.waits_for}."
                + (f" {seen}" if seen else "")
                + f" (this warning repeats every {self.bound_s:.0f} s; r3bridge.stall_warning_s sets the bound, 0 "
                  f"turns it off)")
        logger.warning(line)
        return line

    def _blocked_line(self) -> Optional[str]:
        """The warning, once per stage, when ``blocked()`` has said why the job cannot go on for
        ``blocked_after_s`` in a row; ``None`` otherwise."""
        try:
            why = self.blocked()
        except Exception as e:  # noqa: BLE001  (a watchdog never takes the job down)
            why = ""
            logger.debug("r3bridge watchdog: cluster unreadable: %s", e)
        now = self.clock()
        if not why:
            self.blocked_since = None
            return None
        if self.blocked_since is None:
            self.blocked_since = now
        if now - self.blocked_since < self.blocked_after_s:
            return None
        self.blocked_said = self.index
        stage = self.stages[self.index]
        line = (f"r3bridge ({self.where}, pid {os.getpid()}): stage '{stage.name}' ({self.index + 1} of "
                f"{len(self.stages)}) cannot go on: Ray cannot place what the job asked for "
                f"({now - self.blocked_since:.0f} s so far). {why}")
        logger.warning(line)
        return line

    def start(self, tick_s: Optional[float] = None) -> "StallWatchdog":
        tick = tick_s if tick_s is not None else min(5.0, self.bound_s / 4)

        def loop() -> None:
            while not self._stop.wait(tick) and not self.done:
                self.check()

        self._thread = threading.Thread(target=loop, name="r3bridge-stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; a stage reached since the last tick (a job that ended within one tick
        of its first replayed pass) is still said, never a stall warning."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not self.done:
            self._advance()


# ------------------------------------------------------------------------------------ Ray
WATCH_ENV = "R3BRIDGE_WATCH"
_NAMESPACE = "r3bridge"
_REPORTED: set[str] = set()      # this process's keys already reported (one put each)


def new_watch_id() -> str:
    return uuid.uuid4().hex[:12]


def report(key: str) -> None:
    """Tell the launcher this process reached ``key`` (once per process and key)."""
    watch = os.environ.get(WATCH_ENV)
    if not watch or key in _REPORTED:
        return
    _REPORTED.add(key)
    try:
        import ray
        from ray.experimental import internal_kv

        if not ray.is_initialized():
            return
        internal_kv._internal_kv_put(f"{watch}/{key}/{os.getpid()}", b"1", overwrite=True, namespace=_NAMESPACE)
    except Exception as e:  # noqa: BLE001  (the launcher's stall warning would then name this stage)
        logger.warning("r3bridge: could not report progress %r to the launcher's stall watchdog (pid %d): %s",
                       key, os.getpid(), e)


def progress(watch: str) -> set[str]:
    """The keys any worker of job ``watch`` reported (empty until Ray is up)."""
    import ray
    from ray.experimental import internal_kv

    if not ray.is_initialized():
        return set()
    keys = internal_kv._internal_kv_list(f"{watch}/", namespace=_NAMESPACE) or []
    return {k.decode().split("/")[1] for k in keys}


def _resources(d: Any) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(dict(d or {}).items())
                           if not k.startswith(("node:", "memory", "object_store"))) + "}"


def _counted(items: list[str]) -> list[str]:
    """``["a", "a", "b"]`` -> ``["2 x a", "b"]`` (eight storage units read as one line)."""
    out: dict[str, int] = {}
    for it in items:
        out[it] = out.get(it, 0) + 1
    return [f"{n} x {it}" if n > 1 else it for it, n in out.items()]


def describe_cluster(hints: Optional[Mapping[str, str]] = None, *, blocked_only: bool = False) -> str:
    """What Ray cannot place yet, and the cluster's totals. ``hints``: what to change when a
    resource is short (``{"CPU": ..., "GPU": ...}``, in the framework's keys). ``blocked_only``: ''
    unless something whose resources are known (a placement group, an actor when Ray's state API
    answers) asks for more than is free: a job that cannot go on, not one that is slow."""
    import ray

    if not ray.is_initialized():
        return "" if blocked_only else "Ray is not up yet in this process."
    total, free = ray.cluster_resources(), ray.available_resources()
    head = (f"Ray cluster: CPU {total.get('CPU', 0):g} (free {free.get('CPU', 0):g}), "
            f"GPU {total.get('GPU', 0):g} (free {free.get('GPU', 0):g}).")
    starting, waiting, short = [], [], set()
    known = [0]            # waiting items whose resources are known

    def asks(what: str, need: dict) -> None:
        lacking = [k for k, v in need.items() if v > free.get(k, 0)]
        if lacking:        # cannot be placed until something frees these
            waiting.append(f"{what} asks for {_resources(need)}")
            short.update(lacking)
            known[0] += 1
        else:              # placed as soon as its worker process starts
            starting.append(what)
    try:
        from ray.util.state import list_actors

        for a in list_actors(filters=[("state", "=", "PENDING_CREATION")], detail=True, raise_on_missing_output=False):
            asks(f"actor {a.class_name}", dict(a.required_resources or {}))
    except Exception:  # noqa: BLE001  (no dashboard: the GCS table has the names, not the resources)
        from ray._private import state

        for a in state.actors().values():
            if a.get("State") != "PENDING_CREATION":
                continue
            if free.get("CPU", 0) < 1:     # nothing can be placed that needs a CPU slot
                waiting.append(f"actor {a.get('ActorClassName')} (no CPU slot free)")
                short.add("CPU")
            else:
                starting.append(f"actor {a.get('ActorClassName')}")
    for pg in ray.util.placement_group_table().values():
        if pg.get("state") == "PENDING":
            bundles = list(pg.get("bundles", {}).values())
            need: dict = {}
            for b in bundles:
                for k, v in b.items():
                    need[k] = need.get(k, 0) + v
            asks(f"placement group {pg.get('name') or pg.get('placement_group_id')} "
                 f"({len(bundles)} x {_resources(bundles[0]) if bundles else '{}'})", need)
    if blocked_only and not known[0]:
        return ""
    starting, waiting = _counted(starting), _counted(waiting)
    if starting:
        head += f" Starting: {', '.join(starting)}."
    if not waiting:
        return head + ("" if starting else " Ray has placed everything it was asked for: the wait is inside the workers.")
    hint = [text for resource, text in (hints or {}).items() if resource in short]
    return (head + f" Cannot be placed until resources free: {'; '.join(waiting)}."
            + (f" To fix: {'; '.join(hint)}." if hint else ""))


def ray_start_failure(error: BaseException) -> Optional[str]:
    """Why a local Ray cluster did not start, from the raylet's own log, when ``error`` is Ray's
    generic "The current node timed out during startup" (which names no cause; Ray #65983); None
    otherwise. A raylet that waits more than its 15 s for the dashboard agent's port files (a
    loaded machine: the agent's imports are slow) exits with a FATAL line only its log shows."""
    if "timed out during startup" not in str(error):
        return None
    root = os.environ.get("RAY_TMPDIR") or os.path.join(tempfile.gettempdir(), "ray")
    log = os.path.join(root, "session_latest", "logs", "raylet.out")
    try:
        with open(log, errors="replace") as f:
            fatal = [line.strip() for line in f if " C " in line[:40] or "Check failed" in line]
    except OSError:
        return f"Ray's raylet did not register within Ray's 30 s; its log ({log}) is not readable"
    if not fatal:
        return f"Ray's raylet did not register within Ray's 30 s (nothing fatal in {log})"
    cause = fatal[-1]
    if "Timed out waiting for file" in cause or "WaitForDashboardAgentPorts" in cause or "3576" in cause:
        cause += (" (the raylet gives its dashboard agent 15 s to start, Ray #65983: a machine this loaded does "
                  "not; run when it is less busy)")
    return f"Ray's raylet exited; its log ({log}) says: {cause}"


class RayJobWatch:
    """A launcher's watch over the Ray job it starts. :attr:`worker_env` (hand it to every worker
    with the section) names the job the workers report progress under
    (:func:`report`); :meth:`start`, once the options are known, runs the stall
    watchdog over ``stages`` (replay on, ``stall_warning_s`` > 0). As a context manager around the
    framework's main it stops the watchdog and, when Ray failed to start with its generic message,
    logs the cause from the raylet's log (:func:`ray_start_failure`).
    ``hints``: what to change when Ray lacks a resource (``{"CPU": ..., "GPU": ...}``)."""

    def __init__(self, where: str, stages: Sequence[Stage], hints: Optional[Mapping[str, str]] = None) -> None:
        self.where, self.stages, self.hints = where, list(stages), dict(hints or {})
        self.watch_id = new_watch_id()
        self.watchdog: Optional[StallWatchdog] = None

    @property
    def worker_env(self) -> dict[str, str]:
        return {WATCH_ENV: self.watch_id}

    def start(self, cfg: ReplayConfig) -> Optional[StallWatchdog]:
        if cfg.replay_mode is ReplayMode.OFF or not cfg.stall_warning_s:
            return None
        self.watchdog = StallWatchdog(self.where, self.stages, cfg.stall_warning_s,
                                      progress=lambda: progress(self.watch_id),
                                      describe=lambda: describe_cluster(self.hints),
                                      blocked=lambda: describe_cluster(self.hints, blocked_only=True)).start()
        return self.watchdog

    def __enter__(self) -> "RayJobWatch":
        return self

    def __exit__(self, kind: Any, error: Optional[BaseException], traceback: Any) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if error is not None:
            why = ray_start_failure(error)             # Ray's own message names no cause
            if why:
                logger.error("r3bridge (%s, pid %d): %s", self.where, os.getpid(), why)

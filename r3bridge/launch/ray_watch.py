"""The Ray half of :mod:`r3bridge.launch.watchdog`, for launchers that start a Ray job (verl's).

* Workers :func:`report` a progress key (``engine_ready``, ``first_pass``) into Ray's key-value
  store, under the job's watch id (``R3BRIDGE_WATCH``, which the launcher hands every worker with
  the rest of the r3bridge environment). A worker started without one (verl's stock entry point)
  reports nothing.
* The launcher reads them back (:func:`progress`) and, when a stage is stuck,
  :func:`describe_cluster` says what Ray cannot place: actors still waiting to be created and
  placement groups still pending, each with the resources it asks for, next to the cluster's
  totals. That is the usual reason a job that printed its config never starts on a small machine:
  Ray's scheduler waits, silently, for CPU slots that never free (verl's TransferQueue asks for one
  per storage unit, 8 by default, plus one for its controller) or for GPUs the cluster does not have.
  What to change is the framework's: the launcher passes its ``hints`` per resource.
"""
from __future__ import annotations

import logging
import os
import tempfile
import uuid
from typing import Any, Mapping, Optional

__all__ = ["WATCH_ENV", "new_watch_id", "report", "progress", "describe_cluster", "ray_start_failure"]

WATCH_ENV = "R3BRIDGE_WATCH"
_NAMESPACE = "r3bridge"
_REPORTED: set[str] = set()
logger = logging.getLogger("r3bridge")


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


def describe_cluster(hints: Optional[Mapping[str, str]] = None) -> str:
    """What Ray cannot place yet, and the cluster's totals; '' before Ray is up. ``hints``: what
    to change when a resource is short (``{"CPU": ..., "GPU": ...}``, in the framework's keys)."""
    import ray

    if not ray.is_initialized():
        return "Ray is not up yet in this process."
    total, free = ray.cluster_resources(), ray.available_resources()
    head = (f"Ray cluster: CPU {total.get('CPU', 0):g} (free {free.get('CPU', 0):g}), "
            f"GPU {total.get('GPU', 0):g} (free {free.get('GPU', 0):g}).")
    starting, waiting, short = [], [], set()

    def asks(what: str, need: dict) -> None:
        lacking = [k for k, v in need.items() if v > free.get(k, 0)]
        if lacking:        # cannot be placed until something frees these
            waiting.append(f"{what} asks for {_resources(need)}")
            short.update(lacking)
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

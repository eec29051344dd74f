"""What a framework's launcher does before the framework's own launch, written once.

Every shipped launcher (verl's ``main_ppo``, SkyRL's ``main``, AReaL's ``launch``) parses the job
config with the framework's own parser, resolves and announces the ``r3bridge`` section, refuses
what would fail late in one line, hands the section to the workers and then runs the
framework's entry point unchanged. The parts that know no framework are here; each launcher
keeps its framework's keys, checks and entry point:

* :func:`refuse` / :func:`refusing_section_errors`: one ``error: ...`` line per problem, exit
  status 2, before anything starts (a bad value or key of the section included);
* :func:`section_overrides`: ``r3bridge.x=y`` on a hydra command line as ``++r3bridge.x=y``;
* :func:`forward_section`, :func:`merge_setting`, :func:`local_hf_config`, :func:`check_ray_cpu_slots`,
  :func:`ensure_folders`: writing the section (and the workers' environment) into an OmegaConf
  job config, reading the model's HF config, refusing a local Ray cluster too small for the
  job's own actors, creating the folders a launcher requires;
* :class:`RayJobWatch`: the stall watchdog over a Ray job (:mod:`r3bridge.launch.watchdog`,
  :mod:`r3bridge.launch.ray_watch`) and Ray's silent start failure explained;
* :class:`ServerWait`: a launcher's wait for its inference servers to register, said every
  minute, and stopped once every server process has exited without registering.
"""
from __future__ import annotations

import _thread
import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping, NoReturn, Optional, Sequence

from r3bridge.config import ReplayConfig, ReplayMode, forward_env
from r3bridge.errors import ConfigError, ReplayError
from r3bridge.job_check import setting
from r3bridge.launch.watchdog import Stage, StallWatchdog

__all__ = ["refuse", "refusing_section_errors", "section_overrides", "merge_setting", "forward_section",
           "local_hf_config",
           "local_ray_cpu_slots", "check_ray_cpu_slots", "ensure_folders", "RayJobWatch", "ServerWait", "running_processes",
           "watch_servers", "section_keys"]

logger = logging.getLogger("r3bridge")


# ------------------------------------------------------------------------------------ refusing
def refuse(*lines: str) -> NoReturn:
    """Each line as ``error: <line>`` on stderr, then exit status 2 (nothing started yet)."""
    for line in lines:
        print(f"error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(2)


@contextlib.contextmanager
def refusing_section_errors(section: str) -> Iterator[None]:
    """Around the launcher's parse of the job config: a :class:`~r3bridge.ReplayError` (a bad
    value, a contradiction) or the framework parser's own error about the section (a mistyped
    key of :class:`~r3bridge.ReplayConfig`) is refused in one line naming ``section``; any other
    error is the framework's, raised as it is."""
    try:
        yield
    except ReplayError as e:
        refuse(f"{type(e).__name__}: " + (str(e) if section in str(e) else f"{section}: {e}"))
    except Exception as e:  # noqa: BLE001  (the framework's parser: hydra, omegaconf, dataclasses)
        if "ReplayConfig" not in str(e):
            raise
        refuse(f"{section}: {str(e).splitlines()[0]}")


# ------------------------------------------------------------------------------------ job config
def section_overrides(argv: Sequence[str], section: str = "r3bridge") -> list[str]:
    """``r3bridge.x=y`` / ``+r3bridge.x=y`` -> ``++r3bridge.x=y`` (hydra's add-or-override, which
    works whether or not the composed config already has the section); everything else unchanged."""
    prefixes = (f"{section}.", f"{section}=")
    out = []
    for arg in argv:
        bare = arg.lstrip("+")
        out.append(f"++{bare}" if bare.startswith(prefixes) and len(arg) - len(bare) <= 2 else arg)
    return out


def merge_setting(cfg: Any, path: str, values: Mapping[str, Any]) -> None:
    """``values`` merged into the mapping at the dotted ``path`` of an OmegaConf config (struct
    mode too), every missing level created."""
    from omegaconf import OmegaConf, open_dict

    node = cfg
    for part in path.split("."):
        with open_dict(node):
            if node.get(part) is None:
                node[part] = OmegaConf.create({})
        node = node[part]
    with open_dict(node):
        node.update(dict(values))


def forward_section(job_cfg: Any, cfg: ReplayConfig, where: str, *, env_path: str,
                    worker_env: Optional[Mapping[str, str]] = None, section: str = "r3bridge") -> None:
    """Hand the resolved options to every worker of an OmegaConf job config: written back as its
    ``section``, and as ``R3BRIDGE_CONFIG`` (plus ``worker_env``) into the workers' environment at
    ``env_path`` and into this process's (for workers that see only part of the job config)."""
    from omegaconf import open_dict

    forward = forward_env(cfg, where)
    with open_dict(job_cfg):
        job_cfg[section] = cfg.as_dict()
    merge_setting(job_cfg, env_path, {**forward, **(worker_env or {})})
    os.environ.update(forward)


def local_hf_config(path: Any, *, trust_remote_code: bool = False) -> Any:
    """The model's HF config when ``path`` is a local folder the launcher can read; ``None`` for a
    remote name or an unreadable config (the workers check the model when they build it)."""
    if not path or not os.path.exists(os.path.expanduser(str(path))):
        return None
    try:
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(os.path.expanduser(str(path)), trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001
        return None


def local_ray_cpu_slots(ray_init: Any, cpus: Optional[int] = None) -> Optional[tuple[int, bool]]:
    """(CPU slots, whether ``num_cpus`` set them) of the local Ray cluster that ``ray.init(**ray_init)``
    starts: ``num_cpus``, else the machine's cores as Ray counts them (``cpus`` overrides). ``None``
    when it joins an existing cluster (``address``, ``RAY_ADDRESS``)."""
    if setting(ray_init, "address") or os.environ.get("RAY_ADDRESS"):
        return None
    slots = setting(ray_init, "num_cpus")
    if slots is not None:
        return int(slots), True
    if cpus is None:
        try:
            from ray._private.utils import get_num_cpus
            cpus = int(get_num_cpus())
        except Exception:  # noqa: BLE001  (Ray's private helper moved: the machine's count)
            cpus = os.cpu_count() or 1
    return int(cpus), False


def check_ray_cpu_slots(need: int, ray_init: Any, *, holder: str, num_cpus_key: str, fewer: str,
                        cpus: Optional[int] = None) -> None:
    """Refuse a launch whose local Ray cluster has fewer CPU slots than ``need``, what ``holder``
    takes for the whole job: Ray never places the rest and waits, silently (issue 39: a launch that
    printed its config and hung). ``num_cpus_key``: the framework's key for Ray's ``num_cpus``;
    ``fewer``: how to ask for fewer; ``cpus``: the machine's count (default: Ray's own)."""
    local = local_ray_cpu_slots(ray_init, cpus)
    if local is None or local[0] >= need:
        return
    slots, given = local
    where = num_cpus_key if given else f"this machine's {slots} cores ({num_cpus_key} unset)"
    raise ConfigError(f"{holder} needs {need} Ray CPU slots for itself, held for the whole job, but the local "
                      f"Ray cluster gets {slots} from {where}: the job would wait forever for the rest. Set "
                      f"{num_cpus_key} to at least {need} plus what your workers take (logical slots: more than "
                      f"the machine's cores is fine), or {fewer}")


def ensure_folders(where: str, folders: Mapping[str, Any]) -> None:
    """Create each missing folder (``{config key: path}``) a launcher requires to exist, saying so."""
    for key, path in folders.items():
        if path and not os.path.isdir(path):
            os.makedirs(path, exist_ok=True)
            logger.warning("r3bridge (%s): created %s %s (the launcher requires it to exist; on several nodes it "
                           "must be a shared file system)", where, key, path)


# ------------------------------------------------------------------------------------ Ray jobs
class RayJobWatch:
    """A launcher's watch over the Ray job it starts. :attr:`worker_env` (hand it to every worker
    with the section) names the job the workers report progress under
    (:func:`r3bridge.launch.ray_watch.report`); :meth:`start`, once the options are known, runs the stall
    watchdog over ``stages`` (replay on, ``stall_warning_s`` > 0). As a context manager around the
    framework's main it stops the watchdog and, when Ray failed to start with its generic message,
    logs the cause from the raylet's log (:func:`r3bridge.launch.ray_watch.ray_start_failure`).
    ``hints``: what to change when Ray lacks a resource (``{"CPU": ..., "GPU": ...}``)."""

    def __init__(self, where: str, stages: Sequence[Stage], hints: Optional[Mapping[str, str]] = None) -> None:
        from r3bridge.launch import ray_watch

        self.where, self.stages, self.hints = where, list(stages), dict(hints or {})
        self.watch_id = ray_watch.new_watch_id()
        self.watchdog: Optional[StallWatchdog] = None

    @property
    def worker_env(self) -> dict[str, str]:
        from r3bridge.launch.ray_watch import WATCH_ENV
        return {WATCH_ENV: self.watch_id}

    def start(self, cfg: ReplayConfig) -> Optional[StallWatchdog]:
        if cfg.replay_mode is ReplayMode.OFF or not cfg.stall_warning_s:
            return None
        from r3bridge.launch import ray_watch

        self.watchdog = StallWatchdog(self.where, self.stages, cfg.stall_warning_s,
                                      progress=lambda: ray_watch.progress(self.watch_id),
                                      describe=lambda: ray_watch.describe_cluster(self.hints)).start()
        return self.watchdog

    def __enter__(self) -> "RayJobWatch":
        return self

    def __exit__(self, kind: Any, error: Optional[BaseException], traceback: Any) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if error is not None:
            from r3bridge.launch.ray_watch import ray_start_failure

            why = ray_start_failure(error)             # Ray's own message names no cause
            if why:
                logger.error("r3bridge (%s, pid %d): %s", self.where, os.getpid(), why)


# ------------------------------------------------------------------------------------ inference servers
class ServerWait:
    """A launcher waiting for its inference servers to register: what it waits for, and whether it
    still can. ``wrapper`` / ``server``: the modules of the launcher's server wrapper process and
    of the server it starts (their processes are counted by ``running(module)``); ``registered()``:
    servers registered so far; ``gives_up_after_s``: the launcher's own bound, for the message.
    :meth:`poll` returns ``None`` while waiting quietly, else a line: progress (every
    ``report_every`` s), done, or failed (:attr:`failed`: every wrapper or server process seen has
    exited and fewer than ``expected`` servers registered)."""

    def __init__(self, backend: str, expected: int, registered: Callable[[], int], log_path: str, *,
                 wrapper: str, server: str, gives_up_after_s: float,
                 running: Callable[[str], int] = lambda module: running_processes(module),
                 report_every: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.backend, self.expected, self.log_path = backend, expected, log_path
        self.modules = {"wrapper": wrapper, "server": server}
        self.gives_up_after_s = gives_up_after_s
        self._registered, self._running, self._clock = registered, running, clock
        self.report_every = report_every
        self.start = self._last = clock()
        self._seen: set[str] = set()
        self.done = self.failed = False

    def poll(self) -> Optional[str]:
        alive = {what: self._running(module) for what, module in self.modules.items()}
        self._seen |= {what for what, n in alive.items() if n}
        waited = self._clock() - self.start
        if "wrapper" in self._seen:          # a launcher clears old registrations before it starts the wrapper
            n = self._registered()
            if n >= self.expected:
                self.done = True
                return f"{n} {self.backend} server(s) registered after {waited:.0f} s"
        if self._seen and not any(alive[what] for what in self._seen):
            self.failed = True
            return (f"the {self.backend} server process(es) exited before registering ({waited:.0f} s after launch); "
                    f"their output: {self.log_path}")
        if self._clock() - self._last >= self.report_every:
            self._last = self._clock()
            return (f"waiting {waited:.0f} s for {self.expected} {self.backend} server(s) to register "
                    f"({alive['server']} server process(es) running; the launcher gives up after "
                    f"{self.gives_up_after_s:.0f} s); their output: {self.log_path}")
        return None


def running_processes(module: str) -> int:
    """Processes below this one whose command line runs ``module``."""
    import psutil

    count = 0
    for proc in psutil.Process().children(recursive=True):
        try:
            count += module in " ".join(proc.cmdline())
        except psutil.Error:
            continue
    return count


def watch_servers(wait: ServerWait, where: str, interval: float = 2.0) -> threading.Event:
    """Poll ``wait`` in a daemon thread, logging its lines; a failed wait interrupts the main
    thread (launchers stop their jobs on ``KeyboardInterrupt``). Set the returned event to stop."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval):
            line = wait.poll()
            if line is None:
                continue
            if wait.failed:
                logger.error("r3bridge (%s): %s; stopping the launch", where, line)
                _thread.interrupt_main()
                return
            logger.warning("r3bridge (%s): %s", where, line)
            if wait.done:
                return

    threading.Thread(target=watch, name="r3bridge-server-wait", daemon=True).start()
    return stop


def section_keys(argv: Sequence[str], section: str = "r3bridge") -> list[str]:
    """The keys of ``section`` a command line sets (``section.x=y``, ``+section.x=y``, ``++section.x=y``)."""
    prefix = f"{section}."
    return [a.lstrip("+").split("=", 1)[0][len(prefix):] for a in argv if a.lstrip("+").startswith(prefix)]

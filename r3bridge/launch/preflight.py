"""What a launcher does before the framework's own launch, written once for every launcher.

Each shipped launcher parses the job config with its framework's own parser, resolves and
announces the ``r3bridge`` section, refuses what would fail late in one line, hands the section to
the workers and then runs the framework's entry point unchanged. The parts that know no framework:

* :func:`refuse` / :func:`refusing_section_errors`: one ``error: ...`` line per problem, exit
  status 2, before anything starts (a bad value or key of the section included);
* :func:`section_keys`: the section's keys a command line sets;
* :func:`ensure_folders`: creating the folders a launcher requires;
* :class:`ServerWait` / :func:`watch_servers`: a launcher's wait for its inference servers to
  register, said every minute, and stopped once every server process has exited without registering.
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

from r3bridge.errors import ReplayError

__all__ = ["refuse", "refusing_section_errors", "section_keys", "ensure_folders", "ServerWait", "running_processes",
           "watch_servers"]

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
def ensure_folders(where: str, folders: Mapping[str, Any]) -> None:
    """Create each missing folder (``{config key: path}``) a launcher requires to exist, saying so."""
    for key, path in folders.items():
        if path and not os.path.isdir(path):
            os.makedirs(path, exist_ok=True)
            logger.warning("r3bridge (%s): created %s %s (the launcher requires it to exist; on several nodes it "
                           "must be a shared file system)", where, key, path)


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

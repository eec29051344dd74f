"""Say which stage a launched job is stuck in, instead of hanging silently.

A launcher (verl's ``main_ppo``, ...) waits on stages it cannot see from its own process: workers
starting and building the model with r3bridge's engine, then the first replayed pass. When one does
not progress within a bound (the option ``stall_warning_s``), :class:`StallWatchdog` logs a WARNING
naming the stage, what the job waits for there, and what the caller's ``describe`` finds (for a Ray
job: the actors and placement groups Ray cannot place yet, with the resources they ask for). The
line repeats every bound while the stage stays stuck; nothing is stopped or failed (a slow model
load is not an error), and the job's own errors stay the job's.

Core module: no Ray, no framework. Progress arrives through ``progress()``, a callable returning
the keys the workers reported so far (:mod:`r3bridge.launch.ray_watch` for Ray jobs).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

__all__ = ["Stage", "StallWatchdog"]

logger = logging.getLogger("r3bridge")


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
                 clock: Callable[[], float] = time.monotonic) -> None:
        if bound_s <= 0:
            raise ValueError(f"bound_s must be > 0, got {bound_s}")
        self.where, self.stages, self.bound_s = where, list(stages), float(bound_s)
        self.progress, self.describe, self.clock = progress, describe, clock
        self.index = 0
        self.started = self.entered = clock()
        self.warned = 0                    # warnings said in the current stage
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def done(self) -> bool:
        return self.index >= len(self.stages)

    def check(self) -> Optional[str]:
        """Advance past every stage whose key was reported; return (and log) the warning when the
        current stage has been stuck for another ``bound_s``."""
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
        if self.done:
            return None
        stuck = self.clock() - self.entered
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

    def start(self, tick_s: Optional[float] = None) -> "StallWatchdog":
        tick = tick_s if tick_s is not None else min(5.0, self.bound_s / 4)

        def loop() -> None:
            while not self._stop.wait(tick) and not self.done:
                self.check()

        self._thread = threading.Thread(target=loop, name="r3bridge-stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

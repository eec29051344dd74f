"""``python -m r3bridge.adapters.verl.main_ppo`` = verl's ``main_ppo`` plus the ``r3bridge`` section.

Takes exactly verl's hydra overrides, plus ``r3bridge.replay_mode=R2|R3|off`` and the core's
options (``r3bridge.agreement``, ``r3bridge.min_coverage``, ...). They are passed to hydra as
``++r3bridge.*`` (add-or-override), which works whether or not the composed config already has an
``r3bridge`` section (``+`` fails when it has one, a bare key fails when it has none). Validates the
whole job config before Ray starts (``r3bridge.ConfigError`` listing every problem), logs the replay
mode in force and where it came from, forwards the section to every worker, then runs verl's own
``main``. While it runs, a stall watchdog (:mod:`r3bridge.watchdog`, option ``stall_warning_s``)
says which stage is stuck and what it waits for: the workers starting with r3bridge's engine, then
the first replayed pass (the workers report both; :mod:`r3bridge.adapters._ray_watch`).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from r3bridge.adapters._ray_watch import WATCH_ENV, new_watch_id, ray_start_failure
from r3bridge.config import ReplayConfig, ReplayMode
from r3bridge.watchdog import Stage, StallWatchdog

__all__ = ["main", "rewrite_overrides", "stall_watchdog", "STAGES"]

_SECTION = ("r3bridge.", "r3bridge=")
WHERE = "verl launcher"
# what verl's job does between the launch and r3bridge's first pass, as the workers report it
# (r3bridge.adapters._ray_watch.report in the engine)
STAGES = (
    Stage("worker start", "Ray to place verl's TaskRunner, TransferQueue and worker groups, and verl's actor worker "
          "to build the model with r3bridge's engine (engine_ready)", "engine_ready"),
    Stage("first replayed pass", "the first rollout, then the first compute_log_prob / update pass through "
          "r3bridge's engine (the rollout engine generating, the agent loop and reward workers)", "first_pass"),
)


def stall_watchdog(cfg: ReplayConfig, watch_id: str) -> Optional[StallWatchdog]:
    """The launcher's watchdog over :data:`STAGES` (replay on, ``stall_warning_s`` > 0), started."""
    if cfg.replay_mode is ReplayMode.OFF or not cfg.stall_warning_s:
        return None
    from r3bridge.adapters import _ray_watch

    return StallWatchdog(WHERE, STAGES, cfg.stall_warning_s, progress=lambda: _ray_watch.progress(watch_id),
                         describe=_ray_watch.describe_cluster).start()


def rewrite_overrides(argv: list[str]) -> list[str]:
    """``r3bridge.x=y`` / ``+r3bridge.x=y`` -> ``++r3bridge.x=y``; everything else unchanged."""
    out = []
    for a in argv:
        bare = a.lstrip("+")
        out.append(f"++{bare}" if bare.startswith(_SECTION) and len(a) - len(bare) <= 2 else a)
    return out


def main() -> None:
    import hydra
    import verl.trainer.main_ppo as verl_main

    from r3bridge.adapters.verl.config import check_local_ray_slots, prepare_verl_config
    from r3bridge.versions import check_internals, check_release

    check_release("verl", what="'s verl launcher")
    # verl's main body, without its own @hydra.main wrapper (this launcher composes the config)
    check_internals("verl", [("verl.trainer.main_ppo.main.__wrapped__", verl_main.main, "__wrapped__")])
    config_dir = os.path.join(os.path.dirname(verl_main.__file__), "config")

    @hydra.main(config_path=config_dir, config_name="ppo_trainer", version_base=None)
    def _main(config) -> None:
        watch_id = new_watch_id()
        check_local_ray_slots(config)            # a job that would wait forever for Ray CPU slots
        cfg = prepare_verl_config(config, announce_where=WHERE, worker_env={WATCH_ENV: watch_id})
        watchdog = stall_watchdog(cfg, watch_id)
        try:
            verl_main.main.__wrapped__(config)     # verl's main body, on the already-composed config
        except Exception as e:
            why = ray_start_failure(e)             # Ray's own message names no cause
            if why:
                logging.getLogger("r3bridge").error("r3bridge (%s, pid %d): %s", WHERE, os.getpid(), why)
            raise
        finally:
            if watchdog is not None:
                watchdog.stop()

    sys.argv = [sys.argv[0], *rewrite_overrides(sys.argv[1:])]
    _main()


if __name__ == "__main__":
    main()

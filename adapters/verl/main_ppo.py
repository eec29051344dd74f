"""``python -m r3bridge.adapters.verl.main_ppo`` = verl's ``main_ppo`` plus the ``r3bridge`` section.

Takes exactly verl's hydra overrides, plus ``r3bridge.<option>=...`` (passed to hydra as
``++r3bridge.*``: :func:`section_overrides`). Before verl is imported and before Ray starts it
refuses, in one ``error:`` line each, a bad ``R3BRIDGE_*`` environment, a bad ``r3bridge`` section
and a local Ray cluster too small for what verl holds (:mod:`.placement`); it validates the whole
job config (one ``ConfigError`` listing every problem), announces the mode and forwards the section
to every worker (:func:`~r3bridge.adapters.verl.config.prepare_verl_config`), then runs verl's own
``main`` with a stall watchdog over :data:`STAGES` (:class:`~r3bridge.adapters.verl.watch.RayJobWatch`).
docs/use-with-verl.md.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Callable, Sequence

from r3bridge.adapters.verl.watch import RayJobWatch, Stage
from r3bridge.config import check_environment
from r3bridge.errors import ConfigError
from r3bridge.launch import refuse, refusing_section_errors

__all__ = ["main", "STAGES", "WHERE", "section_overrides", "run_hydra_job"]

WHERE = "verl launcher"
# what verl's job does between the launch and r3bridge's first pass, as the workers report it
# (r3bridge.adapters.verl.watch.report in the engine)
STAGES = (
    Stage("worker start", "Ray to place verl's TaskRunner, TransferQueue and worker groups, and verl's actor worker "
          "to build the model with r3bridge's engine (engine_ready)", "engine_ready"),
    Stage("first replayed pass", "the first rollout, then the first compute_log_prob / update pass through "
          "r3bridge's engine (the rollout engine generating, the agent loop and reward workers)", "first_pass"),
)
# what to change when Ray cannot place verl's actors
RAY_HINTS = {
    "CPU": "give Ray more CPU slots (verl: ray_kwargs.ray_init.num_cpus=N; logical slots, more than the machine's "
           "cores is fine) or ask for fewer (verl's TransferQueue takes one per storage unit: "
           "transfer_queue.backend.SimpleStorage.num_data_storage_units=1)",
    "GPU": "the job asks for more GPUs than the cluster has (verl: trainer.n_gpus_per_node x trainer.nnodes)",
}


def section_overrides(argv: Sequence[str], section: str = "r3bridge") -> list[str]:
    """``r3bridge.x=y`` / ``+r3bridge.x=y`` -> ``++r3bridge.x=y`` (hydra's add-or-override, which
    works whether or not the composed config already has the section); everything else unchanged."""
    prefixes = (f"{section}.", f"{section}=")
    out = []
    for arg in argv:
        bare = arg.lstrip("+")
        out.append(f"++{bare}" if bare.startswith(prefixes) and len(arg) - len(bare) <= 2 else arg)
    return out


def run_hydra_job(config_dir: str, config_name: str, body: Callable[[Any], None]) -> None:
    """``body(config)`` on the config hydra composes from ``config_dir`` / ``config_name`` and this
    process's command line (:func:`section_overrides` applied), as verl's own ``@hydra.main`` would."""
    import hydra

    sys.argv = [sys.argv[0], *section_overrides(sys.argv[1:])]
    hydra.main(config_path=config_dir, config_name=config_name, version_base=None)(body)()


def verl_config_dir() -> str:
    """verl's ``trainer/config`` folder, found without importing verl (its import is heavy)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        refuse("verl is not installed in this Python (pip install 'r3bridge[verl]'; docs/use-with-verl.md)")
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer", "config")


def main() -> None:
    try:
        check_environment()                       # a mistyped R3BRIDGE_* name or value, before anything starts
    except ConfigError as e:
        refuse(f"{type(e).__name__}: {e}")
    from r3bridge.versions import check_release

    check_release("verl", what="'s verl launcher")

    def run(config) -> None:
        from r3bridge.adapters.verl.config import prepare_verl_config, resolve_verl_options
        from r3bridge.adapters.verl.placement import check_local_ray_slots

        with refusing_section_errors("r3bridge"):
            resolve_verl_options(config)          # the section's keys and values, before verl's imports
            check_local_ray_slots(config)         # a job that would wait forever for Ray CPU slots
        import verl.trainer.main_ppo as verl_main

        from r3bridge.versions import check_internals

        # verl's main body, without its own @hydra.main wrapper (this launcher composes the config)
        check_internals("verl", [("verl.trainer.main_ppo.main.__wrapped__", verl_main.main, "__wrapped__")])
        with RayJobWatch(WHERE, STAGES, RAY_HINTS) as watch:
            watch.start(prepare_verl_config(config, announce_where=WHERE, worker_env=watch.worker_env))
            verl_main.main.__wrapped__(config)   # verl's main body, on the already-composed config

    run_hydra_job(verl_config_dir(), "ppo_trainer", run)


if __name__ == "__main__":
    main()

"""``python -m r3bridge.adapters.verl.main_ppo`` = verl's ``main_ppo`` plus the ``r3bridge`` section.

Takes exactly verl's hydra overrides, plus ``r3bridge.<option>=...`` (passed to hydra as
``++r3bridge.*``). Before Ray starts it validates the whole job config (one ``ConfigError`` listing
every problem), announces the mode and forwards the section to every worker
(:func:`~r3bridge.adapters.verl.config.prepare_verl_config`), then runs verl's own ``main``, with a
stall watchdog over :data:`STAGES` (:class:`r3bridge.launch.RayJobWatch`). docs/use-with-verl.md.
"""
from __future__ import annotations

import os

from r3bridge.launch import RayJobWatch
from r3bridge.launch.hydra_job import run_hydra_job
from r3bridge.launch.watchdog import Stage

__all__ = ["main", "STAGES", "WHERE"]

WHERE = "verl launcher"
# what verl's job does between the launch and r3bridge's first pass, as the workers report it
# (r3bridge.launch.ray_watch.report in the engine)
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


def main() -> None:
    import verl.trainer.main_ppo as verl_main

    from r3bridge.adapters.verl.config import check_local_ray_slots, prepare_verl_config
    from r3bridge.versions import check_internals, check_release

    check_release("verl", what="'s verl launcher")
    # verl's main body, without its own @hydra.main wrapper (this launcher composes the config)
    check_internals("verl", [("verl.trainer.main_ppo.main.__wrapped__", verl_main.main, "__wrapped__")])

    def run(config) -> None:
        with RayJobWatch(WHERE, STAGES, RAY_HINTS) as watch:
            check_local_ray_slots(config)        # a job that would wait forever for Ray CPU slots
            watch.start(prepare_verl_config(config, announce_where=WHERE, worker_env=watch.worker_env))
            verl_main.main.__wrapped__(config)   # verl's main body, on the already-composed config

    run_hydra_job(os.path.join(os.path.dirname(verl_main.__file__), "config"), "ppo_trainer", run)


if __name__ == "__main__":
    main()

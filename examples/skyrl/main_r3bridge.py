"""SkyRL 0.3 entry point with r3bridge: SkyRL's own ``main_base`` with three subclasses swapped in.

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=examples.skyrl.main_r3bridge <overrides>
    # or: python examples/skyrl/main_r3bridge.py <overrides>

The ``r3bridge`` section travels as ``R3BRIDGE_CONFIG`` / ``R3BRIDGE_REPLAY_MODE`` (set it in the
shell and in ``runtime_env`` for the Ray workers; run_r3.sh / run_r2.sh do both).
"""
from __future__ import annotations

import sys

import ray

from r3bridge.adapters.skyrl import FirstSeenRoutesMixin, TrainerMixin, policy_worker_class, replay_config
from r3bridge.adapters.skyrl._compat import import_skyrl

main_base = import_skyrl("skyrl.train.entrypoints.main_base")
SkyRLGymGenerator = import_skyrl("skyrl.train.generators.skyrl_gym_generator").SkyRLGymGenerator
resolve_policy_model_name = import_skyrl("skyrl.backends.skyrl_train.inference_servers.utils").resolve_policy_model_name


class Generator(FirstSeenRoutesMixin, SkyRLGymGenerator):
    """First-seen multi-turn routes instead of SkyRL's last-turn overwrite."""


class Trainer(TrainerMixin, main_base.RayPPOTrainer):
    """R2: the routes recorded in compute_log_prob go back into the TrainingInputBatch."""

    def build_models(self, PolicyWorker, CriticWorker, RefWorker):
        super().build_models(policy_worker_class(self.r3_config), CriticWorker, RefWorker)


class Exp(main_base.BasePPOExp):
    def get_generator(self, cfg, tokenizer, inference_engine_client):
        return Generator(generator_cfg=cfg.generator, skyrl_gym_cfg=cfg.environment.skyrl_gym,
                         inference_engine_client=inference_engine_client, tokenizer=tokenizer,
                         policy_model_name=resolve_policy_model_name(cfg))

    def get_trainer(self, cfg, tracker, tokenizer, train_dataset, eval_dataset, inference_engine_client,
                    generator, colocate_pg):
        t = Trainer(cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset,
                    eval_dataset=eval_dataset, inference_engine_client=inference_engine_client,
                    generator=generator, colocate_pg=colocate_pg)
        t.r3_config = replay_config()
        return t


@ray.remote(num_cpus=1)
def entrypoint(cfg):
    Exp(cfg).run()


def main() -> None:
    cfg = main_base.SkyRLTrainConfig.from_cli_overrides(
        [a for a in sys.argv[1:] if not a.startswith("trainer.override_entrypoint=")])
    main_base.validate_cfg(cfg)
    main_base.initialize_ray(cfg)
    ray.get(entrypoint.remote(cfg))


if __name__ == "__main__":
    main()

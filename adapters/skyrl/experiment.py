"""SkyRL's own ``main_base`` with three subclasses swapped in: the job r3bridge's launcher
(:mod:`.main`) runs once its checks passed. Importing this module imports SkyRL's entry point (its
trainer, dataset, inference client and Ray): copy it to customise the subclasses.
docs/use-with-skyrl.md, "What it adds".
"""
from __future__ import annotations

from typing import Sequence

import ray

from r3bridge.adapters.skyrl import FirstSeenRoutesMixin, TrainerMixin, policy_worker_class, ref_worker_class
from r3bridge.adapters.skyrl._compat import import_skyrl, skyrl_release
from r3bridge.adapters.skyrl.config import SECTION, parse_cli, prepare_skyrl_config
from r3bridge.errors import ConfigError
from r3bridge.launch import refusing_section_errors

__all__ = ["Generator", "Trainer", "Exp", "entrypoint", "run"]

# the generator first: on Python 3.11 import_skyrl must skip skyrl.train.generators' __init__ (its
# VLM generator's pydantic chain), which main_base imports from
SkyRLGymGenerator = import_skyrl("skyrl.train.generators.skyrl_gym_generator").SkyRLGymGenerator
main_base = import_skyrl("skyrl.train.entrypoints.main_base")
resolve_policy_model_name = import_skyrl("skyrl.backends.skyrl_train.inference_servers.utils").resolve_policy_model_name


class Generator(FirstSeenRoutesMixin, SkyRLGymGenerator):
    """First-seen multi-turn routes instead of SkyRL's last-turn overwrite."""


class Trainer(TrainerMixin, main_base.RayPPOTrainer):
    """R2: the routes recorded in compute_log_prob go back into the TrainingInputBatch; the
    reference worker declares its model the reference (it never replays)."""

    def build_models(self, PolicyWorker, CriticWorker, RefWorker):
        ref = ref_worker_class() if RefWorker is not None else None
        super().build_models(policy_worker_class(self.r3_config), CriticWorker, ref)


class Exp(main_base.BasePPOExp):
    def get_generator(self, cfg, tokenizer, inference_engine_client):
        if skyrl_release() == "0.4":     # its own generator keeps first-seen routes (RoutedExpertTrace)
            return super().get_generator(cfg, tokenizer, inference_engine_client)
        if cfg.generator.vision_language_generator:
            raise ConfigError("SkyRL 0.3's VLM generator overwrites earlier turns' routes and r3bridge's first-seen "
                              "generator is its text one: generator.vision_language_generator needs SkyRL 0.4")
        return Generator(generator_cfg=cfg.generator, skyrl_gym_cfg=cfg.environment.skyrl_gym,
                         inference_engine_client=inference_engine_client, tokenizer=tokenizer,
                         policy_model_name=resolve_policy_model_name(cfg))

    def get_trainer(self, cfg, tracker, tokenizer, train_dataset, eval_dataset, inference_engine_client,
                    generator, colocate_pg):
        t = Trainer(cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset,
                    eval_dataset=eval_dataset, inference_engine_client=inference_engine_client,
                    generator=generator, colocate_pg=colocate_pg)
        t.r3_config = cfg.trainer.r3bridge          # filled by prepare_skyrl_config
        return t


@ray.remote(num_cpus=1)
def entrypoint(cfg):
    Exp(cfg).run()


def run(argv: Sequence[str]) -> None:
    """SkyRL's parser, r3bridge's contradictions (one line each, before Ray), SkyRL's ``validate_cfg``,
    then SkyRL's job on Ray."""
    with refusing_section_errors(SECTION):     # a bad trainer.r3bridge value or contradiction: one line
        cfg = parse_cli(argv)
        prepare_skyrl_config(cfg, argv)        # merged with R3BRIDGE_CONFIG; announced by the launcher
        main_base.validate_cfg(cfg)
    main_base.initialize_ray(cfg)
    ray.get(entrypoint.remote(cfg))

"""SkyRL 0.3 / 0.4 entry point with r3bridge: SkyRL's own ``main_base`` with three subclasses swapped in
and the ``trainer.r3bridge`` section on SkyRL's command line.

    python -m r3bridge.adapters.skyrl.main trainer.r3bridge.replay_mode=R3 <SkyRL's overrides>

The launcher's steps (:mod:`r3bridge.launch.steps`) with SkyRL's parser (:func:`.config.skyrl_config_class`),
SkyRL's own checks and :func:`cannot_start`; the section reaches the workers inside the policy worker class.
docs/use-with-skyrl.md, "What runs where".
"""
from __future__ import annotations

import platform
import sys
from typing import Any, Optional

import ray

from r3bridge.adapters.skyrl import FirstSeenRoutesMixin, TrainerMixin, policy_worker_class, ref_worker_class
from r3bridge.adapters.skyrl._compat import import_skyrl, skyrl_release
from r3bridge.adapters.skyrl.config import SECTION, parse_cli, prepare_skyrl_config
from r3bridge.errors import ConfigError
from r3bridge.launch import refuse, refusing_section_errors
from r3bridge.launch.requirements import Requirement, unmet

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


_WORKERS_NEED = (
    # skyrl.backends' __init__ -> skyrl.tinker.types: pydantic models over typing.TypedDict, which
    # pydantic refuses before 3.12; every Ray worker imports SkyRL's classes the normal way
    Requirement(f"SkyRL's package does not import on Python {platform.python_version()} (pydantic: \"Please use "
                "typing_extensions.TypedDict instead of typing.TypedDict on Python < 3.12\", from "
                "skyrl.tinker.types), and its Ray workers import it", python=(3, 12)),
    # megatron_worker.py imports AutoBridge at module level; SkyRL 0.3/0.4's megatron extra declares
    # megatron-bridge for Python >= 3.12 only
    Requirement("SkyRL's Megatron worker imports megatron.bridge (Megatron-Bridge), which is not installed; "
                "SkyRL's `megatron` extra installs it on Python >= 3.12 only", module="megatron.bridge"),
)


def cannot_start(cfg: Any) -> Optional[str]:
    """Why SkyRL's Megatron workers cannot start in this environment (``None``: they can), said in the
    launcher before Ray starts them: otherwise each Ray worker dies on its first SkyRL import."""
    if cfg.trainer.strategy != "megatron":
        return None
    return unmet(_WORKERS_NEED, lead="SkyRL's Megatron job cannot start here", remedy="Run it on Python 3.12 in "
                 "SkyRL's training environment (pip install \"skyrl[megatron]\"); docs/use-with-skyrl.md, \"Install\"")


def main() -> None:
    argv = sys.argv[1:]
    with refusing_section_errors(SECTION):     # a bad trainer.r3bridge key or value: one line, before Ray
        cfg = parse_cli(argv)
        prepare_skyrl_config(cfg, argv, announce_where="SkyRL launcher")   # merged with R3BRIDGE_CONFIG
        main_base.validate_cfg(cfg)
    problem = cannot_start(cfg)
    if problem:
        refuse(problem)
    main_base.initialize_ray(cfg)
    ray.get(entrypoint.remote(cfg))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# R3 with SkyRL 0.3 on the Megatron backend: replay vLLM's routes in every trainer forward.
# Model / data / parallelism are SkyRL's usual overrides; only the lines marked r3bridge matter here.
set -euo pipefail
export R3BRIDGE_REPLAY_MODE=R3                                   # r3bridge: the replay_mode key
MODEL=${MODEL:-Qwen/Qwen3-30B-A3B}
python -m skyrl.train.entrypoints.main_base \
  trainer.override_entrypoint=examples.skyrl.main_r3bridge \
  trainer.strategy=megatron \
  trainer.policy.model.path="$MODEL" \
  trainer.policy.megatron_config.tensor_model_parallel_size=2 \
  trainer.policy.megatron_config.pipeline_model_parallel_size=2 \
  trainer.policy.megatron_config.expert_model_parallel_size=4 \
  trainer.policy.megatron_config.moe_enable_routing_replay=true \
  trainer.remove_microbatch_padding=true \
  generator.inference_engine.enable_return_routed_experts=true \
  generator.inference_engine.distributed_executor_backend=mp \
  "$@"
# moe_enable_routing_replay=true only satisfies SkyRL's config check: r3bridge's PolicyWorkerMixin
# builds the model with megatron's own replay off and drives its own hook.
# Ray workers need R3BRIDGE_REPLAY_MODE too: export it before `ray start` (workers inherit the
# raylet's environment) or put it in your cluster's runtime_env.env_vars.
# VPP: set the virtual pipeline size the way your SkyRL provider takes it
# (trainer.policy.megatron_config.transformer_config_kwargs) and keep remove_microbatch_padding=true.

#!/usr/bin/env bash
# R3 with SkyRL 0.3 on the Megatron backend: replay vLLM's routes in every trainer forward.
# Model / data / parallelism are SkyRL's usual overrides; only the lines marked r3bridge matter here.
# Runs from any folder (the entry point ships with r3bridge). One node of 8 GPUs; add SkyRL's data,
# logger and batch-size overrides as usual (they pass through "$@").
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-30B-A3B}
python -m r3bridge.adapters.skyrl.main \
  trainer.r3bridge.replay_mode=R3 \
  trainer.strategy=megatron \
  trainer.policy.model.path="$MODEL" \
  trainer.placement.policy_num_gpus_per_node=8 \
  trainer.placement.ref_num_gpus_per_node=8 \
  trainer.policy.megatron_config.tensor_model_parallel_size=2 \
  trainer.policy.megatron_config.pipeline_model_parallel_size=2 \
  trainer.policy.megatron_config.expert_model_parallel_size=4 \
  trainer.ref.megatron_config.tensor_model_parallel_size=2 \
  trainer.ref.megatron_config.pipeline_model_parallel_size=2 \
  trainer.ref.megatron_config.expert_model_parallel_size=4 \
  generator.inference_engine.num_engines=4 \
  generator.inference_engine.tensor_parallel_size=2 \
  trainer.remove_microbatch_padding=true \
  generator.inference_engine.enable_return_routed_experts=true \
  generator.inference_engine.distributed_executor_backend=mp \
  "$@"
# trainer.r3bridge.* is r3bridge's section on SkyRL's own command line (a typed field of SkyRL's
# TrainerConfig, parsed by SkyRL's parser: a mistyped key is refused). The section reaches the Ray
# workers inside the policy worker class; no environment variable is needed.
# SkyRL's config check wants trainer.policy.megatron_config.moe_enable_routing_replay=true whenever
# routed experts are returned: r3bridge's entry point sets it for that check (its worker builds the
# model with megatron's own replay off either way), so you do not.
# VPP: set the virtual pipeline size the way your SkyRL provider takes it
# (trainer.policy.megatron_config.transformer_config_kwargs) and keep remove_microbatch_padding=true.

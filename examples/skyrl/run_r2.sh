#!/usr/bin/env bash
# R2 with SkyRL 0.3: record the trainer's routes in compute_log_prob, replay them in every update.
# Runs from any folder (the entry point ships with r3bridge). One node of 8 GPUs; add SkyRL's data,
# logger and batch-size overrides as usual (they pass through "$@").
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-30B-A3B}
python -m r3bridge.adapters.skyrl.main \
  trainer.r3bridge.replay_mode=R2 \
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
  generator.inference_engine.enable_return_routed_experts=false \
  "$@"
# R2 needs the old-log-prob forward: keep a policy loss that uses it (not one that only uses
# rollout log-probs), and several mini-batches per step (train_batch_size > policy_mini_batch_size)
# for R2 to matter (arXiv 2512.01374).

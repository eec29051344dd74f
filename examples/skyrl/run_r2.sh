#!/usr/bin/env bash
# R2 with SkyRL 0.3: record the trainer's routes in compute_log_prob, replay them in every update.
set -euo pipefail
export R3BRIDGE_REPLAY_MODE=R2                                   # r3bridge: the replay_mode key
MODEL=${MODEL:-Qwen/Qwen3-30B-A3B}
python -m skyrl.train.entrypoints.main_base \
  trainer.override_entrypoint=examples.skyrl.main_r3bridge \
  trainer.strategy=megatron \
  trainer.policy.model.path="$MODEL" \
  trainer.policy.megatron_config.tensor_model_parallel_size=2 \
  trainer.policy.megatron_config.pipeline_model_parallel_size=2 \
  trainer.policy.megatron_config.expert_model_parallel_size=4 \
  trainer.policy.megatron_config.moe_enable_routing_replay=false \
  trainer.remove_microbatch_padding=true \
  generator.inference_engine.enable_return_routed_experts=false \
  "$@"
# R2 needs the old-log-prob forward: keep a policy loss that uses it (not one that only uses
# rollout log-probs), and several mini-batches per step (train_batch_size > policy_mini_batch_size)
# for R2 to matter (arXiv 2512.01374).

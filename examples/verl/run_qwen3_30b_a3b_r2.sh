#!/usr/bin/env bash
# R2: record the trainer's own experts in compute_log_prob (weights theta_old) and replay them in
# every update mini-batch of the step. Needs the old-log-prob forward (bypass_mode=False) and no
# rollout routes (enable_rollout_routing_replay=False): the adapter refuses anything else.
set -euo pipefail
source "$(dirname "$0")/common.sh"

python3 -m r3bridge.adapters.verl.main_ppo "${COMMON_ARGS[@]}" \
    r3bridge.replay_mode=R2 \
    actor_rollout_ref.rollout.enable_rollout_routing_replay=False \
    algorithm.rollout_correction.bypass_mode=False \
    trainer.experiment_name=qwen3_30b_a3b_r2 \
    "$@"

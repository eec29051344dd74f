#!/usr/bin/env bash
# R3: replay the experts vLLM chose while sampling, in compute_log_prob and in every update.
# Needs vLLM >= 0.22 (verl checks it) returning routed experts; r3bridge must be installed
# (pip install ".[verl]" in the r3bridge checkout), which registers the adapter through verl's plugin entry point.
set -euo pipefail
source "$(dirname "$0")/common.sh"

python3 -m r3bridge.adapters.verl.main_ppo "${COMMON_ARGS[@]}" \
    r3bridge.replay_mode=R3 \
    actor_rollout_ref.rollout.enable_rollout_routing_replay=True \
    algorithm.rollout_correction.rollout_is=token \
    algorithm.rollout_correction.rollout_is_threshold=2.0 \
    trainer.experiment_name=qwen3_30b_a3b_r3 \
    "$@"

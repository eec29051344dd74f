#!/usr/bin/env bash
# R3 with AReaL 1.0 (SPMD, local launcher). R2: R3BRIDGE_REPLAY_MODE=R2 and rollout.return_routed_experts=false.
set -euo pipefail
export R3BRIDGE_REPLAY_MODE=${R3BRIDGE_REPLAY_MODE:-R3}
python3 -m areal.infra.launcher.local examples/areal/gsm8k_r3bridge.py \
  --config examples/areal/gsm8k_megatron.yaml "$@"

#!/usr/bin/env bash
# R3 with AReaL 1.0 (SPMD, local launcher). R2: append r3bridge.replay_mode=R2 rollout.return_routed_experts=false.
# The paths are the example's own, so this runs from any folder.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
python3 -m areal.infra.launcher.local "$HERE/gsm8k_r3bridge.py" --config "$HERE/gsm8k_megatron.yaml" "$@"

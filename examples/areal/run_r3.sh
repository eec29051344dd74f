#!/usr/bin/env bash
# R3 with AReaL 1.0 (SPMD): AReaL's local launcher, after r3bridge's checks (the replay mode announced at
# launch; what the launcher would fail on late or wait for silently, refused in one line each).
# R2: append r3bridge.replay_mode=R2 rollout.return_routed_experts=false (the YAML recomputes log-probs:
# compute_logp records the routes R2 replays).
# The paths are the example's own, so this runs from any folder.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
python3 -m r3bridge.adapters.areal.launch "$HERE/gsm8k_r3bridge.py" --config "$HERE/gsm8k_megatron.yaml" "$@"

#!/usr/bin/env bash
# The evidence run on the device machine (docs/evidence.md): off / R2 / R3 x 3 seeds + the noise
# floor, GRPO on one GPU, in the background, bounded in wall-clock time.
#
#   bash scripts/gpu/evidence.sh smoke            one R3 arm, 3 steps, in the foreground (about 1.5 min): vLLM
#                                                 in-process, the weight sync and the routes work here
#   bash scripts/gpu/evidence.sh start [ARGS...]  start it (setsid nohup) and return after its first lines;
#                                                 ARGS go to `r3bridge evidence run` (default: the docs' run)
#   bash scripts/gpu/evidence.sh status           the orchestrator's last lines and the steps per arm
#   bash scripts/gpu/evidence.sh collect          into $OUT/evidence: the logs gzipped, run.json, the arms'
#                                                 statuses, the warm start's stats, the figure and the table
#
# Needs megatron-core 0.16.1, transformers and vLLM 0.24.0 importable: after `bundle.sh install` of
# the base and vllm sets (scripts/gpu/bundle.sh; scripts/gpu/wheels/vllm.txt), which puts the vllm set in
# /tmp/site-vllm; EXTRA_PYTHONPATH overrides that folder. The run lives in $RUN (default
# ~/evidence), outside $OUT, so the calls after `start` find it while the machine stays warm.
set -euo pipefail
RUN=${RUN:-$HOME/evidence}
EXTRA_PYTHONPATH=${EXTRA_PYTHONPATH-$(bash "$(dirname "$0")/bundle.sh" pythonpath vllm)}
export PYTHONPATH=${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}$PWD${PYTHONPATH:+:$PYTHONPATH}
# no network on the device: no usage report, no hub look-up (the model folder is local, tokenizer-free)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
versions() {
  python -c "import torch, vllm, transformers, megatron.core as m; print('torch', torch.__version__, 'vllm', \
vllm.__version__, 'transformers', transformers.__version__, 'megatron-core', m.__version__, \
torch.cuda.get_device_name(0))"
}
case "${1:-}" in
smoke)
  mkdir -p "$RUN"; versions
  timeout 240 python -m r3bridge evidence run --out "$RUN/smoke" --engine vllm --device cuda --seeds 0 --modes R3 \
    --no-floor --steps 3 --sft-steps 200 --wall-s 200 --json || { tail -n 40 "$RUN"/smoke/procs/0.log; exit 1; }
  python -c "import json, sys; [print(json.loads(l)) for l in open(sys.argv[1])]" "$RUN/smoke/logs/R3-s0.jsonl" ;;
start)
  shift
  [ $# -gt 0 ] || set -- --engine vllm --device cuda --seeds 0,1,2 --steps 300 --wall-s 660
  mkdir -p "$RUN"
  versions | tee "$RUN/versions.txt"
  setsid nohup python -m r3bridge evidence run --out "$RUN/run" "$@" > "$RUN/orchestrator.log" 2>&1 < /dev/null &
  echo "$!" > "$RUN/pid"
  sleep 45
  tail -n 5 "$RUN/orchestrator.log"; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv || true ;;
status)
  tail -n 3 "$RUN/orchestrator.log"
  for f in "$RUN"/run/logs/*.jsonl; do [ -e "$f" ] && echo "$(basename "$f" .jsonl): $(wc -l < "$f") steps"; done
  for f in "$RUN"/run/procs/*.log; do grep -q Traceback "$f" && { echo "== $f"; tail -n 4 "$f"; }; done || true
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader || true ;;
collect)
  dest=${OUT:-.}/evidence; mkdir -p "$dest"
  for f in "$RUN"/run/logs/*.jsonl; do gzip -9c "$f" > "$dest/$(basename "$f").gz"; done
  cp "$RUN"/run/logs/*.json "$RUN/run/run.json" "$RUN/versions.txt" "$dest/"
  cp "$RUN/run/warmstart/stats.json" "$dest/warmstart.json" 2>/dev/null || true
  tail -n 40 "$RUN/orchestrator.log" > "$dest/orchestrator.tail.txt"
  for f in "$RUN"/run/procs/*.log; do tail -n 20 "$f" > "$dest/proc$(basename "$f" .log).tail.txt"; done
  python -m r3bridge evidence plot "$RUN/run" --out "$dest/evidence.png" | tee "$dest/table.md"
  du -sh "$dest" ;;
*) sed -n 2,16p "$0"; exit 2 ;;
esac

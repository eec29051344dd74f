#!/usr/bin/env bash
# The evidence run on the device machine (docs/evidence.md): a calibration of candidate models,
# then the 13 arms of issue 49 (off / R2 / R3 / R3w x 2 seeds, the noise floor, R2 / R3 at 1 and 8
# mini-batches), GRPO on one GPU, in the background, bounded in wall-clock time.
#
#   bash scripts/gpu/evidence.sh smoke            one R3 arm, 3 steps, in the foreground (about 1.5 min): vLLM
#                                                 in-process, the weight sync and the routes work here
#   bash scripts/gpu/evidence.sh start [ARGS...]  start it (setsid nohup) and return after its first lines;
#                                                 ARGS go to `r3bridge evidence run` (default: $DEFAULT_ARGS below:
#                                                 calibration, then the issue-49 arms, 300 steps, 1080 s in all)
#   bash scripts/gpu/evidence.sh start-from WARMDIR ARM...
#                                                 a later session: the same as start, from an earlier session's
#                                                 warm start (collect's evidence/warmstart, carried here), no
#                                                 calibration, only the ARMs named (e.g. off-s1 R2-s1 R3-s1; or
#                                                 one comma-separated word), with the same settings ($SESSION_ARGS,
#                                                 --wall-s $WALL_S, and the trainer dtype and GRPO router losses of
#                                                 WARMDIR/../run.json where collect put one, unless SESSION_ARGS
#                                                 names them); the model and task are the warm start's
#   bash scripts/gpu/evidence.sh status           the orchestrator's last lines, the calibration, and per arm its
#                                                 steps, route agreement (last 20 steps) and pace against the wall
#   bash scripts/gpu/evidence.sh wait [SECONDS]   status every 60 s until the run ends or SECONDS (default 540) pass
#   bash scripts/gpu/evidence.sh collect          into $OUT (what comes back from the device: at most 8 files of
#                                                 16 MiB, 64 MiB in all): evidence.tar.gz (the logs, run.json, the
#                                                 arms' statuses, the calibration, the figure and the table, the warm
#                                                 start's stats.json / spec.json) and the warm start's fp32 state.pt in
#                                                 15 MiB parts warm-state.pt.NN when it fits (the default candidates'
#                                                 are 38.4-56.4 MiB; L8-E64-k8 99.3: not collected). After a
#                                                 calibrate-only run the warm start is the chosen candidate's
#   bash scripts/gpu/evidence.sh unpack FROM DEST here: FROM = the call's files_at folder; DEST/evidence (the run's
#                                                 files) and DEST/evidence/warmstart (state.pt joined, its sha256
#                                                 checked against spec.json): carry DEST/evidence/warmstart later
#
# The device machine goes back 30 s after a call ends, and the background run with it: make the
# calls back to back, each under 590 s, e.g. (about 25 min of device time in all):
#   1. the bundle's install call:  bash scripts/gpu/bundle.sh install DIR/qN && bash scripts/gpu/evidence.sh start
#   2.                             bash scripts/gpu/evidence.sh wait 560
#   3.                             bash scripts/gpu/evidence.sh wait 520; bash scripts/gpu/evidence.sh collect
# More arms than one session's 30 min of device time hold (issue 49's 13 x 300 steps side by side take
# about 30 min): the first session runs a few arms (start ... --arms off-s0,R2-s0,R3-s0,...) and collects;
# its evidence/warmstart is carried to the next ones (a git-ignored folder, `carry`), which run
#   bash scripts/gpu/bundle.sh install DIR/qN && bash scripts/gpu/evidence.sh start-from WARMDIR off-s1 R2-s1 ...
# then wait / collect as above; `r3bridge evidence report S1/evidence S2/evidence ...` merges the
# sessions' arms into one table (refused if their warm starts or settings differ). The device's copy
# of the tree has no .git, or an older one: set R3BRIDGE_COMMIT=<commit> on the command line so
# run.json says which code ran.
#
# Needs megatron-core 0.16.1, transformers and vLLM 0.24.0 importable: after `bundle.sh install` of
# the base, ray, verl and vllm sets (scripts/gpu/bundle.sh; megatron-core 0.16.1 and pydantic come
# with `base`; `te` only for --spec te), which puts the vllm set in /tmp/site-vllm; EXTRA_PYTHONPATH
# overrides that folder. The run lives in $RUN (default ~/evidence), outside $OUT, so the calls
# after `start` find it while the machine stays warm.
set -euo pipefail
RUN=${RUN:-$HOME/evidence}
# the settings every session's arms share (the report refuses to merge arms run with others)
SESSION_ARGS=${SESSION_ARGS:-"--engine vllm --device cuda --steps 300"}
DEFAULT_ARGS="$SESSION_ARGS --calibrate --arms issue49 --calib-wall-s 300 --wall-s 1080"
WALL_S=${WALL_S:-1080}
WARM_MAX_BYTES=$((60 * 1024 * 1024))   # a file coming back through $OUT must stay well under 64 MiB
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
start|start-from)
  if [ "$1" = start-from ]; then
    [ $# -ge 3 ] || { echo "usage: $0 start-from WARMDIR ARM..." >&2; exit 2; }
    warm=$2; shift 2
    arms=$(IFS=,; echo "$*")
    # the trainer dtype and GRPO router losses the earlier session's arms ran with (a calibration may
    # choose an -fp32 candidate): collect puts run.json beside warmstart/; the report refuses arms
    # whose settings differ
    same=$(python -c "import json, sys; g = json.load(open(sys.argv[1]))['grpo']; \
print('--trainer-dtype', g['trainer_dtype'], '--grpo-router-losses', g.get('router_losses', 0.0))" \
      "$warm/../run.json" 2>/dev/null || true)
    [ -n "$same" ] && echo "start-from: $same (from $warm/../run.json; SESSION_ARGS override it)"
    # shellcheck disable=SC2086   # argparse keeps an option's last value: SESSION_ARGS after them win
    set -- $same $SESSION_ARGS --warm-start "$warm" --arms "$arms" --wall-s "$WALL_S"
  else
    shift
    # shellcheck disable=SC2086
    [ $# -gt 0 ] || set -- $DEFAULT_ARGS
  fi
  mkdir -p "$RUN"
  versions | tee "$RUN/versions.txt"
  echo "r3bridge evidence run --out $RUN/run $*" | tee -a "$RUN/versions.txt"
  setsid nohup python -m r3bridge evidence run --out "$RUN/run" "$@" > "$RUN/orchestrator.log" 2>&1 < /dev/null &
  echo "$!" > "$RUN/pid"
  sleep 45
  tail -n 5 "$RUN/orchestrator.log"; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv || true ;;
status)
  grep '\[calibrate\]' "$RUN/orchestrator.log" | tail -n 8 || true
  tail -n 3 "$RUN/orchestrator.log"
  # per arm: steps, route agreement of the last 20 steps (stop the run if off's is above 0.95 by
  # step ~60) and pace against the run's wall (r3bridge/demo/evidence_report.py: progress)
  [ -d "$RUN/run/logs" ] && { python -m r3bridge evidence status "$RUN/run" || true; }
  for f in "$RUN"/run/procs/*.log "$RUN"/run/calib/*/procs/*.log; do
    [ -e "$f" ] && grep -q Traceback "$f" && { echo "== $f"; tail -n 4 "$f"; }; done || true
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader || true ;;
wait)
  end=$(( $(date +%s) + ${2:-540} ))
  n=0
  while kill -0 "$(cat "$RUN/pid")" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do
    sleep 10; n=$((n + 1))
    [ $((n % 6)) -eq 0 ] && { echo "== $(date -u +%H:%M:%S)"; bash "$0" status; }
  done
  kill -0 "$(cat "$RUN/pid")" 2>/dev/null && echo "still running" || { echo "run ended"; tail -n 6 "$RUN/orchestrator.log"; } ;;
collect)
  out=${OUT:-.}; dest=$RUN/collect/evidence; rm -rf "$RUN/collect"; mkdir -p "$dest"
  for f in "$RUN"/run/logs/*.jsonl; do [ -e "$f" ] && gzip -9c "$f" > "$dest/$(basename "$f").gz"; done
  cp "$RUN"/run/logs/*.json "$RUN/run/run.json" "$RUN/versions.txt" "$dest/" 2>/dev/null || true
  ws="$RUN/run/warmstart"
  if [ -e "$RUN/run/calibration.json" ]; then       # the calibration: its choice and every candidate's numbers
    cp "$RUN/run/calibration.json" "$dest/"
    for d in "$RUN"/run/calib/*/; do
      c=$(basename "$d"); mkdir -p "$dest/calib/$c"
      cp "$d/warmstart/stats.json" "$dest/calib/$c/warmstart.json" 2>/dev/null || true
      gzip -9c "$d/logs/off-s0.jsonl" > "$dest/calib/$c/off-s0.jsonl.gz" 2>/dev/null || true
      tail -n 20 "$d/orchestrator.log" > "$dest/calib/$c/orchestrator.tail.txt" 2>/dev/null || true
    done
    chosen=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['chosen'])" "$RUN/run/calibration.json")
    [ -e "$ws/state.pt" ] || ws="$RUN/run/calib/$chosen/warmstart"   # calibrate-only: the chosen candidate's
  fi
  # the warm start for the later sessions (start-from): fp32 as the arms load it - bf16 would halve it
  # but round the fp32 main weights the trainer starts from, so a later session's arms would not
  # start where this session's did
  if [ -e "$ws/state.pt" ]; then
    mkdir -p "$dest/warmstart" && cp "$ws/stats.json" "$ws/spec.json" "$dest/warmstart/"
    size=$(stat -c %s "$ws/state.pt")
    if [ "$size" -lt "$WARM_MAX_BYTES" ]; then
      split -b 15M -d -a 2 "$ws/state.pt" "$out/warm-state.pt."
      echo "warm start collected ($ws): state.pt $((size / 1024)) KiB in $(ls "$out"/warm-state.pt.* | wc -l) parts, sha256 $(sha256sum "$ws/state.pt" | cut -c1-16)"
    else
      echo "warm start NOT collected: state.pt is $((size / 1024 / 1024)) MiB (at most 60 MiB come back through \$OUT)"
    fi
  fi
  tail -n 40 "$RUN/orchestrator.log" > "$dest/orchestrator.tail.txt"
  for f in "$RUN"/run/procs/*.log; do [ -e "$f" ] && tail -n 20 "$f" > "$dest/proc$(basename "$f" .log).tail.txt"; done
  ls "$RUN"/run/logs/*.jsonl > /dev/null 2>&1 \
    && { python -m r3bridge evidence plot "$RUN/run" --out "$dest/evidence.png" | tee "$dest/table.md" || true; }
  tar czf "$out/evidence.tar.gz" -C "$RUN/collect" evidence
  ls -l "$out" ;;
unpack)   # here, after the collect call: FROM = its files_at folder
  from=$2; dest=$3; mkdir -p "$dest"
  tar xzf "$from/evidence.tar.gz" -C "$dest"
  if ls "$from"/warm-state.pt.* > /dev/null 2>&1; then
    cat "$from"/warm-state.pt.* > "$dest/evidence/warmstart/state.pt"
    python3 - "$dest/evidence/warmstart" <<'PY'
import hashlib, json, sys, pathlib
d = pathlib.Path(sys.argv[1]); spec = json.loads((d / "spec.json").read_text())
got = hashlib.sha256((d / "state.pt").read_bytes()).hexdigest()
want = spec.get("state_sha256")
if got != want:
    sys.exit(f"unpack: state.pt sha256 {got[:16]} differs from spec.json's {str(want)[:16]}")
print(f"warm start {d}: sha256 {got[:16]} as spec.json says")
PY
  fi ;;
*) sed -n 2,40p "$0"; exit 2 ;;
esac

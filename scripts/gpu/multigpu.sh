#!/usr/bin/env bash
# Issue 41's runs on 2 or 4 GPUs as a few device calls (results: docs/gpu-results/multigpu_h200x2_2026-11-27/).
# Carry: `bundle.sh prepare DIR base te ray verl mcore19 skyrl04 areal`, stash every part but the last, then install
# and run back to back. Needs the bundle's sets installed (base, te, ray, verl into the interpreter; mcore19, skyrl04,
# areal into /tmp/site-SET). Every run has its own `timeout` and writes into $OUT/<stage>/ as soon as it ends, so a
# call cut short keeps what finished.
#
#   multigpu.sh p4          P4 on a quiet machine: --pp 2,4 (2 on two GPUs), verl's R2 path side by side,
#                           4 dynamic-bsz micro-batches, then 1 micro-batch (the 2026-11-23 shape); <= 3 min
#   multigpu.sh grid        the NCCL grid on TE specs, megatron-core 0.16.1 and 0.19.2 at once, two- and
#                           four-rank cells in lanes (scripts/gpu/nccl_grid.py), and at the same time
#                           SkyRL 0.4 / AReaL at two ranks and the cross-framework run (other lanes);
#                           <= GRID_DEADLINE (340 s)
#   multigpu.sh verl MODE.. verl's whole job (HF rollout backend) at every layout the GPUs allow, MODE
#                           in R3 / R2 (several: side by side): TP2 + SP and EP2 on GPU pairs, TP2 x PP2
#                           and TP2 x EP2 on four GPUs, every router row checked (verl_e2e.sh)   ~4 min
#   multigpu.sh summary     one line per result file under $OUT
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${OUT:-$repo/gpu_multigpu_out}
cd "$repo"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
all=$(seq -s, 0 $((ngpu - 1)))
M19=/tmp/site-mcore19

pair() {  # pair I: the I-th GPU pair (0,1 / 2,3 alternately on four GPUs; 0,1 on two)
  if [ "$ngpu" -ge 4 ] && [ $(($1 % 2)) -eq 1 ]; then echo 2,3; else echo 0,1; fi
}

bg() {  # bg DIR NAME SECONDS DEVICES CMD...: in the background, own timeout, log DIR/NAME.log
  local dir=$1 name=$2 t=$3 dev=$4; shift 4
  mkdir -p "$dir"
  ( CUDA_VISIBLE_DEVICES=$dev timeout -k 10 "$t" "$@" > "$dir/$name.log" 2>&1
    echo "$name rc=$? ($(date +%T))" >> "$dir/rc.txt" ) &
}

frameworks() {  # SkyRL 0.4 and AReaL at two ranks, the cross-framework rollout at tp2_sp and pp2_vpp2
  local d=$out/frameworks
  mkdir -p "$d"
  bg "$d" skyrl04_tp2_sp 330 "$(pair 0)" env PYTHONPATH=/tmp/site-skyrl04:$M19:$repo \
    python scripts/gpu/skyrl04_train.py --layout tp2_sp --out "$d/skyrl04_tp2_sp"
  bg "$d" skyrl04_pp2_vpp2 330 "$(pair 1)" env PYTHONPATH=/tmp/site-skyrl04:$M19:$repo \
    python scripts/gpu/skyrl04_train.py --layout pp2_vpp2 --out "$d/skyrl04_pp2_vpp2"
  bg "$d" areal_tp2_sp 330 "$(pair 0)" env PYTHONPATH=/tmp/site-areal:$repo \
    python scripts/gpu/areal_actor.py --layout tp2_sp --out "$d/areal_tp2_sp"
  bg "$d" areal_pp2_vpp2 330 "$(pair 1)" env PYTHONPATH=/tmp/site-areal:$repo \
    python scripts/gpu/areal_actor.py --layout pp2_vpp2 --out "$d/areal_pp2_vpp2"
  bg "$d" cross_framework 340 "$(pair 0)" env PYTHONPATH=$repo \
    python scripts/gpu/cross_framework.py --out "$d/cross_framework" --layouts tp2_sp,pp2_vpp2 \
    --path-skyrl /tmp/site-skyrl04:$M19 --path-areal /tmp/site-areal --timeout 300
}

verl_job() {  # verl_job MODE LAYOUT DEVICES ENV...
  # several Ray clusters on one host: each ray.init() starts its own (no RAY_ADDRESS, no `ray start`);
  # a small object store each (Ray's default takes 30% of the host's memory per cluster), no dashboard
  local mode=$1 label=$2 dev=$3; shift 3
  bg "$out/verl" "verl_${mode}_$label" $(( ${VERL_JOB_TIMEOUT:-450} + 50 )) "$dev" env "$@" R3E2E_TIMEOUT=${VERL_JOB_TIMEOUT:-450} R3E2E_WORK=/tmp/r3e2e_${mode}_$label \
    R3E2E_OVERRIDES="+ray_kwargs.ray_init.object_store_memory=4000000000 +ray_kwargs.ray_init.include_dashboard=False" \
    OUT="$out/verl" bash scripts/gpu/verl_e2e.sh run "$mode"
}

case "${1:-}" in
p4)
  mkdir -p "$out/p4"
  pp=2; [ "$ngpu" -ge 4 ] && pp=2,4
  (cd benchmarks && timeout -k 10 100 python p4_r2_gather.py --device cuda --pp $pp --micro-batches 4 --repeats 20 \
     --json > "$out/p4/p4_mb4.json" 2> "$out/p4/p4_mb4.log"; echo "p4 mb4 rc=$?")
  (cd benchmarks && timeout -k 10 80 python p4_r2_gather.py --device cuda --pp $pp --micro-batches 1 --repeats 20 \
     --json > "$out/p4/p4_mb1.json" 2> "$out/p4/p4_mb1.log"; echo "p4 mb1 rc=$?")
  python - "$out/p4" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/p4_mb*.json")):
    try:
        d = json.load(open(f))
    except ValueError:
        print(f, "no result"); continue
    for r in d["runs"]:
        t = {k: round(v * 1e3, 2) for k, v in r["median_s"].items()}
        print(f.split("/")[-1], f"pp{r['pp']} mb{r['micro_batches']}", t, f"vs verl {r['speedup_vs_verl_r2_path']:.1f}x",
              f"/floor {r['r3bridge_over_floor']:.1f}x", "ok" if r["result_ok"] else "RESULT WRONG")
PY
  ;;
grid)
  mkdir -p "$out/grid"
  [ "${SKIP_FRAMEWORKS:-0}" = 1 ] || frameworks
  releases=(--release 0.16.1=)
  [ -d $M19 ] && releases+=(--release 0.19.2=$M19)
  timeout -k 10 "${GRID_DEADLINE:-340}" python scripts/gpu/nccl_grid.py --out "$out/grid" "${releases[@]}" --spec te \
    --cell-timeout 150 --deadline $(( ${GRID_DEADLINE:-340} - 20 ))
  echo "grid rc=$?"
  wait
  cat "$out/frameworks/rc.txt" 2>/dev/null
  ;;
verl)
  shift
  for mode in "${@:-R3}"; do
    verl_job "$mode" tp2_sp "$(pair 0)" R3E2E_GPUS=2 R3E2E_TP=2
    verl_job "$mode" ep2 "$(pair 1)" R3E2E_GPUS=2 R3E2E_EP=2
    if [ "$ngpu" -ge 4 ]; then
      verl_job "$mode" tp2_pp2 "$all" R3E2E_GPUS=4 R3E2E_TP=2 R3E2E_PP=2
      verl_job "$mode" tp2_ep2 "$all" R3E2E_GPUS=4 R3E2E_TP=2 R3E2E_EP=2
    fi
  done
  wait
  cat "$out/verl/rc.txt"
  for f in "$out"/verl/verl_e2e_*.json; do
    python -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['mode'], d['layout'], 'rc', d['rc'], d['wall_s'], 's', [(s['step'], s['compared'], len(s['errors'])) for s in d['steps']])" "$f"
  done
  ;;
summary)
  find "$out" -name '*.json' | sort | while read -r f; do echo "$f: $(head -c 300 "$f" | tr '\n' ' ')"; done
  ;;
*) sed -n 2,17p "$0"; exit 2 ;;
esac

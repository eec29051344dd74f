#!/usr/bin/env bash
# verl 0.9.1's whole job on one GPU (issue 22): `python -m r3bridge.adapters.verl.main_ppo` with Ray,
# verl's agent loop, the HF transformers rollout backend (testlab/verl_hf_rollout.py), reward,
# compute_log_prob, reference, GRPO update, 2 steps, for replay_mode R3, R2 and off, every router
# call checked per (sample, token, layer) (testlab/verl_e2e.py: check_run).
# NOT RUN YET on a GPU (written and syntax-checked 2026-11-25; the CPU run is tests/adapters/test_verl_e2e.py).
#
#   verl_e2e.sh prepare DIR      here (CPU box): download the cp312 wheels into DIR: ray 2.x split in
#                                two parts DIR/p00, DIR/p01 (under 40 MB each), the rest in DIR/small
#   verl_e2e.sh stash DIR/p00    on the device, call 1: copy the first ray part to ~/stash
#   verl_e2e.sh install DIR      on the device, call 2 (carrying DIR/p01 and DIR/small): join ray
#                                (sha256 checked), install everything with `python -m pip`
#   verl_e2e.sh run MODE [last]  on the device: the job for MODE (R3 | R2 | off); `last` switches
#                                first-seen stitching off (the control); writes $OUT/verl_e2e_MODE*
#
# The device keeps ~/stash only while the machine stays warm: issue stash, install and the runs
# back to back (field notes 12). Use `python -m pip` there: the `pip` on PATH belongs to another
# interpreter. Transformer Engine: install it first with ../shared/gpu/te-on-device.sh; without TE
# megatron's local attention refuses verl's packed (THD) input (dot_product_attention.py:153).
#
# What differs from the CPU run (testlab/verl_e2e_worker.py skips every CPU shim when CUDA is
# available): NCCL instead of gloo (no VERL_PLATFORM override), real GPUs in Ray, mbridge's own TE
# layer spec and weights. mbridge 0.15.1 cannot build dense-first Qwen3-MoE layers
# (mbridge/models/qwen2moe.py:104), so the GPU model is all-MoE (R3E2E_DENSE=none) and its HF
# weights are saved for mbridge to load (R3E2E_SAVE_WEIGHTS=1). Weight sync trainer -> HF engine is
# still the documented lag of testlab/verl_hf_rollout.py (not loaded).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
RAY=2.57.0
RAYWHL=ray-$RAY-cp312-cp312-manylinux2014_x86_64.whl
case "${1:-}" in
prepare)
  d=$2; mkdir -p "$d/full" "$d/small"
  dl() { pip download -q --no-deps --python-version 3.12 --only-binary=:all: "$@" 2>&1 | grep -v WARNING || true; }
  dl --platform manylinux2014_x86_64 -d "$d/full" "ray==$RAY"
  # verl 0.9.1 and what its import chain needs on the device image (field notes 12: the image has
  # pyarrow, pandas, aiohttp, msgpack, grpcio, protobuf, click, filelock, pyyaml, requests)
  dl --platform manylinux_2_28_x86_64 -d "$d/small" "verl==0.9.1" "mbridge==0.15.1" "megatron-core==0.16.1" \
     omegaconf antlr4-python3-runtime hydra-core codetiming tensordict pyvers orjson torchdata dill datasets \
     pylatexenc jsonschema jsonschema-specifications referencing rpds-py cachetools uvicorn fastapi starlette \
     TransferQueue msgspec pyzmq einops multiprocess xxhash
  (cd "$d" && sha256sum "full/$RAYWHL" > small/ray.sha256)
  (cd "$d" && split -b 39000000 -d "full/$RAYWHL" part && for p in part0*; do mkdir -p "p${p#part}" && mv "$p" "p${p#part}/"; done)
  ls -d "$d"/p0*; du -sh "$d/small" ;;
stash)
  mkdir -p ~/stash && cp "$2"/part0* ~/stash/ && ls ~/stash ;;
install)
  d=$(cd "$2" && pwd); S=~/stash; mkdir -p "$S/full"
  cp "$d"/p0*/part0* "$S/" 2>/dev/null || true          # the part carried in this call
  (cd "$S" && cat part0* > "full/$RAYWHL" && sha256sum -c "$d/small/ray.sha256")
  python -m pip install -q --no-deps --no-index "$S/full/$RAYWHL" "$d"/small/*.whl
  python -m pip install -q --no-deps --no-build-isolation -e "$repo"
  python -c "import ray, verl, transfer_queue, mbridge; print('ray', ray.__version__, 'verl', verl.__version__)" ;;
run)
  mode=$2; variant=${3:-first}
  out=${OUT:-$repo/gpu_verl_e2e_out}; mkdir -p "$out"
  export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 R3E2E_DENSE=${R3E2E_DENSE:-none} R3E2E_SAVE_WEIGHTS=${R3E2E_SAVE_WEIGHTS:-1}
  cd "$repo"
  python - "$mode" "$variant" "$out" <<'PY'
import json, os, subprocess, sys, time
from testlab import verl_e2e as E
mode, variant, out = sys.argv[1], sys.argv[2], sys.argv[3]
root = os.path.join(out, f"verl_e2e_{mode}_{variant}")
paths = E.write_job(root, first_seen=variant != "last")
env = E.job_env(paths, os.getcwd(), gpu=True)
t0 = time.monotonic()
with open(os.path.join(root, "job.log"), "w") as log:
    rc = subprocess.run(E.job_command(paths, mode), env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT).returncode
res = E.read_run(paths, rc)
checks = E.check_run(res, mode, first_seen=variant != "last") if rc == 0 else []
summary = {"mode": mode, "variant": variant, "rc": rc, "wall_s": round(time.monotonic() - t0, 1),
           "server_calls": len(res.calls), "router_calls": len(res.dispatch),
           "steps": [c.__dict__ for c in checks], "metrics": E.r3bridge_metrics(res)}
json.dump(summary, open(os.path.join(out, f"verl_e2e_{mode}_{variant}.json"), "w"), indent=1, default=str)
print(json.dumps({k: summary[k] for k in ("mode", "variant", "rc", "wall_s", "server_calls", "router_calls")}))
for c in checks:
    print(f"step {c.step}: compared {c.compared}, errors {len(c.errors)}, ref native {c.ref_native}, "
          f"re-prefill disagreeing {c.reprefill}")
sys.exit(rc or int(any(c.errors for c in checks)))
PY
  ;;
*) sed -n 2,27p "$0"; exit 2 ;;
esac

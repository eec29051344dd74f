#!/usr/bin/env bash
# P3 (benchmarks/p3_step_overhead.py) on the device machine in one call: 1 x H200, Python 3.12,
# torch 2.11 + CUDA 13, megatron-core 0.16.1, the local layer spec (no Transformer Engine) unless
# `--spec te` is passed through. Prints P3's table (wall, enqueue, CUDA-event device span, router
# region, install, gc, cudaMalloc, host syncs by line, profiled busy time per arm) and writes the
# JSON to $OUT/p3.json (and the table to $OUT/p3.txt) where $OUT is set.
#
#   p3_device.sh prepare [DIR]              here (CPU box, repo root): megatron-core 0.16.1's cp312
#                                           wheel into DIR (default .dev/p3, git-ignored; 2.6 MB),
#                                           copied from a bundle under .dev/ (bundle.sh's te set) when
#                                           one holds it, else downloaded
#   p3_device.sh run [DIR] [-- P3 ARGS...]  on the device, one call carrying DIR (carry [".dev/p3"]):
#                                           megatron-core from DIR's wheel into /tmp/site-p3 unless it
#                                           imports already (bundle.sh install of the te set puts it in
#                                           the interpreter), then P3 with every arm and --profile;
#                                           P3 ARGS replace the shape (defaults below)
#   p3_device.sh cpu                        here (PY=the venv's python): the same benchmark on the CPU with a tiny shape
#                                           (gloo, fp32): a check of the script, not a P3 figure
#
# Defaults (P3_ARGS): --spec local --seqs 4 --seq-len 2048 --iters 12 --warmup 3: about 2 minutes on
# an H200 (the local spec's SequentialMLP launches every expert's GEMMs: a host-bound shape, which
# is what the enqueue / span columns are for). The TE spec: after bundle.sh's install of the te set
# (same warm machine), `p3_device.sh run .dev/p3 -- --spec te --seqs 4 --seq-len 2048`.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
MCORE=0.16.1
DEFAULT_ARGS=(--spec local --seqs 4 --seq-len 2048 --iters 12 --warmup 3)

pick_python() {  # the interpreter that holds torch (the device's `python` and `python3` may differ)
  for py in python python3; do
    if command -v "$py" >/dev/null && "$py" -c "import torch" 2>/dev/null; then echo "$py"; return; fi
  done
  echo "p3_device: no python with torch on PATH" >&2; exit 1
}

case "${1:-}" in
prepare)
  d=${2:-.dev/p3}; mkdir -p "$d"
  found=$(find "$repo/.dev" -name "megatron_core-$MCORE-cp312-*.whl" -not -path "$(cd "$d" && pwd)/*" 2>/dev/null | head -1 || true)
  if [ -n "$found" ]; then cp "$found" "$d/"; else
    python3 -m pip download -q --no-deps --python-version 3.12 --implementation cp --only-binary=:all: \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$d" "megatron-core==$MCORE"
  fi
  ls -la "$d"
  echo "device call (nvidia-h200, carry [\"$d\"]): bash scripts/gpu/p3_device.sh run $d" ;;
run)
  shift; d=.dev/p3
  if [ $# -gt 0 ] && [ "$1" != "--" ]; then d=$1; shift; fi
  [ "${1:-}" = "--" ] && shift
  args=("$@"); [ ${#args[@]} -eq 0 ] && args=("${DEFAULT_ARGS[@]}")
  cd "$repo"
  PY=${PY:-$(pick_python)}
  orig=${PYTHONPATH:-}
  export PYTHONPATH="$repo${orig:+:$orig}" PYTHONUNBUFFERED=1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  if ! "$PY" -c "import megatron.core" 2>/dev/null; then
    whl=$(ls "$d"/megatron_core-$MCORE-*.whl 2>/dev/null | head -1 || true)
    [ -n "$whl" ] || { echo "p3_device: megatron-core does not import and $d holds no megatron_core-$MCORE wheel (run 'prepare' here, carry $d)" >&2; exit 1; }
    "$PY" -m pip install -q --no-deps --no-index --no-compile --disable-pip-version-check --target /tmp/site-p3 "$whl"
    export PYTHONPATH="$repo:/tmp/site-p3${orig:+:$orig}"
  fi
  "$PY" -c "import torch, megatron.core as m; print('p3_device:', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU', 'megatron-core', m.__version__)"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader || true
  out=${OUT:-/tmp/p3_out}; mkdir -p "$out"
  # inside the call's 10 minutes, so that what was printed comes back (P3_TIMEOUT seconds)
  timeout "${P3_TIMEOUT:-560}" "$PY" benchmarks/p3_step_overhead.py --profile --out "$out/p3.json" "${args[@]}" \
    | tee "$out/p3.txt" ;;
cpu)
  cd "$repo"
  PY=${PY:-$(pick_python)}
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  "$PY" benchmarks/p3_step_overhead.py --device cpu --layers 2 --hidden 64 --heads 4 --experts 8 --topk 2 \
    --expert-ffn 64 --vocab 512 --seqs 2 --seq-len 64 --iters 3 --warmup 1 --profile ;;
*) sed -n 2,27p "$0"; exit 2 ;;
esac

#!/usr/bin/env bash
# `r3bridge demo` on one GPU: bf16 HF transformers rollout engine vs the fp32 megatron-core trainer.
#
# On a bare device machine (Python 3.12, torch 2.11, transformers 5.x, numpy; no megatron-core),
# from the repository root, with the megatron-core 0.16.1 cp312 wheel carried in .whl/:
#     bash scripts/gpu/demo_hf_engine.sh            # writes into $OUT (or ./gpu_demo_out)
# DEVICE=cpu runs the same commands on the CPU (to check the script itself).
set -euo pipefail
OUT_DIR=${OUT:-./gpu_demo_out}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT_DIR"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT_DIR/versions.txt"
# the default run (table + PNG), then the contract's JSON of the same run
python3 -m r3bridge demo --device "$DEVICE" --plot "$OUT_DIR/demo_${DEVICE}.png" 2>&1 | tee "$OUT_DIR/demo_${DEVICE}.txt"
python3 -m r3bridge demo --device "$DEVICE" --json --plot '' > "$OUT_DIR/demo_${DEVICE}.json"
cat "$OUT_DIR/demo_${DEVICE}.json"

#!/usr/bin/env bash
# `r3bridge demo --device cuda --spec te` on one GPU: the demo's trainer on Transformer Engine's layer
# spec (TE attention on packed THD input, TEGroupedMLP, bf16) against the HF transformers engine.
#
# On the device machine, after the TE set is installed (scripts/gpu/te_on_device.sh install ...: TE 2.20.2
# + megatron-core 0.16.1 in the interpreter's site-packages), from the repository root:
#     bash scripts/gpu/demo_te.sh                  # writes $OUT/demo_te.json (or ./gpu_demo_out)
#     SPECS="te local" bash scripts/gpu/demo_te.sh # the same demo on both specs, one JSON each
# Prints one table row per mode and spec (route_agreement, k3_kl, |d|, F(2), F(5), coverage).
set -euo pipefail
OUT_DIR=${OUT:-./gpu_demo_out}
SPECS=${SPECS:-te}
STEPS=${STEPS:-4}
mkdir -p "$OUT_DIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'megatron-core', m.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT_DIR/versions.txt"
for spec in $SPECS; do
    start=$(date +%s)
    # --json: exactly one JSON object on stdout; progress and notes go to stderr
    python -m r3bridge demo --device cuda --spec "$spec" --steps "$STEPS" --json --plot '' \
        > "$OUT_DIR/demo_$spec.json" 2> "$OUT_DIR/demo_$spec.stderr" \
        || { echo "demo --spec $spec failed (exit $?):"; tail -n 30 "$OUT_DIR/demo_$spec.stderr"; exit 1; }
    echo "demo --spec $spec: $(( $(date +%s) - start )) s"
done
python - "$OUT_DIR" $SPECS <<'PY'
import json, sys
out, specs = sys.argv[1], sys.argv[2:]
print(f"{'spec':<6}{'mode':<6}{'route_agreement':>16}{'k3_kl':>11}{'|d|':>11}{'F(2)':>10}{'F(5)':>10}{'coverage':>10}")
for spec in specs:
    for mode, s in json.load(open(f"{out}/demo_{spec}.json")).items():
        print(f"{spec:<6}{mode:<6}{s['route_agreement']:>16.4f}{s['k3_kl']:>11.3e}{s['abs_diff']:>11.3e}"
              f"{s['F2']:>10.2e}{s['F5']:>10.2e}{s['replay_coverage']:>10.3f}")
PY

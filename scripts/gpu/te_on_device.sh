#!/usr/bin/env bash
# Transformer Engine 2.20.2 + megatron-core 0.16.1 on the device machine (Python 3.12, torch 2.11+cu130),
# for `nccl_conformance.py --spec te` and `p3_step_overhead.py --spec te` (results: docs/gpu-results/te_cells/).
# The project's version of the recipe in the shared field notes (section 14).
#
#   te_on_device.sh prepare DIR   here (CPU box, repo root): download every wheel into one tar
#                                 (TE core 276.5 MB, TE's python package and runtime imports, the
#                                 prebuilt torch extension, megatron-core 0.16.1) and split it in
#                                 five parts DIR/q0..q4 of 58.5 MiB, each with the tar's sha256
#   te_on_device.sh stash DIR/qN  on the device, one call per part (q0..q3): copy the part to ~/stash
#   te_on_device.sh install DIR/q4  on the device: join the parts, check the sha256, install every
#                                 wheel with `python -m pip --no-deps --no-index`, import TE
#
# The device keeps ~/stash only while the machine stays warm (30 s idle): make the four `stash`
# calls and the `install` call back to back (64 MiB per call, the working tree included), and put
# the first real work into the `install` call. `python -m pip`, never `pip`: on the device the
# `pip` on PATH belongs to another interpreter than `python`.
# The torch extension (transformer_engine_torch) is source only on the registry; TE_TORCH_WHEEL
# names a wheel built on the device image (`NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=16 python -m pip
# wheel --no-build-isolation --no-deps .` in its sdist: 125 s on 16 cores, field notes 14).
set -euo pipefail
TE=2.20.2
MCORE=${MCORE:-0.16.1}
case "${1:-}" in
prepare)
  d=$2; rm -rf "$d/pay" "$d"/q?; mkdir -p "$d/pay"
  : "${TE_TORCH_WHEEL:?set TE_TORCH_WHEEL to the transformer_engine_torch-$TE cp312 wheel built on the device image}"
  dl() { python3 -m pip download -q --no-deps --python-version 3.12 --implementation cp --only-binary=:all: \
           --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$d/pay" "$@"; }
  dl "transformer-engine-cu13==$TE" "transformer-engine==$TE" "megatron-core==$MCORE" einops nvdlfw-inspect \
     nvidia-cudnn-frontend onnx onnx-ir onnxscript ml-dtypes pydantic pydantic-core annotated-types typing-inspection
  cp "$TE_TORCH_WHEEL" "$d/pay/"
  (cd "$d" && tar cf payload.tar pay && sha256sum payload.tar > payload.sha256 && split -n 5 -d payload.tar qpart \
     && for i in 0 1 2 3 4; do mkdir -p "q$i" && mv "qpart0$i" "q$i/" && cp payload.sha256 "q$i/"; done \
     && rm payload.tar)
  du -sh "$d"/q? ;;
stash)
  mkdir -p ~/stash && cp "$2"/qpart0* ~/stash/ && ls -la ~/stash ;;
install)
  S=~/stash; cp "$2"/qpart0* "$S/"
  (cd "$S" && cat qpart0* > payload.tar && sha256sum -c "$(cd "$2" && pwd)/payload.sha256" && tar xf payload.tar)
  python -m pip install -q --no-deps --no-index "$S"/pay/*.whl
  python -c "import transformer_engine as t, transformer_engine.pytorch, torch, megatron.core as m; \
print('transformer_engine', t.__version__, 'megatron-core', m.__version__, 'torch', torch.__version__)" ;;
*) sed -n 2,20p "$0"; exit 2 ;;
esac

#!/usr/bin/env bash
# vLLM 0.26.0 on the device, engine side only (scripts/gpu/vllm026_routes.py; results:
# docs/gpu-results/vllm-0.26.0). The wheel set is scripts/gpu/wheels/vllm026.txt alone (no base / te /
# ray / verl sets: nothing on the device imports megatron-core here), so bundle.sh is not used.
#
#   here:   vllm026_device.sh prepare DIR       download the set into DIR/pay/vllm026, tar, split into
#                                                DIR/q0..qN (55 MiB parts, each with the tar's sha256)
#   device: mkdir -p ~/stash && cp DIR/qI/qpart* ~/stash/     one call per part but the last, back to back
#                                                (the machine keeps ~/stash only while warm: 30 s idle)
#   device: vllm026_device.sh install DIR/qN     join, check, pip install --target /tmp/site-vllm026
#   device: vllm026_device.sh run ARGS...        PYTHONPATH and VLLM_USE_FLASHINFER_SAMPLER=0 set, then
#                                                python3 scripts/gpu/vllm026_routes.py ARGS
# Install and the first run go in the same call (the call carrying the last part).
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
case "${1:-}" in
prepare)
  d=$2; rm -rf "$d/pay" "$d"/q*; mkdir -p "$d/pay/vllm026"
  grep -v '^\s*#' "$here/wheels/vllm026.txt" | sed 's/#.*//' | xargs -n1 > "$d/specs.txt"
  python3 -m pip download -q --no-deps --python-version 3.12 --implementation cp --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_34_x86_64 -d "$d/pay/vllm026" -r "$d/specs.txt" || exit 1
  (cd "$d" && tar cf payload.tar pay && sha256sum payload.tar > payload.sha256 \
     && split -b 57671680 -d -a 2 payload.tar qpart && rm payload.tar)
  i=0; for p in "$d"/qpart*; do mkdir -p "$d/q$i" && mv "$p" "$d/q$i/" && cp "$d/payload.sha256" "$d/q$i/"; i=$((i+1)); done
  echo "$(ls "$d/pay/vllm026" | wc -l) wheels, parts: $(ls -d "$d"/q* | xargs -n1 basename | sort -V | tr '\n' ' ')" ;;
install)
  last=$(cd "$2" && pwd); S=~/stash; mkdir -p "$S"; cp "$last"/qpart* "$S/"; t0=$(date +%s)
  (cd "$S" && cat qpart* > payload.tar && sha256sum -c "$last/payload.sha256" && tar xf payload.tar && rm payload.tar) || exit 3
  python3 -m pip install -q --no-deps --no-index --no-cache-dir --no-compile --disable-pip-version-check \
    --target /tmp/site-vllm026 "$S"/pay/vllm026/*.whl || exit 3
  echo "install: $(( $(date +%s) - t0 )) s, $(ls "$S/pay/vllm026" | wc -l) wheels" ;;
run)
  shift
  export PYTHONPATH=/tmp/site-vllm026:$here:$repo VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
  python3 "$here/vllm026_routes.py" "$@" ;;
*) sed -n 2,15p "$0"; exit 2 ;;
esac

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
#                                                python3 scripts/gpu/vllm026_routes.py ARGS (pass
#                                                --variant inproc_hd64: heads of 64 are required, below)
#   device: vllm026_device.sh variants [--budget S] [ARGS...]   (ARGS: more vllm026_routes.py options)
#                                                probe each of VARIANTS in order (one engine, one generate,
#                                                every process's stacks dumped to its log if it hangs), then
#                                                the full run (direct cases + speculative decoding) with the
#                                                first variant that returned routes, in what is left of S
#                                                (default 290) seconds; logs and results under $OUT as they
#                                                come (probe_V.log / .json, variants.txt, full.log, full/)
# Install and the first run go in the same call (the call carrying the last part). Either installer
# puts vLLM into /tmp/site-vllm026: this script's `install` or `bundle.sh install` (set vllm026).
# VLLM026_DRY_RUN=1 (CPU, no vLLM): the routes script only parses its arguments (--dry-run), and
# the variants named in R3B_DRY_FAIL report a hang: the variant logic is checked without a GPU.
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
variants)
  shift; budget=290
  if [ "${1:-}" = --budget ]; then budget=$2; shift 2; fi
  out=${OUT:?variants writes under \$OUT}; mkdir -p "$out"; t0=$(date +%s)
  # Heads of 64 are required on 0.26.0 (docs/gpu-results/vllm-0.26.0/README.md): with model A's
  # default heads of 8 the first forward's FlashAttention call never returned (FA3 and FA2, calls 1
  # and 2); with R3E2E_HEAD_DIM=64 (inproc_hd64) FA3 returned and the full run passed (call 3: probe
  # 53 s, everything 156 s, rc 0). So inproc_hd64 comes first; Triton attention with heads of 64 (no
  # FlashAttention binary) is the fallback should FA3 fail another way; heads of 8 with synchronous
  # launches (inproc_sync) only names the kernel that never ends (diagnosis, never the full run).
  # ~60 s a probe that returns, ~90 s one that hangs. More diagnoses of the heads-of-8 stall, alone on
  # the GPU: VARIANTS=inproc_noaot, VARIANTS=inproc_hd8_long GEN_S=150 PROBE_S=200 (a slow first launch?).
  # VARIANTS=... overrides the order, e.g. a second call straight to the variant a first one found.
  VARIANTS=${VARIANTS:-"inproc_hd64 inproc_triton_hd64 inproc_sync"}
  PROBE_ONLY="inproc_noroutes inproc_sync inproc_noaot inproc_hd8_long"   # never the full run's settings
  PROBE_S=${PROBE_S:-80}   # each probe's processes: stacks dumped and exit after this (engine start included)
  GEN_S=${GEN_S:-30}       # a probe's generate (normally < 1 s): stacks dumped and exit when not back by then
  # the faulthandler folder's sitecustomize arms the dump in every process, vLLM's children too
  export PYTHONPATH=/tmp/site-vllm026:$here/vllm026_faulthandler:$here:$repo VLLM_USE_FLASHINFER_SAMPLER=0 \
    PYTHONUNBUFFERED=1
  dry=(); if [ "${VLLM026_DRY_RUN:-0}" = 1 ]; then dry=(--dry-run); PYTHONPATH=$here:$repo
  elif [ ! -d /tmp/site-vllm026/vllm ]; then echo "no vLLM in /tmp/site-vllm026: install first" >&2; exit 3; fi
  chosen=""
  for v in $VARIANTS; do
    R3B_FAULT_AFTER=$PROBE_S timeout -s KILL $((PROBE_S + 15)) python3 "$here/vllm026_routes.py" --probe \
      --variant "$v" --generate-timeout "$GEN_S" --out "$out" "${dry[@]}" "$@" 2>&1 | tee "$out/probe_$v.log"
    rc=${PIPESTATUS[0]}
    echo "probe $v: rc $rc after $(( $(date +%s) - t0 )) s" | tee -a "$out/variants.txt"
    if [ "$rc" = 0 ] && [[ " $PROBE_ONLY " != *" $v "* ]]; then chosen=$v; break; fi
  done
  if [ -z "$chosen" ]; then echo "no variant returned routes" | tee -a "$out/variants.txt"; exit 1; fi
  left=$(( budget - ($(date +%s) - t0) ))
  if [ "$left" -lt 60 ]; then echo "chosen $chosen; ${left} s left: no full run" | tee -a "$out/variants.txt"; exit 1; fi
  echo "chosen $chosen; full run in ${left} s" | tee -a "$out/variants.txt"
  R3B_FAULT_AFTER=$((left - 10)) timeout -s KILL "$left" python3 "$here/vllm026_routes.py" --variant "$chosen" \
    --out "$out/full" "${dry[@]}" "$@" 2>&1 | tee "$out/full.log"
  rc=${PIPESTATUS[0]}; echo "full run ($chosen): rc $rc after $(( $(date +%s) - t0 )) s" | tee -a "$out/variants.txt"
  exit "$rc" ;;
*) sed -n 2,24p "$0"; exit 2 ;;
esac

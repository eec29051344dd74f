#!/usr/bin/env bash
# Everything the GPU scripts import, carried to the device machine (Python 3.12, no network) in
# parts of at most 52 MiB: one call carries 64 MiB in all, and the project tree travels with every
# call (tree + a 58.5 MiB part came within 88 KB of the limit, field notes 15).
# Generalises te_on_device.sh: any number of wheel sets, one tar, as many parts as it needs.
#
#   bundle.sh prepare DIR SET...  here (CPU box, repo root): download the wheels of each set
#                                 (scripts/gpu/wheels/SET.txt: `name==version`, `file:PATH` or `build:name==version`
#                                 for a pure-Python sdist, one per line)
#                                 as cp312 / py3 manylinux wheels into one tar, split into DIR/q0..qN,
#                                 each part with the tar's sha256; prints wheels and MiB per set,
#                                 the number of parts and their carry lists
#   bundle.sh stash DIR/qI        on the device, one call per part but the last: copy it to ~/stash
#   bundle.sh install DIR/qN      on the device, the call carrying the last part: join the parts,
#                                 check the sha256, install each set with `python -m pip --no-deps
#                                 --no-index`: base, te, ray and verl into the interpreter (they share
#                                 megatron-core 0.16.1), every other set into /tmp/site-SET (a set
#                                 that brings another megatron-core must not replace 0.16.1);
#                                 then r3bridge itself (editable, so r3bridge.adapters maps to adapters/)
#   bundle.sh pythonpath SET...   on the device: the PYTHONPATH that puts those sets first
#
# The device keeps ~/stash only while the machine stays warm (30 s idle): make the stash calls and
# the install call back to back and put the first real work into the install call. `python -m pip`,
# never `pip`: the `pip` on the device's PATH belongs to another interpreter.
set -euo pipefail
SYSTEM_SETS="base te ray verl"
PART=54525952   # 52 MiB: a part + the project tree stay under the call's 64 MiB
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

download_set() {  # download_set SET DEST
  local set=$1 dest=$2 line spec
  mkdir -p "$dest"
  while IFS= read -r line; do
    spec=${line%%#*}; spec=$(echo "$spec" | xargs)
    [ -z "$spec" ] && continue
    if [[ $spec == file:* ]]; then cp "$repo/${spec#file:}" "$dest/"; continue; fi
    if [[ $spec == build:* ]]; then   # a pure-Python sdist with no wheel on the registry
      python3 -m pip wheel -q --no-deps -w "$dest" "${spec#build:}" 2>&1 | grep -v -e '^WARNING: Location' || true; continue; fi
    python3 -m pip download -q --no-deps --python-version 3.12 --implementation cp --only-binary=:all: \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
      --platform manylinux_2_34_x86_64 -d "$dest" "$spec" 2>&1 \
      | grep -v -e '^WARNING: Location' -e '^$' || true
    ls "$dest" | grep -qi "^$(echo "${spec%%==*}" | tr '-' '_' | tr 'A-Z' 'a-z')-\|^${spec%%==*}-" \
      || { echo "bundle: no wheel for $spec (set $set)" >&2; exit 1; }
  done < "$here/wheels/$set.txt"
}

case "${1:-}" in
prepare)
  d=$2; shift 2
  rm -rf "$d/pay" "$d"/q*; mkdir -p "$d/pay"
  for set in "$@"; do download_set "$set" "$d/pay/$set"; done
  (cd "$d" && tar cf payload.tar pay && sha256sum payload.tar > payload.sha256 \
     && split -b $PART -d -a 2 payload.tar qpart && rm payload.tar)
  i=0; for p in "$d"/qpart*; do mkdir -p "$d/q$i" && mv "$p" "$d/q$i/" && cp "$d/payload.sha256" "$d/q$i/"; i=$((i+1)); done
  for set in "$@"; do
    echo "set $set: $(ls "$d/pay/$set" | wc -l) wheels, $(du -sb "$d/pay/$set" | awk '{printf "%.1f", $1/1048576}') MiB"
  done
  n=$(ls -d "$d"/q* | wc -l)
  echo "total: $(du -cb "$d"/q*/qpart* | tail -1 | awk '{printf "%.1f", $1/1048576}') MiB in $n parts of <= 52 MiB"
  echo "parts: $(ls -d "$d"/q* | xargs -n1 basename | sort -V | tr '\n' ' ')"
  echo "device calls: bundle.sh stash $d/qI for I in 0..$((n-2)) (carry [\"$d/qI\"]), then bundle.sh install $d/q$((n-1))" ;;
stash)
  mkdir -p ~/stash && cp "$2"/qpart* ~/stash/ && ls ~/stash ;;
install)
  S=~/stash; last=$(cd "$2" && pwd); mkdir -p "$S"; cp "$last"/qpart* "$S/"
  (cd "$S" && cat qpart* > payload.tar && sha256sum -c "$last/payload.sha256" && tar xf payload.tar && rm payload.tar)
  for set in $(ls "$S/pay"); do
    if [[ " $SYSTEM_SETS " == *" $set "* ]]; then
      python -m pip install -q --no-deps --no-index --no-cache-dir --disable-pip-version-check "$S/pay/$set"/*.whl
    else
      python -m pip install -q --no-deps --no-index --no-cache-dir --disable-pip-version-check \
        --target "/tmp/site-$set" "$S/pay/$set"/*.whl
    fi
    echo "bundle: installed $set ($(ls "$S/pay/$set" | wc -l) wheels)"
  done
  python -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check -e "$repo" >/dev/null
  python -c "import r3bridge.adapters, torch; print('r3bridge', r3bridge.adapters.__file__, 'torch', torch.__version__)" ;;
pythonpath)
  shift; p=""; for set in "$@"; do p="$p${p:+:}/tmp/site-$set"; done; echo "$p" ;;
*) sed -n 2,22p "$0"; exit 2 ;;
esac

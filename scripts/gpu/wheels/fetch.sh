#!/usr/bin/env bash
# Download one wheel set (scripts/gpu/wheels/<set>.txt) as cp312 manylinux / py3 wheels into DIR.
# Usage: bash scripts/gpu/wheels/fetch.sh skyrl04 .whl/skyrl04   (run on any machine with the registry)
# Pure-python packages published as sdists only (antlr4-python3-runtime, func-timeout) are built
# here with `pip wheel` (py3-none-any). Prints each wheel and the set's total size.
set -euo pipefail
set_name="$1"; dir="$2"
list="$(dirname "$0")/$set_name.txt"
mkdir -p "$dir"
PLAT=(--no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
SDIST_ONLY=" antlr4-python3-runtime func-timeout "
sed -e 's/#.*//' "$list" | awk 'NF {print $1}' | while read -r req; do
  name="${req%%==*}"
  if [[ "$SDIST_ONLY" == *" $name "* ]]; then
    python3 -m pip wheel -q --no-deps -w "$dir" "$req"
  else
    python3 -m pip download -q "${PLAT[@]}" -d "$dir" "$req"
  fi
done
ls -l "$dir"/*.whl | awk '{s += $5; printf "%10d %s\n", $5, $9} END {printf "total %.1f MB\n", s / 1e6}'

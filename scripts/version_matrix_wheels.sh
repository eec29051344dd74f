#!/usr/bin/env bash
# Wheels scripts/version_matrix.py needs on the device machine (Python 3.12; it already has torch,
# numpy, packaging, pyyaml, pytest, hypothesis, transformers, matplotlib). Run here, from the
# repository root, then carry `.whl` (about 9 MB). One megatron-core per directory name: the
# matrix installs each into its own --target.
set -euo pipefail
rm -rf .whl && mkdir -p .whl/megatron .whl/common
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for v in ${MEGATRON_VERSIONS:-0.16.1 0.17.1 0.18.2 0.19.2}; do
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl/megatron "megatron-core==$v"
done
# tests/core/test_config.py reads configs/r3bridge.yaml with omegaconf; antlr4 4.9.3 (omegaconf's
# pin) is an sdist only: build its pure-python wheel here.
python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl/common omegaconf==2.3.0
python3 -m pip wheel -q --no-deps -w .whl/common antlr4-python3-runtime==4.9.3
du -sh .whl && ls .whl/*

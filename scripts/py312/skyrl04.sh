#!/usr/bin/env bash
# SkyRL 0.4's test selection on Python >= 3.12 (SkyRL 0.4 refuses older Pythons), on the CPU with
# CUDA hidden (the CPU harness refuses a process that sees CUDA). For a bare machine with Python
# 3.12, torch, numpy and pytest (the device machines): the wheels it needs travel in .whl/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       skyrl==0.4.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 loguru==0.7.3 colorlog==6.12.0 tenacity==9.2.1 lark==1.3.1
# Here SkyRL 0.4 is the installed release, so tests/adapters/test_skyrl04.py runs its checks
# in-process (on Python 3.11 they run in a child process against build/skyrl04 instead).
# Output: the pytest log, also in $OUT/skyrl04.txt when OUT is set.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -c 'import sys; assert sys.version_info >= (3, 12), f"SkyRL 0.4 needs Python >= 3.12, this is {sys.version}"'
site="${SKYRL04_SITE:-/tmp/skyrl04-site}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
[ -e r3bridge/adapters ] || ln -s ../adapters r3bridge/adapters      # the package-dir mapping, uninstalled
export PYTHONPATH="$site:$PWD" CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1
python3 - <<'PY'
import sys, importlib.metadata as md, torch
print(f"python {sys.version.split()[0]} torch {torch.__version__} skyrl {md.version('skyrl')}")
PY
out="${OUT:-/tmp}/skyrl04.txt"
python3 -m pytest -q -p no:cacheprovider tests/adapters/test_skyrl04.py 2>&1 | tee "$out"
exit "${PIPESTATUS[0]}"

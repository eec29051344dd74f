# The two commands of the README. Both start from a fresh machine: `make install` puts the CPU
# torch 2.13.0 build first (an unpinned torch would pull gigabytes of CUDA wheels), then
# r3bridge with its extras, then the skyrl / areal wheels without their dependencies (they
# cannot share an environment with verl + torch 2.13: docs/frameworks.md) plus the few small
# pure-python packages the modules the adapters import need.
PY ?= python3
PIP = $(PY) -m pip install --disable-pip-version-check -q

.PHONY: install test demo
install:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[megatron,verl,test]"
	$(PIP) --no-deps skyrl==0.3.0 areal==1.0.4 skyrl-gym==0.4.0 \
		jaxtyping==0.3.11 wadler-lindig loguru==0.7.3 colorlog==6.12.0 tenacity==9.2.1 lark==1.3.1 einops==0.8.2
	# verl's real engine + worker test (tests/adapters/test_verl_real_*.py): verl 0.9.1 builds its
	# Megatron model through mbridge (its own deps: einops above, already installed transformers /
	# megatron-core); verl.workers.engine_workers imports fastapi and uvicorn (rollout utilities).
	$(PIP) --no-deps mbridge==0.15.1
	$(PIP) fastapi==0.165.0 uvicorn==0.54.0
	# AReaL's real engine test (tests/adapters/test_areal_real.py): what `import areal`,
	# areal.engine.sglang_remote and megatron_engine import at module level (uvloop, numba's JIT in
	# areal.utils.seqpack, pybase64 for SGLang's routes, aiofiles / openai in areal.infra).
	$(PIP) --no-deps uvloop==0.23.0 numba==0.68.1 llvmlite==0.50.0 pybase64==1.5.1 aiofiles==25.1.0 \
		openai==3.54.0 httpx2==2.16.2 jiter==0.19.0
	# SkyRL 0.4 (Python >= 3.12 as a package): its data-layout modules, for tests/adapters/test_skyrl04.py
	$(PIP) --no-deps --ignore-requires-python --upgrade --target build/skyrl04 skyrl==0.4.0

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q

demo: install
	$(PY) -m r3bridge.cli.main demo

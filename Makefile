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
	# SkyRL 0.4 (Python >= 3.12 as a package): its data-layout modules, for tests/adapters/test_skyrl04.py
	$(PIP) --no-deps --ignore-requires-python --upgrade --target build/skyrl04 skyrl==0.4.0

test: install
	$(PY) -m pytest -q

demo: install
	$(PY) -m r3bridge.cli.main demo

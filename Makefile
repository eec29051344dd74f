# The two commands of the README. Both start from a fresh machine: `make install` puts the CPU
# torch 2.13.0 build first (an unpinned torch would pull gigabytes of CUDA wheels), then
# r3bridge with its extras, then the skyrl / areal wheels without their dependencies (they
# cannot share an environment with verl + torch 2.13: docs/frameworks.md).
PY ?= python3
PIP = $(PY) -m pip install --disable-pip-version-check -q

.PHONY: install test demo
install:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[megatron,verl,test]"
	$(PIP) --no-deps skyrl==0.3.0 areal==1.0.4

test: install
	$(PY) -m pytest -q

demo: install
	$(PY) -m r3bridge.cli.main demo

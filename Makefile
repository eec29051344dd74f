# The README's two commands, `make demo` and `make test`. Both work on a machine that never saw
# the project: they install everything first, into a virtualenv.
#
# Which virtualenv: the one that is active (VIRTUAL_ENV) if any, else `.venv` in the checkout,
# created with `python3 -m venv` when missing. `make test VENV=/some/dir` (or the environment
# variable VENV) puts it elsewhere: .ci/run uses that to start from nothing on every run.
# PY=/path/to/python still names an interpreter directly.
#
# What is installed (versions: constraints.txt, the pip freeze of a fresh test environment):
#   1. pip itself, upgraded in the virtualenv (>= 25.1 reads [dependency-groups]);
#   2. torch 2.13.0's CPU build first, alone, pinned as 2.13.0+cpu: an unpinned torch (a dependency
#      of megatron-core, peft, ...) would pull a CUDA build and gigabytes of nvidia wheels, and so
#      would a plain torch==2.13.0 from an index that serves only that (PyPI on Linux). An index
#      without the CPU build stops make here, with a message; TORCH_INDEX=https://download.pytorch.org/whl/cpu
#      (or a local wheel: TORCH_INDEX= and pip's --find-links) gets it;
#   3. r3bridge (editable) with the demo, plot, megatron and verl extras, the test / lint groups
#      and the `frameworks` group (what the real SkyRL / AReaL tests import of those frameworks'
#      dependencies), all with their dependencies, in one resolver run;
#   4. the skyrl 0.3 and areal 1.0 wheels with --no-deps: their pins (transformers <= 5.8 / <= 5.3,
#      torch < 2.11) cannot share an environment with verl 0.9 + torch 2.13 (README "Install");
#      the tests import only the modules the adapters touch, with what step 3 installed;
#   5. the skyrl 0.4 wheel's files into $(SKYRL04) (a Python >= 3.12 package; tests/adapters/
#      test_skyrl04.py loads its data-layout modules on 3.11).
PYTHON ?= python3
ifdef VIRTUAL_ENV
VENV ?= $(VIRTUAL_ENV)
else
VENV ?= .venv
endif
PY ?= $(VENV)/bin/python
SKYRL04 ?= $(or $(R3BRIDGE_SKYRL04),build/skyrl04)
TORCH_INDEX ?=
# --no-warn-conflicts: pip would report skyrl's and areal's unmet pins (step 4) as ERROR lines on
# every later install; the `pip check` step below is the check instead, and fails on anything else.
PIP = $(PY) -m pip install --disable-pip-version-check --progress-bar off -q --no-warn-conflicts -c constraints.txt

.PHONY: install test demo venv
venv:
	@if [ ! -x "$(PY)" ] && ! command -v "$(PY)" >/dev/null 2>&1; then \
		$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "make: r3bridge needs"\
			"Python >= 3.11; $(PYTHON) is $$($(PYTHON) -V 2>&1): run make PYTHON=python3.11"; exit 1; }; \
		echo "make: creating the virtualenv $(VENV) ($(PYTHON) -m venv)"; \
		$(PYTHON) -m venv "$(VENV)"; \
	fi

install: venv
	@echo "make install: into $$($(PY) -c 'import sys; print(sys.prefix)')"
	$(PIP) "pip>=25.1"
	@$(PIP) "torch==2.13.0+cpu" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) || { \
		echo "make install: no torch 2.13.0+cpu from $(or $(TORCH_INDEX),the configured package index) (see the"\
		     "pip error above). Stopped before anything could pull torch's CUDA build. Get the CPU build:"\
		     "make $(MAKECMDGOALS) TORCH_INDEX=https://download.pytorch.org/whl/cpu, or a mirror of it, or"\
		     "'$(PY) -m pip install ./torch-2.13.0+cpu-*.whl' first"; exit 1; }
	$(PIP) -e ".[megatron,demo,plot,verl]" --group dev
	@echo "make install: skyrl 0.3 / areal 1.0 go in without their dependencies (see README"\
	      "\"Install\"); pip check lists their unmet pins, which this environment does not need."
	@# TransferQueue (verl's V1 trainer imports transfer_queue): without its ray[default] extras,
	@# which verl's whole-job test (tests/adapters/test_verl_e2e.py) does not use
	$(PIP) --no-deps skyrl==0.3.0 areal==1.0.4 TransferQueue==0.1.11
	@# pip check may name skyrl's and areal's own pins (above); anything else is a real problem
	@if $(PY) -m pip check --disable-pip-version-check | grep -vE '^(skyrl|areal) |^No broken'; then \
		echo "make install: pip check found the problems above"; exit 1; fi
	@if [ -d "$(SKYRL04)/skyrl-0.4.0.dist-info" ]; then echo "make install: skyrl 0.4.0 already in $(SKYRL04)"; \
	else $(PY) -m pip install --disable-pip-version-check --progress-bar off -q --no-deps \
		--ignore-requires-python --target "$(SKYRL04)" skyrl==0.4.0; fi

test: install
	$(PY) -m ruff check .
	@# two workers, whole files each (--dist loadfile: a module's shared Megatron runs start once):
	@# one worker keeps CI's second core busy while the other waits on a subprocess, a Ray start or a timeout
	R3BRIDGE_SKYRL04="$(SKYRL04)" $(PY) -m pytest -q -n 2 --dist loadfile

demo: install
	$(PY) -m r3bridge.cli.main demo

# The two commands a fresh machine needs (Python 3.11 and a C++ compiler, nothing else):
#   make demo   set everything up and run the main job
#   make test   set everything up and run the whole test suite
# And on a GPU machine that reaches no package registry (torch and the test packages already
# installed there, see the README):
#   make test-here   install the package into the Python at hand, run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo lint test test-here clean

# torch is pinned first and alone: this exact version is the CPU build available locally;
# any other request would pull several GB of CUDA packages.
$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*/*.cpp csrc/*/*.h csrc/*/*.inc)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# The main job: a byte-level GPT trained with params and optimizer states on NVMe swap.
demo: setup
	$(PY) examples/demo.py --nvme-path ./offload-swap

# ruff (lint and format) over the tree, mypy over offload/, clang-format over csrc/
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/clang-format --dry-run --Werror csrc/*/*.cpp csrc/*/*.h csrc/*/*.inc

test: lint
	$(PY) -m pytest -q tests

# No venv and no torch install: the C++ extension is built against the interpreter's own
# packages (pybind11, setuptools), and the tests run on the device the engine picks (CUDA there).
test-here:
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .
	$(PYTHON) -m pytest -q tests

clean:
	rm -rf build $(VENV) offload/*.so *.egg-info

# The two commands a fresh machine needs (Python 3.11 and a C++ compiler, nothing else):
#   make demo   set everything up and run the main job
#   make test   set everything up and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo test clean

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

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf build $(VENV) offload/*.so *.egg-info

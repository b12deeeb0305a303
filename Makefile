# The two commands a fresh machine needs (Python 3.11 and a C++ compiler, nothing else):
#   make demo   set everything up and run the main job
#   make test   set everything up and run the whole test suite
#   make docs   build the documentation site into site/ (strict)
# And on a GPU machine that reaches no package registry (torch and the test packages already
# installed there, see the README):
#   make test-here   install the package into the Python at hand, run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo lint docs test test-isas test-here clean

# torch is pinned first and alone: this exact version is the CPU build available locally;
# any other request would pull several GB of CUDA packages.
$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*/*.cpp csrc/*/*.h csrc/*/*.inc)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,docs]'
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

# The engine-equivalence tests (every placement and tier, each overlap, fp32/bf16/fp16, 1 and 2
# ranks, checkpointing, stale weights, resume, compact optimizer state, a second thread) run a
# second time on the checked stand-in device:
# the CPU as an asynchronous accelerator whose streams run on their own threads at 100 MB/s (so a
# copy is still queued when the host moves on) and report any missing wait (offload/checked_device.py).
CHECKED_TESTS := $(addprefix tests/,test_engine.py test_stale_weights.py test_speculative_step.py \
	test_schedule_order.py test_fresh_weights.py test_checkpoint.py test_distributed.py \
	test_optimizer_device.py test_optimizer_auto.py test_state_pieces.py test_nvme_step_io.py \
	test_hf_models.py test_param_access.py test_hardening_checkpoint.py test_rank_agreement.py \
	test_compact_state.py test_adversarial_threads.py test_weights_stream.py test_pretrained_weights.py \
	test_overlap_auto.py test_step_split.py)
CHECKED_ENV := OFFLOAD_DEVICE=checked OFFLOAD_CHECKED_H2D_GBPS=0.1 OFFLOAD_CHECKED_D2H_GBPS=0.1

# Two pytest-xdist workers, one per core of the dev and CI machines: the tests are independent
# (each its own tmp_path and swap directories, two-rank launches on free ports) and the tests of
# a module with a module-scoped fixture stay on one worker (tests/conftest.py).
PYTEST_WORKERS ?= 2

# The documentation site (mkdocs.yml): a broken link or anchor, a page left out of the nav or a
# stale generated table (docs/generate.py) fails the build; it needs no network.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

test: lint docs
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) tests
	$(CHECKED_ENV) $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) $(CHECKED_TESTS)

# The suite with the C++ kernels forced to AVX2 and to portable code (OFFLOAD_CPU_ISA): an exact
# comparison must hold on every x86-64 CPU, not only with this one's vector width (about 13 and
# 25 minutes on the 2-core machine; not part of `make test`).
test-isas: setup
	OFFLOAD_CPU_ISA=avx2 $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) tests
	OFFLOAD_CPU_ISA=portable $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) tests

# No venv and no torch install: the C++ extension is built against the interpreter's own
# packages (pybind11, setuptools), and the tests run on the device the engine picks (CUDA there),
# on PYTEST_WORKERS workers where pytest-xdist is installed, else in one process.
XDIST_HERE = $(shell $(PYTHON) -c "import xdist" >/dev/null 2>&1 && echo "-n $(PYTEST_WORKERS)")
test-here:
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .
	$(PYTHON) -m pytest -q $(XDIST_HERE) tests
	$(CHECKED_ENV) $(PYTHON) -m pytest -q -p no:cacheprovider $(XDIST_HERE) $(CHECKED_TESTS)

clean:
	rm -rf build site $(VENV) offload/*.so *.egg-info

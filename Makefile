# kgen's single entry point: CI and people only ever call make.
#   make build   set up (venv + CUDA 11.8 if missing), kgen build specs/, kgen verify
#   make test    set up, lint, build, verify, the test suite (GPU tests skip)
#   make dist    a wheel of kgen with the built kernels (dist/), for hosts with no toolchain
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
KGEN   := $(BIN)/kgen
STAMPS := .stamps
APT_SOURCES := /etc/apt/sources.list.d/debian.sources
comma := ,

# CuPy (it runs the kernels) is the kgen extra for the NVIDIA driver found here,
# by nvidia-smi's "CUDA Version: X.Y": 11 -> cuda11 (a K80's R470 is 11.4), 12 ->
# cuda12, 13 and newer -> cuda13; none without a GPU (building, verifying and CI
# need no CuPy). `make setup CUPY=cuda12` (or CUPY=none) overrides the choice.
DRIVER_CUDA := $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1)
CUPY ?= $(shell m='$(DRIVER_CUDA)'; if [ -z "$$m" ] || [ "$$m" -lt 11 ]; then echo none; \
          elif [ "$$m" -ge 13 ]; then echo cuda13; else echo "cuda$$m"; fi)
CUPY_EXTRAS := cuda11 cuda12 cuda13

.PHONY: setup cuda build verify lint test test-cpu test-toolchain test-gpu dist \
        bench-build bench-kernels bench-counters bench-host golden clean FORCE

setup: $(STAMPS)/venv cuda

# The CuPy choice, rewritten only when it changes (a new driver, or CUPY=...), so
# that the venv step reruns then and only then.
$(STAMPS)/cupy: FORCE
	@case ' none $(CUPY_EXTRAS) ' in *' $(CUPY) '*) ;; \
	  *) echo "CUPY=$(CUPY): expected one of none $(CUPY_EXTRAS)" >&2; exit 2;; esac
	@mkdir -p $(STAMPS)
	@echo '$(CUPY)' | cmp -s - $@ || echo '$(CUPY)' > $@

# Python environment, rebuilt only when pyproject.toml or the CuPy choice changes.
# A CuPy for another driver (or from an older kgen, which always installed
# cupy-cuda12x) is removed: two CuPy packages would shadow each other.
$(STAMPS)/venv: pyproject.toml $(STAMPS)/cupy
	@mkdir -p $(STAMPS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev$(if $(filter-out none,$(CUPY)),$(comma)$(CUPY))]'
	@for extra in $(filter-out $(CUPY),$(CUPY_EXTRAS)); do \
	  if $(BIN)/python -m pip show -q "cupy-$${extra}x" >/dev/null 2>&1; then \
	    echo "removing cupy-$${extra}x (CuPy for this host: $(CUPY))"; \
	    $(BIN)/python -m pip uninstall -q -y "cupy-$${extra}x"; fi; done
	@echo "CuPy: $(if $(filter none,$(CUPY)),none$(if $(DRIVER_CUDA),, (no NVIDIA driver found)): kgen builds and verifies without it,kgen[$(CUPY)]$(if $(DRIVER_CUDA), for driver CUDA $(DRIVER_CUDA)))"
	@touch $@

# CUDA 11.8 (the last toolkit that targets sm_37). Checked on every run (one
# `nvcc --version`), installed from Debian's non-free component when missing;
# KGEN_CUDA_HOME points at an install of your own instead.
# kgen's own locator decides (KGEN_CUDA_HOME, then the known install locations).
cuda: $(STAMPS)/venv
	@if $(BIN)/python -c 'from kgen.toolchain.locate import find_toolchain as f; f()' 2>/dev/null; then \
	  echo "CUDA 11.8 present"; \
	else \
	  echo "installing CUDA 11.8 (nvidia-cuda-toolkit, Debian non-free; ~1.6 GB)"; \
	  if [ -f $(APT_SOURCES) ] && ! grep -q '^Components:.*non-free' $(APT_SOURCES); then \
	    sed -i 's/^Components: main.*$$/Components: main contrib non-free/' $(APT_SOURCES); fi; \
	  apt-get update -q; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nvidia-cuda-toolkit; \
	fi

build: setup
	$(KGEN) build $(KGEN_FLAGS) specs/
	$(KGEN) verify --quiet

verify: setup
	$(KGEN) verify --quiet

lint: $(STAMPS)/venv
	$(BIN)/ruff check kgen tests examples

test: setup lint build
	$(BIN)/python -m pytest -q tests

test-cpu: $(STAMPS)/venv
	$(BIN)/python -m pytest -q tests -m "not gpu and not toolchain"

test-toolchain: setup
	$(BIN)/python -m pytest -q tests -m toolchain

# A wheel of kgen and the kernels just built (generated/ as the package kgen_kernels):
# `pip install dist/kgen-*.whl` on a host with a driver and no toolchain.
dist: build
	$(KGEN) dist

# On a machine with a GPU: installs the wheel (make dist) into a venv of its own, then
# runs the GPU tests with it; needs no toolchain.
test-gpu:
	bash tests/gpu/run_on_device.sh

bench-build: setup
	$(BIN)/python -m kgen.bench.build

# On a machine with a GPU, CuPy and NumPy, after make build (or with the wheel installed).
# A GPU lent minutes a command: bash tests/gpu/bench_on_device.sh runs it in parts from the
# wheel and merges them into one report.
bench-kernels:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m kgen.bench.kernels

# On a machine with a GPU and Nsight Compute (ncu): what bounds each goal shape's default
# kernel (instruction issue, the FP32 pipe, shared memory, DRAM), from its counters.
bench-counters:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m kgen.bench.counters

# Anywhere (CuPy replaced by a stand-in): the host-side Python of the launch paths.
bench-host: setup
	$(BIN)/python -m kgen.bench.host

golden: setup
	$(KGEN) golden

clean:
	rm -rf $(STAMPS) build .pytest_cache .ruff_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

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
comma := ,

# CuPy (it runs the kernels) is the kgen extra for the NVIDIA driver found here,
# by nvidia-smi's "CUDA Version: X.Y": 11 -> cuda11 (a K80's R470 is 11.4), 12 ->
# cuda12, 13 and newer -> cuda13; none without a GPU (building, verifying and CI
# need no CuPy). `make setup CUPY=cuda12` (or CUPY=none) overrides the choice.
DRIVER_CUDA := $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1)
CUPY ?= $(shell m='$(DRIVER_CUDA)'; if [ -z "$$m" ] || [ "$$m" -lt 11 ]; then echo none; \
          elif [ "$$m" -ge 13 ]; then echo cuda13; else echo "cuda$$m"; fi)
CUPY_EXTRAS := cuda11 cuda12 cuda13

.PHONY: setup cuda cuda-install apt-components build verify lint test test-cpu test-toolchain test-gpu dist \
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
# `nvcc --version`), installed from Debian 12's non-free component when missing;
# KGEN_CUDA_HOME points at an install of your own instead. kgen's own locator decides
# (KGEN_CUDA_HOME, then the known install locations). Not root: apt runs through
# `sudo -n` where that needs no password, else the commands to run are printed. Other
# systems (Ubuntu ships no 11.8 package): NVIDIA's CUDA 11.8 installer, no root needed.
cuda: $(STAMPS)/venv
	@if $(BIN)/python -c 'from kgen.toolchain.locate import find_toolchain as f; f()' 2>/dev/null; then \
	  echo "CUDA 11.8 present"; \
	else \
	  $(MAKE) --no-print-directory cuda-install; \
	fi

# Debian's `non-free` and `contrib` components, added to every source line that lacks
# them (deb822 `Components:` lines and classic `deb` lines alike; others are kept).
APT_LISTS ?= $(wildcard /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources)
APT_LINES := /^(Components:|deb(-src)?[[:space:]])/
RUNFILE := https://developer.download.nvidia.com/compute/cuda/11.8.0/local_installers/cuda_11.8.0_520.61.05_linux.run
OS_RELEASE ?= /etc/os-release
SUDO ?= $(shell [ "$$(id -u)" = 0 ] || echo sudo)

apt-components:
	@for f in $(APT_LISTS); do \
	  [ -f "$$f" ] || continue; \
	  for c in contrib non-free; do \
	    $(SUDO) sed -E -i '$(APT_LINES) { / '"$$c"'([[:space:]]|$$)/! s/[[:space:]]*$$/ '"$$c"'/ }' "$$f"; \
	  done; \
	done

cuda-install:
	@. $(OS_RELEASE); if [ "$${ID:-}" != debian ] || [ "$${VERSION_ID:-}" != 12 ]; then \
	  echo "kgen needs CUDA 11.8 (the last toolkit for sm_37); $${PRETTY_NAME:-this system} has no package of it." >&2; \
	  echo "Install NVIDIA's, no root needed (about 4 GB), then point kgen at it:" >&2; \
	  echo "  sh cuda_11.8.0_520.61.05_linux.run --silent --toolkit --toolkitpath=\$$HOME/cuda-11.8   # from $(RUNFILE)" >&2; \
	  echo "  export KGEN_CUDA_HOME=\$$HOME/cuda-11.8" >&2; \
	  exit 2; \
	fi
	@if [ -n "$(SUDO)" ] && ! sudo -n true 2>/dev/null; then \
	  echo "Installing CUDA 11.8 (Debian's nvidia-cuda-toolkit, ~1.6 GB) needs root. Run:" >&2; \
	  echo "  sudo make apt-components   # adds contrib and non-free to the apt sources" >&2; \
	  echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends nvidia-cuda-toolkit" >&2; \
	  echo "then make again; or set KGEN_CUDA_HOME to a CUDA 11.8 you have." >&2; \
	  exit 2; \
	fi
	@echo "installing CUDA 11.8 (nvidia-cuda-toolkit, Debian non-free; ~1.6 GB)"
	@$(MAKE) --no-print-directory apt-components
	$(SUDO) apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nvidia-cuda-toolkit

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

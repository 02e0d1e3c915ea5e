# shardtensor: the two commands.
#
#   make demo   install what is missing (Debian packages, .venv), build, run the demo on $(NP) MPI ranks
#   make test   install what is missing (Debian packages, .venv), build, run every test (ctest)
#
# Also: make demo-vit (examples/vit_train on 4 ranks), make demo-py (examples/python/unet_train.py
# on 4 ranks through the Python package; DEMO_PY_ARGS passes flags), make demo-py-fno
# (examples/python/fno_train.py, the FNO in Python; DEMO_PY_FNO_ARGS).
# Other targets: deps, configure, build, install PREFIX=..., format, format-check, clean,
# test-asan (ASAN_TESTS=regex for a subset), fuzz SECONDS=... NP=... [MESH=2x2] (randomized differential tests),
# bench-quick, bench, bench-report (see bench/run.sh and docs/benchmarks.md).
# Overridable: DEMO (unet_train, fno_train, gnn_train, vit_train, ...), DEMO_ARGS, NP, BUILD_DIR, BUILD_TYPE, JOBS, TEST_JOBS, TEST_TIMEOUT, PREFIX,
# CMAKE_ARGS, MPIRUN_FLAGS, SKIP_DEPS=1 (do not touch the system's packages).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

REPO_ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))

DEMO         ?= unet_train
DEMO_ARGS    ?=
NP           ?= 4
BUILD_DIR    ?= build
BUILD_TYPE   ?= RelWithDebInfo
PREFIX       ?= /usr/local
NPROC        := $(shell nproc 2>/dev/null || echo 2)
JOBS         ?= $(NPROC)
# Each MPI test runs up to 4 ranks and declares PROCESSORS 2 to CTest; half the
# cores as CTest's budget keeps 4-rank tests from piling up (on 2 cores: one at a time).
TEST_JOBS    ?= $(shell n=$$(( $(NPROC) / 2 )); echo $$(( n > 0 ? n : 1 )))
TEST_TIMEOUT ?= 1800
CMAKE_ARGS   ?=
MPIRUN       ?= mpirun
# This Open MPI's spellings (4.1 or 5.0) from cmake/MpiLaunch.cmake (Note [Open MPI 4.1 and
# 5.0 spellings]), as words: version=5.0 flag=--map-by flag=:OVERSUBSCRIBE ... env=NAME=VALUE.
# Empty before `make deps` has installed cmake and Open MPI: then 4.1's spellings (5.0's
# mpirun still accepts --oversubscribe).
MPI_LAUNCH   := $(shell cmake -DMPIEXEC_EXECUTABLE=$(MPIRUN) -DSHARDTENSOR_MPI_PRINT=words \
                  -P $(REPO_ROOT)/cmake/MpiLaunch.cmake 2>/dev/null)
MPIRUN_FLAGS ?= $(if $(MPI_LAUNCH),$(patsubst flag=%,%,$(filter flag=%,$(MPI_LAUNCH))),--oversubscribe --bind-to none)
CLANG_FORMAT ?= $(VENV)/bin/clang-format
BUILD_ABS    := $(if $(filter /%,$(BUILD_DIR)),$(BUILD_DIR),$(REPO_ROOT)/$(BUILD_DIR))

# System parts from Debian (12 or 13; the names are the same on both): MPI, parallel
# HDF5, compilers, GoogleTest, header-only CLI11/JSON. Python and torch come
# from PyPI into a virtual environment (below), never from Debian.
DEB_PACKAGES ?= libopenmpi-dev openmpi-bin libgtest-dev cmake make g++ ccache \
                pkg-config libhdf5-openmpi-dev hdf5-tools \
                nlohmann-json3-dev libcli11-dev jq libgloo-dev

# The project's Python: the active virtual environment ($$VIRTUAL_ENV), else .venv in the
# repo root, made from the machine's python3 (3.11) by `make deps`, with every Python
# dependency pinned in requirements.txt (torch==2.13.0 among them). CMake finds Torch
# through this interpreter (cmake/ProjectTorch.cmake).
PYTHON       ?= python3
VENV         ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),$(REPO_ROOT)/.venv)
VENV_PY      := $(VENV)/bin/python
REQUIREMENTS := $(REPO_ROOT)/requirements.txt

# ccache shared by every build dir of every checkout under one user.
export CCACHE_DIR        ?= $(HOME)/.ccache
export CCACHE_BASEDIR    ?= $(REPO_ROOT)
export CCACHE_NOHASHDIR  ?= 1
export CCACHE_SLOPPINESS ?= pch_defines,time_macros,include_file_mtime,include_file_ctime

# One compute thread per rank; OpenMPI refuses root without these.
export OMP_NUM_THREADS ?= 1
# Containers often forbid the cross-memory-attach single-copy path: single copy off, in this
# Open MPI's spelling (4.1: OMPI_MCA_btl_vader_single_copy_mechanism=none, 5.0:
# OMPI_MCA_smsc=^cma,knem,xpmem); a value already in the environment wins.
MPI_LAUNCH_ENV := $(if $(MPI_LAUNCH),$(patsubst env=%,%,$(filter env=%,$(MPI_LAUNCH))),OMPI_MCA_btl_vader_single_copy_mechanism=none)
mpi_env_name = $(firstword $(subst =, ,$(1)))
$(foreach kv,$(MPI_LAUNCH_ENV),$(eval export $(call mpi_env_name,$(kv)) ?= $(patsubst $(call mpi_env_name,$(kv))=%,%,$(kv))))
ifeq ($(shell id -u),0)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
SUDO :=
else
SUDO := $(shell command -v sudo >/dev/null 2>&1 && echo sudo)
endif

.PHONY: bench-transport deps-debian deps-python fuzz test-asan test-large help demo demo-vit demo-py demo-py-fno test test-opinfo-full deps configure build install format format-check clean \
        bench-build bench-quick bench bench-fixed bench-weak bench-strong bench-maxsize \
        bench-overhead bench-attention bench-scale bench-profile bench-io bench-report bench-deps

help:
	@echo "make demo     build and run examples/$(DEMO) on $(NP) ranks"
	@echo "make demo-vit build and run examples/vit_train (vision transformer, ring attention) on 4 ranks"
	@echo "make demo-py  build the Python package and run examples/python/unet_train.py on 4 ranks"
	@echo "make demo-py-fno  the same for examples/python/fno_train.py (the FNO, Python)"
	@echo "make test     build and run all tests (ctest)"
	@echo "make test-opinfo-full  every sample of PyTorch's OpInfo database through the Python package, 2 and 3 ranks"
	@echo "make deps | configure | build | install PREFIX=dir | format | format-check | clean"
	@echo "make fuzz SECONDS=300 NP=4 [MESH=2x2] [FUZZ_SEED=n]  random programs, sharded vs plain libtorch"
	@echo "                   (reproduce one: FUZZ_SEED=n FUZZ_COUNT=1; tests/fuzz/test_fuzz.cpp lists FUZZ_* knobs)"
	@echo "make test-asan     AddressSanitizer + UBSan build in build-asan/, runs the suite (ASAN_TESTS=regex: a subset)"
	@echo "make bench-quick   benchmark subset (< 10 min on 2 cores) -> bench/results/quick.json"
	@echo "make bench         every benchmark scenario -> bench/results/*.json"
	@echo "make bench-fixed | bench-weak | bench-strong | bench-maxsize | bench-overhead | bench-attention"
	@echo "make bench-scale | bench-profile | bench-io | bench-targets | bench-transport | bench-fsdp   scale model (P = 1..16), per-op profile, HDF5 reads, issue 13's targets, MPI vs Gloo, fully_shard vs replicated"
	@echo "make bench-report  docs/benchmarks.md + docs/img/bench_*.png from bench/results/*.json (gnuplot)"
	@echo "make gpu-check     tools/gpu_check.sh on a GPU machine; make gpu-check-dry: its CPU dry run (docs/gpu.md)"

# Builds only the demo (and the library), not the tests.
demo: configure
	cmake --build $(BUILD_ABS) -j $(JOBS) --target $(DEMO)
	$(MPIRUN) $(MPIRUN_FLAGS) -np $(NP) $(BUILD_ABS)/examples/$(DEMO) $(DEMO_ARGS)

# The vision-transformer example (ring attention on a sharded 2-D field), always on 4 ranks.
demo-vit: configure
	cmake --build $(BUILD_ABS) -j $(JOBS) --target vit_train
	$(MPIRUN) $(MPIRUN_FLAGS) -np 4 $(BUILD_ABS)/examples/vit_train

# The main job through the Python package (python/): same model, data and MATCH check.
# The interpreter is the one CMake found with `import torch` (not whatever python3 is first on PATH).
DEMO_PY_ARGS ?= --size 256 --steps 20 --solver-steps 100
demo-py: configure
	cmake --build $(BUILD_ABS) -j $(JOBS) --target shardtensor_python
	py=$$(sed -n 's/^Python3_EXECUTABLE:FILEPATH=//p' $(BUILD_ABS)/CMakeCache.txt); \
	PYTHONPATH=$(BUILD_ABS)/python $(MPIRUN) $(MPIRUN_FLAGS) -np 4 $${py:-$(VENV_PY)} \
	  $(REPO_ROOT)/examples/python/unet_train.py $(DEMO_PY_ARGS)

# The FNO example through the Python package (examples/python/fno_train.py), on 4 ranks.
DEMO_PY_FNO_ARGS ?= --size 128 --steps 30 --solver-steps 100
demo-py-fno: configure
	cmake --build $(BUILD_ABS) -j $(JOBS) --target shardtensor_python
	py=$$(sed -n 's/^Python3_EXECUTABLE:FILEPATH=//p' $(BUILD_ABS)/CMakeCache.txt); \
	PYTHONPATH=$(BUILD_ABS)/python $(MPIRUN) $(MPIRUN_FLAGS) -np 4 $${py:-$(VENV_PY)} \
	  $(REPO_ROOT)/examples/python/fno_train.py $(DEMO_PY_FNO_ARGS)

# The >2 GiB large-count test (label `large`, ~7.5 GiB peak) runs in `make test-large`.
test: build
	ctest --test-dir $(BUILD_ABS) --output-on-failure --no-tests=error -LE large \
	  --timeout $(TEST_TIMEOUT) -j $(TEST_JOBS)

# PyTorch's OpInfo database, every sample (tests/python/opinfo_sweep.py --full), at 2 and 3
# ranks; `make test` runs its first-sample subset (CTests opinfo.np2, opinfo.np3).
test-opinfo-full: build
	py=$$(sed -n 's/^Python3_EXECUTABLE:FILEPATH=//p' $(BUILD_ABS)/CMakeCache.txt); \
	for np in 2 3; do \
	  PYTHONPATH=$(BUILD_ABS)/python SHARDTENSOR_TIMEOUT=120 $(MPIRUN) $(MPIRUN_FLAGS) -np $$np \
	    $${py:-$(VENV_PY)} $(REPO_ROOT)/tests/python/opinfo_sweep.py --full || exit 1; \
	done

test-large: build
	ctest --test-dir $(BUILD_ABS) --output-on-failure --no-tests=error -L large \
	  --timeout $(TEST_TIMEOUT)

# AddressSanitizer + UndefinedBehaviorSanitizer: a separate build in
# $(ASAN_DIR) (examples and benchmarks off), then the suite with leak checking on
# and suppressions for third-party libraries only (tests/sanitizers/*.supp).
# ASAN_TESTS=regex runs a subset (ctest -R); the Python and install tests are
# skipped (the interpreter is not instrumented). Slow: about 3x the normal suite.
ASAN_DIR   ?= build-asan
ASAN_TESTS ?=
ASAN_ABS   := $(if $(filter /%,$(ASAN_DIR)),$(ASAN_DIR),$(REPO_ROOT)/$(ASAN_DIR))
SAN_FLAGS  := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
test-asan: deps
	cd $(REPO_ROOT) && cmake -S . -B $(ASAN_ABS) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DSHARDTENSOR_BUILD_EXAMPLES=OFF -DSHARDTENSOR_BUILD_BENCH=OFF \
	  -DCMAKE_CXX_FLAGS="$(SAN_FLAGS)" -DCMAKE_EXE_LINKER_FLAGS="$(SAN_FLAGS)" \
	  -DCMAKE_SHARED_LINKER_FLAGS="$(SAN_FLAGS)" -DPython3_EXECUTABLE=$(VENV_PY) $(CMAKE_ARGS)
	cmake --build $(ASAN_ABS) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_init_order=1:detect_stack_use_after_return=0 \
	LSAN_OPTIONS=suppressions=$(REPO_ROOT)/tests/sanitizers/lsan.supp:print_suppressions=0 \
	UBSAN_OPTIONS=suppressions=$(REPO_ROOT)/tests/sanitizers/ubsan.supp:print_stacktrace=1:halt_on_error=1 \
	ctest --test-dir $(ASAN_ABS) --output-on-failure --no-tests=error -LE "install|large|python" \
	  --timeout $(TEST_TIMEOUT) -j $(TEST_JOBS) $(if $(ASAN_TESTS),-R '$(ASAN_TESTS)')

# Randomized differential tester (tests/fuzz/): random programs, sharded vs
# plain libtorch, for SECONDS seconds on NP ranks (MESH=2x2: on the 2x2 mesh,
# NP=4); FUZZ_SEED picks the first seed, and every mismatch prints the one-line
# command that reproduces it. Other FUZZ_* variables (FUZZ_VERBOSE, FUZZ_STEPS,
# FUZZ_DTYPE, FUZZ_EXTENDED, FUZZ_TRACE, FUZZ_DUMP) pass through the environment.
SECONDS   ?= 300
FUZZ_SEED ?= $(shell date +%s)
MESH      ?=
fuzz: configure
	cmake --build $(BUILD_ABS) -j $(JOBS) --target test_fuzz
	FUZZ_SEED=$(FUZZ_SEED) FUZZ_COUNT=100000000 FUZZ_SECONDS=$(SECONDS) \
	  $(if $(MESH),SHARDTENSOR_TEST_MESH=$(MESH)) \
	  $(MPIRUN) $(MPIRUN_FLAGS) -np $(NP) $(BUILD_ABS)/tests/test_fuzz

# deps = Debian's system packages (deps-debian) + the Python environment (deps-python).
deps: deps-debian deps-python

# Checks every package with dpkg-query; apt-get runs only when one is missing.
deps-debian:
ifeq ($(SKIP_DEPS),1)
	@echo "deps: skipped (SKIP_DEPS=1)"
else
	@if ! command -v dpkg-query >/dev/null 2>&1; then \
	  echo "deps: no dpkg-query (not Debian?); assuming the dependencies are installed"; \
	  exit 0; \
	fi; \
	missing=""; \
	for p in $(DEB_PACKAGES); do \
	  status=$$(dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null || true); \
	  if [ "$$status" != "install ok installed" ]; then missing="$$missing $$p"; fi; \
	done; \
	if [ -z "$$missing" ]; then \
	  echo "deps: all $(words $(DEB_PACKAGES)) Debian packages already installed (Debian $$(cat /etc/debian_version 2>/dev/null))"; \
	  exit 0; \
	fi; \
	echo "deps: installing:$$missing"; \
	if [ "$$(id -u)" != 0 ] && [ -z "$(SUDO)" ]; then \
	  echo "deps: not root and no sudo; install as root:"; \
	  echo "  apt-get install -y --no-install-recommends$$missing"; \
	  exit 1; \
	fi; \
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update; \
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(APT_FLAGS) $$missing
endif

# The virtual environment: made once; requirements.txt installed again only when it
# changed (a copy of the installed file is kept in the venv as the stamp).
# mpi4py compiles against Debian's MPI, so this runs after deps-debian.
deps-python: deps-debian
	@if [ ! -x "$(VENV_PY)" ]; then \
	  echo "deps: creating the virtual environment $(VENV) from $$(command -v $(PYTHON)) ($$($(PYTHON) --version 2>&1))"; \
	  $(PYTHON) -m venv "$(VENV)"; \
	fi; \
	if cmp -s "$(REQUIREMENTS)" "$(VENV)/.shardtensor-requirements.txt"; then \
	  echo "deps: $(VENV) matches requirements.txt"; \
	else \
	  echo "deps: installing requirements.txt into $(VENV)"; \
	  "$(VENV_PY)" -m pip install --disable-pip-version-check -q -r "$(REQUIREMENTS)"; \
	  cp "$(REQUIREMENTS)" "$(VENV)/.shardtensor-requirements.txt"; \
	fi

# Configuring again is cheap when nothing changed and rebuilds nothing.
configure: deps
	cd $(REPO_ROOT) && cmake -S . -B $(BUILD_ABS) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DPython3_EXECUTABLE=$(VENV_PY) $(CMAKE_ARGS)

build: configure
	cmake --build $(BUILD_ABS) -j $(JOBS)

install: build
	cmake --install $(BUILD_ABS) --prefix $(PREFIX)

FORMAT_DIRS := include src tests examples bench python
# Only the folders that exist (git does not keep empty ones, e.g. bench/ before it has files).
format-files = cd $(REPO_ROOT) && find $(wildcard $(addprefix $(REPO_ROOT)/,$(FORMAT_DIRS))) \
  -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.cpp' -o -name '*.cc' \) | sort

format:
	$(format-files) | xargs -r $(CLANG_FORMAT) -i

format-check:
	$(format-files) | xargs -r $(CLANG_FORMAT) --dry-run -Werror

clean:
	@test -n "$(BUILD_DIR)" && test "$(BUILD_ABS)" != "$(REPO_ROOT)" && test "$(BUILD_ABS)" != /
	rm -rf -- $(BUILD_ABS)

# ---- benchmarks (bench/run.sh: scenarios; bench/report.sh: docs/benchmarks.md) ----
# Scenario knobs pass through the environment, e.g. make bench CAP_MIB=512 NPS="1 2 4".
BENCH_ENV := BENCH_BIN=$(BUILD_ABS)/bench/shardtensor_bench MPIRUN=$(MPIRUN) MPIRUN_FLAGS="$(MPIRUN_FLAGS)"
BENCH_SCENARIOS := fixed weak strong maxsize overhead attention scale profile io targets transport

bench-build: configure
	cmake --build $(BUILD_ABS) -j $(JOBS) --target shardtensor_bench shardtensor_bench_io

bench-quick: bench-build
	$(BENCH_ENV) $(REPO_ROOT)/bench/run.sh quick

bench: bench-build
	$(BENCH_ENV) $(REPO_ROOT)/bench/run.sh all

$(addprefix bench-,$(BENCH_SCENARIOS)): bench-%: bench-build
	$(BENCH_ENV) $(REPO_ROOT)/bench/run.sh $*

# fully_shard vs replicated parameters, U-Net at P = 4 on 1x4, 2x2, 4x1 (bench/fsdp.sh).
.PHONY: bench-fsdp
bench-fsdp: build
	MPIRUN=$(MPIRUN) MPIRUN_FLAGS="$(MPIRUN_FLAGS)" UNET=$(BUILD_ABS)/examples/unet_train \
	  $(REPO_ROOT)/bench/fsdp.sh $(REPO_ROOT)/bench/results/fsdp.json

# gnuplot-nox only for the report, through the deps mechanism (not a dependency of test/build).
bench-deps:
	$(MAKE) --no-print-directory deps-debian DEB_PACKAGES=gnuplot-nox

bench-report: bench-deps
	$(REPO_ROOT)/bench/report.sh

# docs/ops.md: how every aten op is handled on a ShardTensor (shardtensor::op_coverage()).
.PHONY: docs-ops
docs-ops: configure
	cmake --build $(BUILD_ABS) -j $(JOBS) --target shardtensor_op_coverage
	$(BUILD_ABS)/bench/shardtensor_op_coverage > $(REPO_ROOT)/docs/ops.md

# Compile (syntax only) the library and the Python binding against other torch versions in
# the supported range (tools/check_torch_range.py): TORCH_WHEELS = wheel files or unpacked
# torch package directories. CI tests 2.13.0 by building and running; this proves the rest.
TORCH_WHEELS ?= $(wildcard /opt/pypi-more/files/torch-2.14.1-*.whl)
.PHONY: check-torch-range
check-torch-range: configure
	$(VENV_PY) $(REPO_ROOT)/tools/check_torch_range.py $(BUILD_ABS) $(TORCH_WHEELS)

# The GPU check (docs/gpu.md): a c10d-only build in build-gpu-check/ and its steps.
.PHONY: gpu-check gpu-check-dry
gpu-check:
	$(REPO_ROOT)/tools/gpu_check.sh --jobs $(JOBS)
gpu-check-dry: deps
	$(REPO_ROOT)/tools/gpu_check.sh --dry-run --jobs $(JOBS) --python $(VENV_PY)

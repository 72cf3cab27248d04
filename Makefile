# mhc: `make test` and `make demo` set everything up on a fresh Debian machine, then run.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release -DMHC_WERROR=ON
VENV ?= .venv
PYTHON := $(VENV)/bin/python

# ccache (scripts/setup.sh installs it) under every CMake build of make test: build/, the pip build,
# the consumer, sanitizer, fuzz and mutation builds. CMake reads these variables when it first
# configures a build directory (a directory configured before keeps its setting). A fresh clone
# starts with an empty cache; it still saves the compiles that repeat within one run (make mutate
# recompiling each restored file). Recursive variables: expanded when a recipe runs, after setup
# has installed ccache on a fresh machine (empty, so no launcher, where it is missing).
ccache_path = $(shell command -v ccache 2> /dev/null)
ifeq ($(origin CMAKE_CXX_COMPILER_LAUNCHER),undefined)
export CMAKE_C_COMPILER_LAUNCHER = $(ccache_path)
export CMAKE_CXX_COMPILER_LAUNCHER = $(ccache_path)
export CMAKE_CUDA_COMPILER_LAUNCHER = $(ccache_path)
endif
# build/, the pip build (build/python) and make mutate's copy (build-mutate/tree) compile the library
# with the same flags: ccache serves the later two from the first when their commands match, which
# needs the same compiler name (CMake would pick c++ for one and g++ for the other; ccache hashes
# the name), and paths relative to the checkout (base_dir; each build directory sits one level
# below its source tree).
export CXX
export CCACHE_BASEDIR ?= $(CURDIR)

# Each stage of make test prints its wall and CPU time (scripts/timed.sh).
timed = bash $(CURDIR)/scripts/timed.sh $@

.PHONY: setup configure build python check test test-cpp test-python sanitize fuzz format lint coverage mutate bench bench-cpp demo \
	example consumer clean tpu-compile tpu-compile-v4

# Debian packages (scripts/setup.sh installs only what is missing).
setup:
	@bash scripts/setup.sh

configure: setup
	@cmake -S . -B $(BUILD) $(CMAKE_FLAGS) > /dev/null

build: configure
	@$(timed) cmake --build $(BUILD) -j $(JOBS)

# The virtual environment with the pinned Python packages, rebuilt when the pins change.
$(VENV)/.installed: requirements-dev.txt requirements-torch.txt
	@python3 -m venv $(VENV)
	@$(VENV)/bin/pip install -q --upgrade pip
	@$(VENV)/bin/pip install -q -r requirements-dev.txt
	@# torch without its CUDA requirements (requirements-torch.txt says why)
	@$(VENV)/bin/pip install -q --no-deps -r requirements-torch.txt
	@touch $@

# The mhc Python package (C++ core + XLA FFI handlers), built against the venv's jaxlib.
python: setup $(VENV)/.installed
	@$(timed) $(VENV)/bin/pip install -q --no-build-isolation .

test-cpp: build
	@cd $(BUILD) && $(timed) ctest --output-on-failure -j $(JOBS)

# The installed package from a separate CMake project (tests/consumer/, find_package(mhc)): build/
# installed as built (static), then a library-only shared build (build-install-shared/).
consumer: build
	@BUILD=$(BUILD) JOBS=$(JOBS) $(timed) bash scripts/consumer_test.sh

test-python: python
	@$(PYTHON) -m pytest -q -n $(JOBS) tests/python

# The everyday loop (minutes after the first build): the build, the C++ tests but the > 2^31-element
# shapes (CTest label "large": a minute and 11 GB), and the Python tests not marked slow
# (pyproject.toml, "markers", says what counts as slow), without coverage, sanitizers, fuzzing,
# mutations or lint. make test runs everything.
check: build python
	@cd $(BUILD) && $(timed) ctest --output-on-failure -j $(JOBS) --label-exclude large
	@$(timed) $(PYTHON) -m pytest -q -n $(JOBS) -m "not slow" tests/python

# The C++ tests under ASan + UBSan (also measuring C++ line coverage; fails under 85% of src/'s
# lines) and under TSan (clang).
sanitize: setup
	@$(timed) bash scripts/sanitize.sh

# libFuzzer over the public C++ API for FUZZ_SECONDS (default 30).
fuzz: setup
	@$(timed) bash scripts/fuzz.sh

# Rewrites C++/CUDA (clang-format) and Python (ruff format, ruff's safe fixes) in place.
format: setup $(VENV)/.installed
	@bash scripts/lint.sh --fix

# Checks formatting, then clang-tidy (.clang-tidy) and ruff check (pyproject.toml); fails on any finding.
lint: setup $(VENV)/.installed
	@$(timed) bash scripts/lint.sh

# Python tests under coverage.py; fails under 85% of the package's lines.
coverage: python
	@$(timed) bash scripts/coverage.sh

# Plants each semantic bug listed in scripts/mutate.py in a copy of the tree (build-mutate/), rebuilds
# incrementally and runs the fast tests: fails unless every mutation is caught.
mutate: setup $(VENV)/.installed
	@$(timed) python3 scripts/mutate.py

# Every test: C++ (GoogleTest through CTest), the installed package, sanitizers, a bounded fuzz run,
# Python (pytest, run once, under coverage), the mutation check and the lint checks. build/ first
# (the pip build and make mutate's copy are then served from its compiles by ccache), then the
# package, then the stages TEST_STAGES at a time, longest first: each stage uses every core for
# most of its time but one thread for part of it (configuring, linking, the fuzzer, each mutation's
# pytest), which the other stage fills. -o: what the first two steps made is not made again (a
# pip install into .venv while make mutate's pytest starts from it fails that pytest).
# --output-sync prints each stage's output whole, when it ends, with its time (scripts/timed.sh;
# docs/testing.md, "CI time").
TEST_STAGES ?= 2
test: setup $(VENV)/.installed
	@$(MAKE) --no-print-directory build
	@$(MAKE) --no-print-directory python
	@$(MAKE) --no-print-directory -j $(TEST_STAGES) --output-sync=target -o setup -o configure -o build -o python \
		coverage mutate sanitize lint test-cpp consumer fuzz

# Kernels vs the jitted plain-JAX path on the roofline (python -m mhc.bench; BENCH_ARGS passes
# flags, e.g. BENCH_ARGS="--tokens 8192 --dims 4096 --dtypes bf16 --json bench.json").
bench: python
	@$(PYTHON) -m mhc.bench $(BENCH_ARGS)

# Google Benchmark timing of the four C++ operations next to a large memcpy.
bench-cpp: build
	@$(BUILD)/mhc_bench --benchmark_min_time=0.5

# The TPU kernels (every operation of mhc.tpu.KERNELS) compiled for v5e and v6e through libtpu's
# compile-only topologies (no TPU needed, nothing runs) at n = 4, D = 2048, bf16, T = 4096: token
# tile, compile time, VMEM, the HBM-byte floor per kernel (tens of minutes on 2 cores).
# TPU_COMPILE_ARGS passes flags, e.g. "--dtype float32 --kernels mhc_boundary_forward".
tpu-compile: python
	@$(PYTHON) -m mhc.tpu.compile_report --estimate $(TPU_COMPILE_ARGS)

# The same at DeepSeek-V4's widths, D = 4096 and 7168 (an hour or more on 2 cores).
tpu-compile-v4: python
	@$(PYTHON) -m mhc.tpu.compile_report --estimate --d 4096 7168 $(TPU_COMPILE_ARGS)

# The main job: train a small byte-level mHC transformer on the CPU with the fused kernels
# (about 3 minutes on 2 cores); outputs in demo_output/. DEMO_ARGS passes flags, e.g. --compare.
demo: python
	@$(PYTHON) -m mhc.demo $(DEMO_ARGS)

# One mHC sublayer forward and backward through the C++ API alone: examples/ as a project of its
# own, built against build/ installed into $(BUILD)/example-install (docs/cpp.md, "Build and install").
example: build
	@cmake --install $(BUILD) --prefix $(abspath $(BUILD))/example-install > /dev/null
	@cmake -S examples -B $(BUILD)/example -DCMAKE_PREFIX_PATH=$(abspath $(BUILD))/example-install > /dev/null
	@cmake --build $(BUILD)/example
	@$(BUILD)/example/mhc_example

clean:
	@rm -rf $(BUILD) build-asan build-tsan build-fuzz build-lint build-mutate build-install-shared $(VENV)

# mhc: `make test` and `make demo` set everything up on a fresh Debian machine, then run.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release -DMHC_WERROR=ON

.PHONY: setup configure build test bench demo clean

setup:
	@bash scripts/setup.sh

configure: setup
	@cmake -S . -B $(BUILD) $(CMAKE_FLAGS) > /dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# Every C++ test through CTest (GoogleTest cases, each its own process).
test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# Google Benchmark timing of the four operations next to a large memcpy (the bandwidth limit).
bench: build
	@$(BUILD)/mhc_bench --benchmark_min_time=0.5

# The main job. Until the JAX layer and the model demo land, it runs one mHC sublayer forward and
# backward through the C++ API.
demo: build
	@$(BUILD)/mhc_example

clean:
	@rm -rf $(BUILD)

#!/usr/bin/env bash
# libFuzzer over the public C++ API (tests/fuzz/api_fuzzer.cc) for a bounded time, starting from
# the seed corpus in tests/fuzz/corpus. FUZZ_SECONDS sets the time (default 30: a CI run; fuzz longer
# by hand after changing validation, e.g. FUZZ_SECONDS=600 make fuzz).
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=clang++ cmake -S . -B build-fuzz -DMHC_BUILD_FUZZER=ON -DMHC_BUILD_TESTS=OFF -DMHC_BUILD_BENCH=OFF \
  -DMHC_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
cmake --build build-fuzz -j "$(nproc)" > /dev/null
work=build-fuzz/corpus
mkdir -p "$work"
./build-fuzz/mhc_api_fuzzer -max_total_time="${FUZZ_SECONDS:-30}" -timeout=10 -rss_limit_mb=4096 \
  -print_final_stats=1 "$work" tests/fuzz/corpus 2>&1 | grep -E "^(Done|stat::number_of_executed_units|==|SUMMARY)|ERROR|crash" || true
test "${PIPESTATUS[0]}" -eq 0

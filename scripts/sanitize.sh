#!/usr/bin/env bash
# The C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer (every test, two shards in
# parallel), then the multithreaded paths under ThreadSanitizer. Any report fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
common=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHC_BUILD_BENCH=OFF -DMHC_BUILD_EXAMPLES=OFF -DMHC_WERROR=ON)

echo "== AddressSanitizer + UndefinedBehaviorSanitizer"
CXX=clang++ cmake -S . -B build-asan -DMHC_SANITIZE=address,undefined "${common[@]}" > /dev/null
cmake --build build-asan -j "$jobs" --target mhc_tests > /dev/null
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# Every case but the largest shapes and the sweeps that repeat smaller ones (D = 1024, T = 4096,
# the coefficient loops over many tokens, the thread-count sweep over mixes and dtypes): they took
# half of the ASan run and exercise no code path the rest misses (D = 130 spans several projection
# blocks and a remainder, T = 257 several tiles and gradient chunks, D = 4096 the decode split).
# make test-cpp runs them.
asan_filter='-CoefficientTokenLoop.*:*T4096*:*D1024*:MixAndDtype/*'
pids=()
for shard in 0 1; do
  GTEST_FILTER=$asan_filter GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=$shard ./build-asan/mhc_tests \
    --gtest_brief=1 > "build-asan/shard$shard.log" 2>&1 &
  pids+=($!)
done
status=0
for shard in 0 1; do
  if ! wait "${pids[$shard]}"; then status=1; fi
  tail -n 3 "build-asan/shard$shard.log"
done
if [ $status -ne 0 ]; then
  cat build-asan/shard*.log | grep -E -A20 "ERROR|runtime error|FAILED" | head -80
  exit 1
fi

echo "== ThreadSanitizer (thread pool, determinism, multithreaded kernels)"
CXX=clang++ cmake -S . -B build-tsan -DMHC_SANITIZE=thread "${common[@]}" > /dev/null
cmake --build build-tsan -j "$jobs" --target mhc_tests > /dev/null
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ./build-tsan/mhc_tests --gtest_brief=1 \
  --gtest_filter='*Determinism*:Threads.*:*n4_D130_T257*:*NonFinite*:*BoundaryVsSeparate*sinkhorn_n4_D4096_T37_bf16*'

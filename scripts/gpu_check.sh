#!/usr/bin/env bash
# One call on a GPU machine (an H200 lent for a few minutes): build the CUDA backend there, run
# its tests (every output and gradient against the float64 reference), compute-sanitizer on small
# cases, the CUDA-event benchmark of the four operations against the device copy bandwidth, the
# Python package's GPU custom calls, and the jitted sublayer against the plain-JAX path. Logs and
# JSON go to $OUT (or ./gpu_check_out); a short table is printed last.
#
#   bash scripts/gpu_check.sh --prepare   # here, before the call: copies GoogleTest into .gtest/
#   bash scripts/gpu_check.sh             # there; carry .gtest (the GPU image has no GoogleTest)
#
# The tensor-core projection (opt-in, MHC_CUDA_TENSOR_CORES=1) gets its own test and bench stage.
# Every stage has a time limit and the script stops starting stages before 9.5 minutes, so the
# table comes back even when something hangs. GPU_ARCH (default 90) picks the one architecture to
# build there, to keep the build short.
set -u
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--prepare" ]]; then
  rm -rf .gtest && mkdir -p .gtest/lib .gtest/include
  cp -r /usr/include/gtest .gtest/include/
  cp /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a .gtest/lib/
  grep -qx '/.gtest/' .git/info/exclude 2>/dev/null || echo '/.gtest/' >> .git/info/exclude
  echo "prepared .gtest/ ($(du -sh .gtest | cut -f1)); carry it: run(..., carry=[\".gtest\"])"
  exit 0
fi

OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
ARCH="${GPU_ARCH:-90}"
JOBS="$(nproc)"
PY="${PYTHON:-python3}"
DEADLINE=$(($(date +%s) + 570))
summary=()

# stage NAME LIMIT_SECONDS COMMAND...: runs with a time limit (cut to the deadline), logs to
# $OUT/NAME.log, prints the log's tail and records the exit status.
stage() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - $(date +%s)))
  if ((left < 20)); then
    summary+=("$(printf '%-14s skipped (out of time)' "$name")")
    return 1
  fi
  ((limit > left)) && limit=$left
  local start rc
  start=$(date +%s)
  # bash -c: the stages are shell functions (exported below), which timeout cannot run itself.
  timeout --kill-after=5 "$limit" bash -c '"$@"' _ "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  local took=$(($(date +%s) - start))
  echo "== $name: exit $rc after ${took}s"
  tail -n 12 "$OUT/$name.log"
  local verdict=ok
  ((rc == 124 || rc == 137)) && verdict="TIMED OUT (limit ${limit}s)"
  ((rc != 0 && rc != 124 && rc != 137)) && verdict="FAILED (exit $rc)"
  summary+=("$(printf '%-14s %-28s %4ss' "$name" "$verdict" "$took")")
  return $rc
}

info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  nvcc --version | tail -n 2
  cmake --version | head -n 1
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
}

build() {
  local gtest=()
  [[ -d .gtest ]] && gtest=(-DGTest_ROOT="$PWD/.gtest" -DGTEST_ROOT="$PWD/.gtest")
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DMHC_BUILD_CUDA=ON \
    -DMHC_CUDA_ARCHITECTURES="$ARCH" -DMHC_BUILD_BENCH=OFF -DMHC_BUILD_EXAMPLES=OFF \
    -DMHC_WERROR=OFF "${gtest[@]}" &&
    cmake --build build-gpu -j "$JOBS" --target mhc_cuda_tests mhc_cuda_bench
}

# The test binary in 8 shards at once (each shard one CUDA context); failures are listed.
device_tests() {
  local shards=8 pids=() rc=0
  for ((i = 0; i < shards; ++i)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i ./build-gpu/mhc_cuda_tests --gtest_brief=1 \
      >"$OUT/tests_shard$i.txt" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  cat "$OUT"/tests_shard*.txt | grep -E '^\[  (PASSED|FAILED|SKIPPED) \]|Failure|error|Error' | sort | uniq -c | sort -rn | head -n 40
  rm -f "$OUT"/tests_shard*.txt
  return $rc
}

sanitize() {
  local cases='Shapes/KernelsVsReference.*/sinkhorn_n3_D130_T5_bf16_bf16:Shapes/KernelsVsReference.*/permutations_n4_D7_T257_f32_f32'
  compute-sanitizer --tool memcheck --error-exitcode 9 ./build-gpu/mhc_cuda_tests --gtest_brief=1 \
    --gtest_filter="$cases" &&
    compute-sanitizer --tool racecheck --error-exitcode 9 ./build-gpu/mhc_cuda_tests \
      --gtest_brief=1 --gtest_filter='Shapes/KernelsVsReference.PostBackward/sinkhorn_n3_D130_T5_f32_f32'
}

python_package() {
  "$PY" -m pip install -q --no-build-isolation --no-deps -C cmake.define.MHC_CUDA_ARCHITECTURES="$ARCH" \
    -C cmake.define.MHC_WERROR=OFF -C build-dir=build-gpu-python . &&
    "$PY" -c "from mhc import _ffi; print('CUDA targets', _ffi.CUDA_TARGETS)"
}

export OUT ARCH JOBS PY
export -f info build device_tests sanitize python_package

stage info 60 info
if stage build 240 build; then
  stage tests 150 device_tests
  stage bench_cpp 120 ./build-gpu/mhc_cuda_bench --json "$OUT/cuda_bench.json"
  # The opt-in tensor-core projection (bf16 x): its tests and its timings beside the default.
  stage tests_tc 120 env MHC_CUDA_TENSOR_CORES=1 ./build-gpu/mhc_cuda_tests --gtest_brief=1 \
    --gtest_filter='*bf16*:Cuda*'
  stage bench_tc 90 env MHC_CUDA_TENSOR_CORES=1 ./build-gpu/mhc_cuda_bench \
    --json "$OUT/cuda_bench_tc.json"
  stage sanitizer 90 sanitize
fi
if stage python 200 python_package; then
  stage pytest 150 env JAX_DEFAULT_MATMUL_PRECISION=highest "$PY" -m pytest -q -x -p no:cacheprovider \
    tests/python/test_cuda.py tests/python/test_kernels_vs_reference.py
  stage bench_jax 200 "$PY" -m mhc.bench --tokens 4096 65536 --dims 4096 7168 --dtypes bf16 \
    --ops sublayer_fwd sublayer_fwd_bwd --no-memory --repeats 10 --json "$OUT/jax_bench.json"
fi

echo
echo "== stages"
printf '%s\n' "${summary[@]}"
"$PY" - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
cpp, tc, jx = load("cuda_bench.json"), load("cuda_bench_tc.json"), load("jax_bench.json")
if cpp:
    print(f"\n== {cpp['device']}: copy {cpp['copy_gbs']:.0f} GB/s; CUDA events, median of {cpp['repeats']}, {cpp['dtype']}, n={cpp['n']}")
    print(f"{'op':<14} {'T':>6} {'D':>5} {'ms':>9} {'GB/s':>7} {'of copy':>8} {'ms (tensor cores)':>18}")
    tc_ms = {(r["op"], r["tokens"], r["dim"]): r["ms"] for r in (tc or {}).get("rows", [])}
    for r in cpp["rows"]:
        other = tc_ms.get((r["op"], r["tokens"], r["dim"]))
        other = f"{other:>18.3f}" if other is not None else f"{'-':>18}"
        print(f"{r['op']:<14} {r['tokens']:>6} {r['dim']:>5} {r['ms']:>9.3f} {r['gbs']:>7.0f} {r['copy_fraction']:>8.1%} {other}")
if jx:
    print(f"\n== jitted sublayer, kernel vs plain JAX (wall clock, median of {jx['repeats']})")
    print(f"{'op':<17} {'T':>6} {'D':>5} {'kernel ms':>10} {'plain ms':>9} {'speedup':>8}")
    for r in jx["rows"]:
        print(f"{r['op']:<17} {r['tokens']:>6} {r['dim']:>5} {r['kernel_ms']:>10.3f} {r['plain_ms']:>9.3f} {r['speedup']:>7.2f}x")
PYEOF

#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine (an H200 lent for a few minutes): one Ninja build of
# the library, its CUDA tests and benchmark and the Python FFI modules, then the device tests,
# compute-sanitizer, the CUDA-event benchmark, the Python package on the GPU, the jitted
# sublayer against plain JAX, and mhc.torch on CUDA tensors. It cannot pass by accident: every device test runs with
# MHC_REQUIRE_CUDA=1 (no device fails instead of skipping), a skipped or missing test fails its
# stage, and the Python stages fail unless jax's default device is a GPU.
#
#   bash scripts/gpu_check.sh --prepare      # here, before the call: copies GoogleTest to .gtest/
#   bash scripts/gpu_check.sh                # there, with carry=[".gtest"]: every stage
#   bash scripts/gpu_check.sh --only tests   # one stage again (comma-separated list; the build
#                                            # and the toolchain probe run first when needed)
#   bash scripts/gpu_check.sh --list         # the stages, their limits and estimates
#
# $OUT (default BUILD/out) receives three files: summary.txt (the table), results.json (every
# stage and result) and logs.tar.gz (every log and raw JSON). Environment: GPU_ARCH (default 90,
# the one architecture built), GPU_CHECK_BUILD (default build-gpu), GPU_CHECK_JOBS (default
# nproc), GPU_CHECK_BUDGET (seconds for the whole run, default 540: no stage starts with less
# than 20 s left, so the summary comes back inside a 10-minute call), PYTHON (the interpreter
# with jax and nanobind; otherwise found), TORCH_PYTHON (the torch stage's interpreter, default the
# same; it must be the same Python version, the package's extension being built for that one).
#
# Estimate on the H200 machine (16 cores), seconds, against each stage's limit. Not measured
# there yet; derived from a 2-core machine (a clean build of these targets: 103 s there, 106 s
# of CPU, of which the longest file, src/cuda/streams.cu, took 36-40 s and bounds the build on
# 16 cores; its backward's double sums raised its sm_90 compile from 20 to 33 s of CPU, so about
# 60 s now) and from the work each stage does:
#   stage       estimate  limit  what
#   info              10     60  toolchain probe (nvcc, compute-sanitizer, cmake, ninja, python
#                                with jax and nanobind, GoogleTest), nvidia-smi
#   build            100    300  cmake -G Ninja + one build: mhc_cuda_tests, mhc_cuda_bench,
#                                _mhc_cpu, _mhc_cuda (sm_90 only; streams.cu is the critical
#                                path); then the Python package staged in BUILD/python_pkg and
#                                its CUDA FFI targets checked (no pip, no second compile)
#   device             5     60  MHC_REQUIRE_CUDA=1 CudaRequired.DeviceIsPresent: the first GPU
#                                stage; without a device every later stage is skipped
#   tests             45    180  mhc_cuda_tests in shards on all cores: every case, plus the bf16
#                                cases with MHC_CUDA_TENSOR_CORES=1; fails on any skip
#   sanitizer         45    150  compute-sanitizer memcheck (vector path, D = 1024; a misaligned
#                                case), then racecheck and synccheck (pre_backward)
#   bench_cpp         30    150  mhc_cuda_bench (T 4096, 65536 x D 4096, 7168, bf16), then again
#                                with MHC_CUDA_TENSOR_CORES=1
#   pytest            40    180  test_cuda.py + a subset of test_kernels_vs_reference.py on the
#                                GPU, XLA autotuning off
#   bench_jax         35    180  python -m mhc.bench: sublayer fwd and fwd+bwd, kernel vs plain JAX,
#                                at the target shape only (T = 65536, D = 7168, bf16)
#   torch             30    120  scripts/gpu_check_torch.py (UNVERIFIED: never run on a GPU; its CPU
#                                dry run, --device cpu, has): mhc.torch's kernel path on CUDA tensors
#                                refused as documented (no CUDA op registered; if one runs, compared
#                                with the CPU kernels instead), the plain-torch path's sublayer
#                                forward+backward on the GPU (f32, bf16) and the transformers
#                                drop-in against the CPU kernels; fails unless torch sees a GPU
#   total            340         (under 6 minutes; a fresh machine's start comes on top)
# shellcheck disable=SC2317  # the stage functions run indirectly: timeout ... bash -c NAME
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD

STAGES=(info build device tests sanitizer bench_cpp pytest bench_jax torch)
GPU_STAGES="device tests sanitizer bench_cpp pytest bench_jax torch"
declare -A LIMIT=([info]=60 [build]=300 [device]=60 [tests]=180 [sanitizer]=150 [bench_cpp]=150
  [pytest]=180 [bench_jax]=180 [torch]=120)
declare -A ESTIMATE=([info]=10 [build]=100 [device]=5 [tests]=45 [sanitizer]=45 [bench_cpp]=30
  [pytest]=40 [bench_jax]=35 [torch]=30)

# Test selections (checked against --gtest_list_tests of a CPU build).
TC_FILTER='*bf16*:CudaDevice.BitwiseRunToRun:CudaDevice.SanitizerVectorPathD1024'
MEMCHECK_FILTER='CudaDevice.SanitizerVectorPathD1024:ByOneElement/MisalignedViews.FourOperations/D64_bf16_all'
RACECHECK_FILTER='CudaDevice.SanitizerPreBackward'
SYNCCHECK_FILTER='CudaDevice.SanitizerPreBackward'
# test_kernels_vs_reference.py on the GPU: both dtypes and mixes at (D, n) = (1, 1) and (130, 4), and the
# non-default configs (every config scalar through the CUDA FFI handlers) in f32.
PYTEST_SUBSET='test_cuda or (test_outputs_and_gradients and (1-1- or 130-4-)) or (test_non_default_config and f32)'

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }

if [[ "${1:-}" == "--prepare" ]]; then
  rm -rf .gtest && mkdir -p .gtest/lib .gtest/include
  cp -r /usr/include/gtest .gtest/include/
  cp /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib/x86_64-linux-gnu/libgtest_main.a .gtest/lib/
  mkdir -p .git/info
  grep -qx '/.gtest/' .git/info/exclude 2>/dev/null || echo '/.gtest/' >>.git/info/exclude
  echo "prepared .gtest/ ($(du -sh .gtest | cut -f1)); carry it: run(..., carry=[\".gtest\"])"
  exit 0
fi

ONLY=""
while (($#)); do
  case "$1" in
    --only)
      ONLY="${2:-}"
      shift 2 || {
        echo "--only needs a stage name" >&2
        exit 2
      }
      ;;
    --list)
      printf '%-10s %8s %6s\n' stage estimate limit
      for s in "${STAGES[@]}"; do printf '%-10s %7ss %5ss\n' "$s" "${ESTIMATE[$s]}" "${LIMIT[$s]}"; done
      exit 0
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    *)
      echo "unknown argument $1" >&2
      usage >&2
      exit 2
      ;;
  esac
done
for s in ${ONLY//,/ }; do
  [[ -n "${LIMIT[$s]:-}" ]] || {
    echo "unknown stage '$s' (stages: ${STAGES[*]})" >&2
    exit 2
  }
done

BUILD="$ROOT/${GPU_CHECK_BUILD:-build-gpu}"
OUT="${OUT:-$BUILD/out}"
LOGS="$BUILD/logs"
PKG="$BUILD/python_pkg"
ARCH="${GPU_ARCH:-90}"
JOBS="${GPU_CHECK_JOBS:-$(nproc)}"
BUDGET="${GPU_CHECK_BUDGET:-540}"
START=$(date +%s)
DEADLINE=$((START + BUDGET))
mkdir -p "$OUT" "$LOGS"
rm -rf "${LOGS:?}"/* "$OUT/summary.txt" "$OUT/results.json" "$OUT/logs.tar.gz"
export ROOT BUILD OUT LOGS PKG ARCH JOBS TC_FILTER MEMCHECK_FILTER RACECHECK_FILTER \
  SYNCCHECK_FILTER PYTEST_SUBSET

# --- stages: each runs as `bash -c NAME` under timeout, its output in $LOGS/NAME.log ---

# The toolchain: written to $BUILD/toolchain.env for the later stages. Fails when something the
# build needs is missing; a missing compute-sanitizer or a jax without a GPU fails later stages.
info() {
  local env="$BUILD/toolchain.env" missing=() py="" platform="" jax_version="" c probe
  first() {
    for c in "$@"; do [[ -n "$c" && -f "$c" && -x "$c" ]] && echo "$c" && return 0; done
    return 1
  }
  # Python: $PYTHON if it has jax and nanobind, else the first candidate whose jax has a GPU,
  # else the first with jax and nanobind at all (enough for the build).
  local candidates=()
  [[ -n "${PYTHON:-}" ]] && candidates+=("$PYTHON")
  candidates+=("$(command -v python3 || true)" /opt/torch/.venv/bin/python3 /usr/bin/python3
    /usr/local/bin/python3)
  local fallback="" fallback_platform="" fallback_version=""
  for c in "${candidates[@]}"; do
    [[ -n "$c" && -x "$c" ]] || continue
    probe=$(timeout 120 "$c" -c 'import jax, nanobind; print(jax.__version__, jax.devices()[0].platform)' \
      2>/dev/null | tail -n 1) || continue
    [[ "$probe" == *" "* ]] || continue
    echo "python candidate $c: jax ${probe% *}, default device platform ${probe#* }"
    if [[ "${probe#* }" == gpu || "$c" == "${PYTHON:-}" ]]; then
      py=$c platform=${probe#* } jax_version=${probe% *}
      break
    fi
    [[ -z "$fallback" ]] && fallback=$c fallback_platform=${probe#* } fallback_version=${probe% *}
  done
  if [[ -z "$py" && -n "$fallback" ]]; then
    py=$fallback platform=$fallback_platform jax_version=$fallback_version
  fi
  local site=""
  [[ -n "$py" ]] && site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)

  local nvcc sanitizer ninja cmake smi gtest="" cuda_dirs=() opt_tools=()
  # CUDA installs, newest version first; then the toolkit wheels of the chosen python.
  mapfile -t cuda_dirs < <(find /usr/local -maxdepth 1 -name 'cuda-*' -type d 2>/dev/null | sort -rV)
  nvcc=$(first "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc "${cuda_dirs[@]/%//bin/nvcc}" \
    "$site"/nvidia/cuda_nvcc/bin/nvcc "$site"/nvidia/cu*/bin/nvcc) || missing+=(nvcc)
  local cuda_bin=""
  [[ -n "${nvcc:-}" ]] && cuda_bin=$(dirname "$nvcc")
  mapfile -t opt_tools < <(find /opt/nvidia -maxdepth 5 -name compute-sanitizer -type f 2>/dev/null)
  sanitizer=$(first "$(command -v compute-sanitizer || true)" "$cuda_bin/compute-sanitizer" \
    "$cuda_bin/../compute-sanitizer/compute-sanitizer" \
    /usr/local/cuda/compute-sanitizer/compute-sanitizer /usr/local/cuda/bin/compute-sanitizer \
    "${cuda_dirs[@]/%//compute-sanitizer/compute-sanitizer}" "${cuda_dirs[@]/%//bin/compute-sanitizer}" \
    "${opt_tools[@]}") || sanitizer=""
  ninja=$(first "$(command -v ninja || true)" "${py:+$(dirname "$py")/ninja}" \
    "$([[ -n "$py" ]] && "$py" -c 'import ninja, os; print(os.path.join(ninja.BIN_DIR, "ninja"))' 2>/dev/null)") ||
    missing+=(ninja)
  cmake=$(first "$(command -v cmake || true)" "${py:+$(dirname "$py")/cmake}" \
    "$([[ -n "$py" ]] && "$py" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))' 2>/dev/null)") ||
    missing+=(cmake)
  smi=$(first "$(command -v nvidia-smi || true)" /usr/local/nvidia/bin/nvidia-smi /usr/bin/nvidia-smi) || smi=""
  if [[ -f "$ROOT/.gtest/include/gtest/gtest.h" ]]; then
    gtest="$ROOT/.gtest"
  elif [[ -f /usr/include/gtest/gtest.h ]] && compgen -G '/usr/lib/*/libgtest.a' >/dev/null; then
    gtest=system
  else
    missing+=("GoogleTest (run 'bash scripts/gpu_check.sh --prepare' where it is installed and carry .gtest)")
  fi
  [[ -n "$py" ]] || missing+=("a python with jax and nanobind (set PYTHON)")

  {
    printf 'NVCC=%q\nSANITIZER=%q\nNINJA=%q\nCMAKE=%q\nPY=%q\n' "${nvcc:-}" "$sanitizer" \
      "${ninja:-}" "${cmake:-}" "$py"
    printf 'PY_PLATFORM=%q\nJAX_VERSION=%q\nGTEST=%q\nSMI=%q\n' "$platform" "$jax_version" \
      "$gtest" "$smi"
  } >"$env"
  echo "nvcc:              ${nvcc:-MISSING} $([[ -n "${nvcc:-}" ]] && "$nvcc" --version | tail -n 1)"
  echo "compute-sanitizer: ${sanitizer:-MISSING (the sanitizer stage will fail)}"
  echo "cmake:             ${cmake:-MISSING} $([[ -n "${cmake:-}" ]] && "$cmake" --version | head -n 1)"
  echo "ninja:             ${ninja:-MISSING} $([[ -n "${ninja:-}" ]] && "$ninja" --version)"
  echo "python:            ${py:-MISSING} (jax ${jax_version:-?}, default device platform ${platform:-?})"
  [[ -n "$py" && "$platform" != gpu ]] &&
    echo "                   WARNING: jax's default device is not a GPU: the pytest and bench_jax stages will fail"
  echo "GoogleTest:        ${gtest:-MISSING}"
  echo "build:             $BUILD, sm_$ARCH, $JOBS jobs"
  if [[ -n "$smi" ]]; then
    "$smi" --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
  else
    echo "nvidia-smi:        not found (no NVIDIA driver here?)"
  fi
  if ((${#missing[@]})); then
    printf 'MISSING: %s\n' "${missing[@]}"
    return 1
  fi
}

# One cmake configure and one Ninja build of everything the later stages run, then the Python
# package staged from python/mhc (links) and the two modules just built. If the Python modules
# cannot be configured (no Python headers, say), the C++ targets are still built so that the C++
# GPU stages run; the Python stages then fail, saying so.
configure() {
  local gtest=()
  [[ "$GTEST" != system ]] && gtest=(-DGTest_ROOT="$GTEST" -DGTEST_ROOT="$GTEST")
  "$CMAKE" -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA" \
    -DCMAKE_BUILD_TYPE=Release -DMHC_BUILD_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" \
    -DMHC_CUDA_ARCHITECTURES="$ARCH" -DMHC_BUILD_PYTHON="$1" -DPython_EXECUTABLE="$PY" \
    -DMHC_BUILD_TESTS=ON -DMHC_BUILD_BENCH=OFF -DMHC_BUILD_EXAMPLES=OFF -DMHC_WERROR=OFF \
    "${gtest[@]}" >"$LOGS/build_configure.log" 2>&1
}
build() {
  # A cache from another generator (an earlier make-based build) cannot be reused.
  if [[ -f "$BUILD/CMakeCache.txt" ]] && ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$BUILD/CMakeCache.txt"; then
    rm -rf "$BUILD/CMakeCache.txt" "$BUILD/CMakeFiles"
  fi
  local t0 python=ON targets=(mhc_cuda_tests mhc_cuda_bench)
  t0=$(date +%s)
  rm -rf "$PKG"
  if ! configure ON; then
    tail -n 20 "$LOGS/build_configure.log"
    mv "$LOGS/build_configure.log" "$LOGS/build_configure_python.log"
    echo "WARNING: configuring with the Python modules failed (above; build_configure_python.log):"
    echo "building the C++ targets alone. The pytest and bench_jax stages will fail."
    python=OFF
    configure OFF || {
      tail -n 30 "$LOGS/build_configure.log"
      echo "cmake configure failed (full log: build_configure.log)"
      return 1
    }
  fi
  echo "configured in $(($(date +%s) - t0))s"
  [[ $python == ON ]] && targets+=(_mhc_cpu _mhc_cuda)
  t0=$(date +%s)
  "$CMAKE" --build "$BUILD" -j "$JOBS" --target "${targets[@]}" || return 1
  echo "built ${targets[*]} in $(($(date +%s) - t0))s"
  [[ $python == ON ]] || return 0
  # The package: python/mhc's files as links, plus the modules (no write into the source tree).
  mkdir -p "$PKG/mhc"
  local f
  for f in "$ROOT"/python/mhc/*; do
    case "$(basename "$f")" in _mhc_* | __pycache__) continue ;; esac
    ln -s "$f" "$PKG/mhc/"
  done
  cp "$BUILD"/_mhc_cpu*.so "$BUILD"/_mhc_cuda*.so "$PKG/mhc/" || return 1
  PYTHONPATH="$PKG" "$PY" -c '
import mhc, mhc.jax
from mhc import _ffi
assert mhc.__file__.startswith("'"$PKG"'"), mhc.__file__
assert _ffi._mhc_cuda is not None, "the _mhc_cuda module did not import"
assert _ffi.CUDA_TARGETS and _ffi.CUDA_TARGETS == _ffi.TARGET_NAMES, (_ffi.CUDA_TARGETS, _ffi.TARGET_NAMES)
print("python package staged in", "'"$PKG"'", "with", len(_ffi.CUDA_TARGETS), "CUDA FFI targets registered")
' || {
    rm -rf "$PKG"
    return 1
  }
}

device() {
  [[ -n "$SMI" ]] && "$SMI" -L
  MHC_REQUIRE_CUDA=1 "$BUILD/mhc_cuda_tests" --gtest_filter='CudaRequired.DeviceIsPresent' || {
    echo "NO USABLE CUDA DEVICE: every later GPU stage would fail, so none is started."
    return 1
  }
}

# Runs the test binary in shards (with `env` settings), logs shard*.log under $LOGS/tests, and
# checks the counts: every listed test ran, none failed, none skipped.
gtest_count() { "$BUILD/mhc_cuda_tests" --gtest_list_tests --gtest_filter="$1" | grep -c '^  '; }
tests() {
  local dir="$LOGS/tests" main_shards tc_shards i pids=() rc=0
  mkdir -p "$dir"
  # The tensor-core run holds about half as many cases: a third of the cores.
  tc_shards=$((JOBS / 3 > 0 ? JOBS / 3 : 1))
  main_shards=$((JOBS - tc_shards > 0 ? JOBS - tc_shards : 1))
  for ((i = 0; i < main_shards; ++i)); do
    MHC_REQUIRE_CUDA=1 GTEST_TOTAL_SHARDS=$main_shards GTEST_SHARD_INDEX=$i \
      "$BUILD/mhc_cuda_tests" --gtest_brief=1 >"$dir/main_shard$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < tc_shards; ++i)); do
    MHC_REQUIRE_CUDA=1 MHC_CUDA_TENSOR_CORES=1 GTEST_TOTAL_SHARDS=$tc_shards GTEST_SHARD_INDEX=$i \
      "$BUILD/mhc_cuda_tests" --gtest_brief=1 --gtest_filter="$TC_FILTER" >"$dir/tc_shard$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || rc=1; done
  local run expected ran passed skipped failed json="" sep=""
  for run in main tc; do
    expected=$(gtest_count "$([[ $run == main ]] && echo '*' || echo "$TC_FILTER")")
    ran=$(cat "$dir/${run}"_shard*.log | sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' | awk '{s += $1} END {print s + 0}')
    passed=$(cat "$dir/${run}"_shard*.log | sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\{0,1\}\..*/\1/p' | awk '{s += $1} END {print s + 0}')
    skipped=$(cat "$dir/${run}"_shard*.log | sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}.*/\1/p' | awk '{s += $1} END {print s + 0}')
    failed=$((ran - passed - skipped))
    echo "$run: $expected listed, $ran ran, $passed passed, $failed failed, $skipped skipped"
    grep -h '^\[  FAILED  \] ' "$dir/${run}"_shard*.log | sed 's/, where GetParam.*//' | sort -u | head -n 40
    ((ran == expected && passed == expected && failed == 0 && skipped == 0)) || rc=1
    json+="$sep\"$run\": {\"listed\": $expected, \"ran\": $ran, \"passed\": $passed, \"failed\": $failed, \"skipped\": $skipped}"
    sep=", "
  done
  echo "{$json}" >"$LOGS/tests_counts.json"
  ((rc == 0)) || echo "tests: failures, skips or missing tests above (shard logs in logs.tar.gz: tests/)"
  return "$rc"
}

sanitizer() {
  if [[ -z "$SANITIZER" ]]; then
    echo "compute-sanitizer not found (see the info stage)"
    return 1
  fi
  # One tool after another: three sanitized processes on one GPU at once were never tried.
  local tool filter rc=0 i tools=(memcheck racecheck synccheck)
  local filters=("$MEMCHECK_FILTER" "$RACECHECK_FILTER" "$SYNCCHECK_FILTER")
  for ((i = 0; i < 3; ++i)); do
    tool=${tools[$i]} filter=${filters[$i]}
    echo "== $tool: $filter"
    if MHC_REQUIRE_CUDA=1 "$SANITIZER" --tool "$tool" --error-exitcode 9 "$BUILD/mhc_cuda_tests" \
      --gtest_brief=1 --gtest_filter="$filter" >"$LOGS/sanitizer_$tool.log" 2>&1; then
      # The selected tests must have run and passed under the tool, not been filtered away.
      if grep -q '^\[  PASSED  \] [1-9]' "$LOGS/sanitizer_$tool.log" &&
        ! grep -q '^\[  SKIPPED \]' "$LOGS/sanitizer_$tool.log"; then
        echo "$tool: clean ($(grep -E 'SUMMARY' "$LOGS/sanitizer_$tool.log" | tail -n 1))"
        continue
      fi
      echo "$tool: no test ran, or one skipped"
    else
      echo "$tool: FAILED"
    fi
    rc=1
    tail -n 40 "$LOGS/sanitizer_$tool.log"
  done
  return "$rc"
}

bench_cpp() {
  "$BUILD/mhc_cuda_bench" --json "$LOGS/cuda_bench.json" || return 1
  echo "== the same with MHC_CUDA_TENSOR_CORES=1 (the opt-in bf16 projection)"
  MHC_CUDA_TENSOR_CORES=1 "$BUILD/mhc_cuda_bench" --json "$LOGS/cuda_bench_tc.json"
}

jax_on_gpu() {
  if [[ ! -d "$PKG/mhc" ]]; then
    echo "the Python package was not built (see the build stage's log)"
    return 1
  fi
  PYTHONPATH="$PKG" "$PY" -c '
import jax
device = jax.devices()[0]
assert device.platform == "gpu", f"jax default device is {device} (platform {device.platform}), not a GPU"
print("jax", jax.__version__, "on", device.device_kind)
'
}

pytest() {
  jax_on_gpu || return 1
  # Autotuning off: the tests compile many small programs and time none of them.
  MHC_REQUIRE_CUDA=1 XLA_FLAGS="--xla_gpu_autotune_level=0 ${XLA_FLAGS:-}" \
    JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH="$PKG:$ROOT/tests/python" \
    "$PY" -m pytest -q -rfEs -p no:cacheprovider --junitxml="$LOGS/pytest.xml" \
    tests/python/test_cuda.py tests/python/test_kernels_vs_reference.py -k "$PYTEST_SUBSET" || return 1
  # Nothing may have been skipped, and the subset of each file must have selected something.
  "$PY" - "$LOGS/pytest.xml" "$LOGS/pytest_counts.json" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
for name in ("test_cuda", "test_kernels_vs_reference"):
    counts[name] = sum(name in case.get("classname", "") for case in suite.iter("testcase"))
json.dump(counts, open(sys.argv[2], "w"))
print("pytest:", counts)
ok = counts["skipped"] == 0 and counts["test_cuda"] > 0 and counts["test_kernels_vs_reference"] > 0
sys.exit(0 if ok else 1)
EOF
}

bench_jax() {
  jax_on_gpu || return 1
  PYTHONPATH="$PKG" "$PY" -m mhc.bench --tokens 65536 --dims 7168 --dtypes bf16 \
    --ops sublayer_fwd sublayer_fwd_bwd --no-memory --repeats 5 --json "$LOGS/jax_bench.json"
}

# mhc.torch on the GPU (UNVERIFIED: this stage has never run on one). No CUDA op is registered
# today, so the kernel path must refuse CUDA tensors; the plain path runs there and is compared
# with the CPU kernels (scripts/gpu_check_torch.py fails unless torch sees a CUDA device).
torch() {
  if [[ ! -d "$PKG/mhc" ]]; then
    echo "the Python package was not built (see the build stage's log)"
    return 1
  fi
  local py="${TORCH_PYTHON:-$PY}"
  if ! PYTHONPATH="$PKG" "$py" -c 'import torch, mhc.torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; then
    echo "no torch with mhc.torch in $py: set TORCH_PYTHON to an interpreter with torch (CUDA wheel),"
    echo "the same Python version as $PY (the package's extension is built for that one)"
    return 1
  fi
  PYTHONPATH="$PKG" "$py" "$ROOT/scripts/gpu_check_torch.py" --json "$LOGS/torch_check.json"
}

export -f info configure build device gtest_count tests sanitizer bench_cpp jax_on_gpu pytest bench_jax torch

# --- the driver ---

declare -A VERDICT=() TOOK=() CODE=()
RAN=()
STOP_REASON=""

run_stage() {
  local name=$1 limit=${LIMIT[$1]} left start rc took
  RAN+=("$name")
  left=$((DEADLINE - $(date +%s)))
  if [[ -n "$STOP_REASON" ]]; then
    VERDICT[$name]="not run ($STOP_REASON)" TOOK[$name]=0 CODE[$name]=-1
    return 1
  fi
  if ((left < 20)); then
    VERDICT[$name]="not run (out of time)" TOOK[$name]=0 CODE[$name]=-1
    return 1
  fi
  ((limit > left - 5)) && limit=$((left - 5))
  echo "== $name (limit ${limit}s, estimate ${ESTIMATE[$name]}s)"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "$name" >"$LOGS/$name.log" 2>&1
  rc=$?
  took=$(($(date +%s) - start))
  TOOK[$name]=$took CODE[$name]=$rc
  if ((rc == 0)); then
    VERDICT[$name]=ok
    tail -n "$([[ $name == info ]] && echo 40 || echo 8)" "$LOGS/$name.log"
  else
    if ((rc == 124 || rc == 137)); then
      VERDICT[$name]="TIMED OUT (limit ${limit}s)"
    else
      VERDICT[$name]="FAILED (exit $rc)"
    fi
    tail -n 30 "$LOGS/$name.log"
    echo "!! stage $name ${VERDICT[$name]} after ${took}s; log: logs.tar.gz:logs/$name.log"
    echo "!! rerun only this stage: bash scripts/gpu_check.sh --only $name"
  fi
  echo "== $name: ${VERDICT[$name]} after ${took}s"
  return "$rc"
}

load_toolchain() {
  NVCC="" SANITIZER="" NINJA="" CMAKE="" PY="" PY_PLATFORM="" JAX_VERSION="" GTEST="" SMI=""
  # shellcheck disable=SC1091
  [[ -f "$BUILD/toolchain.env" ]] && source "$BUILD/toolchain.env"
  export NVCC SANITIZER NINJA CMAKE PY PY_PLATFORM JAX_VERSION GTEST SMI
}

built() {
  [[ -x "$BUILD/mhc_cuda_tests" && -x "$BUILD/mhc_cuda_bench" ]] || return 1
  [[ ",$ONLY," != *,pytest,* && ",$ONLY," != *,bench_jax,* && ",$ONLY," != *,torch,* ]] || [[ -d "$PKG/mhc" ]]
}

if [[ -z "$ONLY" ]]; then
  wanted=("${STAGES[@]}")
else
  wanted=(info)
  [[ ",$ONLY," == *,build,* ]] || built || [[ "$ONLY" == info ]] || wanted+=(build)
  for s in "${STAGES[@]}"; do
    [[ ",$ONLY," == *",$s,"* && "$s" != info ]] && wanted+=("$s")
  done
fi

for s in "${wanted[@]}"; do
  if ! run_stage "$s"; then
    case "$s" in
      info) [[ -z "$STOP_REASON" ]] && STOP_REASON="toolchain incomplete" ;;
      build) [[ -z "$STOP_REASON" ]] && STOP_REASON="build failed" ;;
      device) [[ -z "$STOP_REASON" ]] && STOP_REASON="no CUDA device" ;;
    esac
  fi
  [[ "$s" == info ]] && load_toolchain
done

# --- summary.txt, results.json, logs.tar.gz ---

TOTAL=$(($(date +%s) - START))
status=0
{
  echo "scripts/gpu_check.sh${ONLY:+ --only $ONLY} on $(hostname) at $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (+ local changes)')"
  printf '%-10s %-30s %6s %8s %6s\n' stage verdict took estimate limit
  for s in "${RAN[@]}"; do
    printf '%-10s %-30s %5ss %7ss %5ss\n' "$s" "${VERDICT[$s]}" "${TOOK[$s]}" "${ESTIMATE[$s]}" "${LIMIT[$s]}"
    [[ "${VERDICT[$s]}" == ok ]] || status=1
  done
  echo "total ${TOTAL}s"
  for s in "${RAN[@]}"; do
    case "${VERDICT[$s]}" in
      ok | "not run"*) ;;
      *) echo "rerun $s: bash scripts/gpu_check.sh --only $s" ;;
    esac
  done
  if [[ "${VERDICT[device]:-}" == FAILED* ]]; then
    echo "No usable CUDA device here: the GPU stages ($GPU_STAGES) need the GPU machine."
  fi
} >"$OUT/summary.txt"

for s in "${RAN[@]}"; do printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$s" "${VERDICT[$s]}" "${CODE[$s]}" \
  "${TOOK[$s]}" "${ESTIMATE[$s]}" "${LIMIT[$s]}"; done >"$LOGS/stages.tsv"
cp "$BUILD/toolchain.env" "$LOGS/" 2>/dev/null

# The tables and results.json need a Python; any python3 does (no jax).
REPORT_PY="${PY:-}"
[[ -x "$REPORT_PY" ]] || REPORT_PY=$(command -v python3 || true)
if [[ -n "$REPORT_PY" ]]; then
  "$REPORT_PY" - "$LOGS" "$OUT" "$TOTAL" "${ONLY:-all}" <<'PYEOF' >>"$OUT/summary.txt"
import json, os, sys
logs, out, total, only = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

def load(name):
    path = os.path.join(logs, name)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

stages = []
with open(os.path.join(logs, "stages.tsv")) as f:
    for line in f:
        name, verdict, code, took, estimate, limit = line.rstrip("\n").split("\t")
        stages.append({"name": name, "verdict": verdict, "exit": int(code), "seconds": int(took),
                       "estimate_s": int(estimate), "limit_s": int(limit),
                       "rerun": f"bash scripts/gpu_check.sh --only {name}"})
toolchain = {}
try:
    with open(os.path.join(logs, "toolchain.env")) as f:
        for line in f:
            key, _, value = line.rstrip("\n").partition("=")
            toolchain[key] = value.strip("'")
except OSError:
    pass
cpp, tc, jx = load("cuda_bench.json"), load("cuda_bench_tc.json"), load("jax_bench.json")
torch_check = load("torch_check.json")
results = {"only": only, "total_s": total, "passed": all(s["verdict"] == "ok" for s in stages),
           "stages": stages, "toolchain": toolchain, "tests": load("tests_counts.json"),
           "pytest": load("pytest_counts.json"),
           "cuda_bench": cpp, "cuda_bench_tensor_cores": tc, "jax_bench": jx, "torch_check": torch_check}
with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
if results["tests"]:
    print("\ntests:", json.dumps(results["tests"]))
if results["pytest"]:
    print("pytest:", json.dumps(results["pytest"]))
if cpp:
    print(f"\n{cpp['device']}: copy {cpp['copy_gbs']:.0f} GB/s; CUDA events, median of {cpp['repeats']}, {cpp['dtype']}, n={cpp['n']}")
    print(f"{'op':<14} {'T':>6} {'D':>5} {'ms':>9} {'GB/s':>7} {'of copy':>8} {'ms (tensor cores)':>18}")
    tc_ms = {(r["op"], r["tokens"], r["dim"]): r["ms"] for r in (tc or {}).get("rows", [])}
    for r in cpp["rows"]:
        other = tc_ms.get((r["op"], r["tokens"], r["dim"]))
        other = f"{other:>18.3f}" if other is not None else f"{'-':>18}"
        print(f"{r['op']:<14} {r['tokens']:>6} {r['dim']:>5} {r['ms']:>9.3f} {r['gbs']:>7.0f} {r['copy_fraction']:>8.1%} {other}")
if jx:
    print(f"\njitted sublayer, kernel vs plain JAX (wall clock, median of {jx['repeats']})")
    print(f"{'op':<17} {'T':>6} {'D':>5} {'kernel ms':>10} {'plain ms':>9} {'speedup':>8}")
    for r in jx["rows"]:
        print(f"{r['op']:<17} {r['tokens']:>6} {r['dim']:>5} {r['kernel_ms']:>10.3f} {r['plain_ms']:>9.3f} {r['speedup']:>7.2f}x")
if torch_check:
    print(f"\nmhc.torch on {torch_check.get('device_name', torch_check['device'])} (torch {torch_check['torch']}):")
    for c in torch_check["checks"]:
        detail = f"relative error {c['worst_relative_error']:.1e}" if "worst_relative_error" in c else c.get("error", "")
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']} {c['dtype']}: {detail}")
PYEOF
else
  echo '{"error": "no python3 to write the results"}' >"$OUT/results.json"
fi
tar -czf "$OUT/logs.tar.gz" -C "$BUILD" logs

echo
echo "== summary (also $OUT/summary.txt; results.json and logs.tar.gz beside it)"
cat "$OUT/summary.txt"
exit $status

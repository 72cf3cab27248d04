#!/usr/bin/env bash
# Builds bench/gemm (against the project's build/libmhc.a) and runs it on both SIMD paths, each
# library on its own switch. Arguments go to gemm_bench (e.g. --tokens 64 --repeats 51).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="${GEMM_BENCH_BUILD:-$here/../../build-gemm}"
cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "$build" > /dev/null
echo "== AVX-512 (mhc 16-lane, OpenBLAS SkylakeX, libxsmm skx)"
MHC_NO_AVX512=0 OPENBLAS_CORETYPE=SkylakeX LIBXSMM_TARGET=skx "$build/gemm_bench" "$@"
echo "== AVX2 (MHC_NO_AVX512=1, OPENBLAS_CORETYPE=Haswell, LIBXSMM_TARGET=hsw)"
MHC_NO_AVX512=1 OPENBLAS_CORETYPE=Haswell LIBXSMM_TARGET=hsw "$build/gemm_bench" "$@"

#!/usr/bin/env bash
# The installed package as another CMake project sees it (make consumer): install into a temporary
# prefix, build tests/consumer/ with find_package(mhc REQUIRED), run it; then mhc.pc through
# pkg-config. Twice:
#   static: the main build ($BUILD, default build/) installed as it is, nothing recompiled; with
#           its CUDA library, when it has one, through find_package(mhc COMPONENTS cuda) too
#   shared: a library-only build (build-install-shared/) with BUILD_SHARED_LIBS=ON, which must
#           export nothing but the public API (nm -D)
# The library-only configure must need neither GoogleTest, Google Benchmark nor Python: it runs
# with all three out of reach.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
shared_build="build-install-shared"
jobs=${JOBS:-$(nproc)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Configure, build and run tests/consumer/ against the install in $2; $1 is the library kind.
consume() {
  local kind=$1 prefix=$2 dir="$tmp/consumer-$1"
  shift 2
  cmake -S tests/consumer -B "$dir" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    "$@" > "$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
  cmake --build "$dir" -j "$jobs" >> "$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
  "$dir/mhc_consumer" "$kind"
  "$dir/examples/mhc_example" > "$dir/example.log" || { cat "$dir/example.log"; exit 1; }
  echo "examples/ against the $kind install: ok"
  if [ -x "$dir/mhc_consumer_cuda" ]; then "$dir/mhc_consumer_cuda"; fi
  # The same program through pkg-config instead of CMake.
  local libdir flags version
  libdir=$(dirname "$(dirname "$(find "$prefix" -name mhc.pc)")")
  flags=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs mhc)
  version=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --modversion mhc)
  # shellcheck disable=SC2086  # $flags is a list of words
  c++ -std=c++17 -O1 -DMHC_PACKAGE_VERSION="\"$version\"" tests/consumer/consumer.cc $flags \
    -Wl,-rpath,"$libdir" -o "$dir/mhc_consumer_pc"
  "$dir/mhc_consumer_pc" "$kind" > "$dir/pc.log" || { cat "$dir/pc.log"; exit 1; }
  echo "pkg-config (mhc.pc) against the $kind install: ok"
}

echo "== static: $build/ installed as built"
[ -f "$build/CMakeCache.txt" ] || { echo "no $build/: run make build first" >&2; exit 1; }
cmake --install "$build" --prefix "$tmp/static" > /dev/null
cuda=()
if [ -n "$(find "$tmp/static" -name mhcCudaTargets.cmake)" ]; then cuda=(-DMHC_CONSUMER_CUDA=ON); fi
consume static "$tmp/static" "${cuda[@]}"

echo "== shared: $shared_build/, the library alone"
# GoogleTest, Google Benchmark and Python hidden from the configure: it must not look for them.
cmake -S . -B "$shared_build" -DCMAKE_BUILD_TYPE=Release -DMHC_WERROR=ON -DBUILD_SHARED_LIBS=ON \
  -DMHC_BUILD_TESTS=OFF -DMHC_BUILD_BENCH=OFF -DMHC_BUILD_EXAMPLES=OFF -DMHC_BUILD_CUDA=OFF \
  -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON \
  -DCMAKE_DISABLE_FIND_PACKAGE_Python=ON > "$tmp/shared-configure.log" 2>&1 ||
  { cat "$tmp/shared-configure.log"; exit 1; }
cmake --build "$shared_build" -j "$jobs" > "$tmp/shared-build.log" 2>&1 ||
  { cat "$tmp/shared-build.log"; exit 1; }
cmake --install "$shared_build" --prefix "$tmp/shared" > /dev/null
# Exports: mhc's public names and its classes' type information, nothing else (no mhc::cpu::,
# no mhc::detail::, no std:: instantiations).
library=$(find "$tmp/shared" -name 'libmhc.so.*.*.*')
exports=$(nm -D --defined-only -C "$library" | cut -d' ' -f3-)
leaks=$(
  grep -v -E '^((typeinfo|typeinfo name|vtable) for )?mhc::' <<< "$exports" || true
  grep -E '^mhc::(cpu|detail)::' <<< "$exports" || true
)
if [ -n "$leaks" ]; then
  echo "libmhc.so exports more than the public API:" >&2
  echo "$leaks" >&2
  exit 1
fi
echo "libmhc.so exports $(wc -l <<< "$exports") symbols, all public API"
consume shared "$tmp/shared"

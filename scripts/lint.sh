#!/usr/bin/env bash
# Formatting and static analysis; any finding fails.
#   C++/CUDA: clang-format (.clang-format), clang-tidy (.clang-tidy) through a compile database.
#   Python:   ruff format and ruff check (pyproject.toml [tool.ruff]).
# Usage: scripts/lint.sh            check everything (make lint)
#        scripts/lint.sh --fix      rewrite the formatting, apply ruff's safe fixes (make format)
#        scripts/lint.sh --tidy F.. clang-tidy on the given files only (the pre-commit hook)
# Tools are pinned: clang-format-14 and clang-tidy-14 (scripts/setup.sh), ruff in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
ruff=.venv/bin/ruff
python_paths=(python tests/python bench scripts)
mapfile -t cxx_files < <(find src include tests bench examples -type f \
  \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) | sort)

# clang-tidy over the translation units among "$@" (all of this project's when none are given).
tidy() {
  # A compile database of every C++ target, the fuzzer and the FFI extension included (clang++,
  # so clang-tidy reads the flags as the compiler did). Configuring is enough: nothing is built.
  CXX=clang++ cmake -S . -B build-lint -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DCMAKE_BUILD_TYPE=Debug \
    -DMHC_BUILD_FUZZER=ON -DMHC_BUILD_PYTHON=ON -DPython_EXECUTABLE="$root/.venv/bin/python" > /dev/null
  # This project's translation units (not nanobind's, which the extension compiles too). CUDA
  # sources (src/cuda/, nvcc command lines) are left out: clang-tidy cannot read nvcc's flags.
  local all units
  all=$(grep -o '"file": "[^"]*"' build-lint/compile_commands.json | cut -d'"' -f4 |
    grep -E "^$root/(src|tests|bench|examples)/" | grep -v "^$root/src/cuda/" | sort -u)
  # src/ffi first: with the analyzer on nanobind's templates it takes longest by far.
  units=$(grep "/src/ffi/" <<< "$all"; grep -v "/src/ffi/" <<< "$all" || true)
  if [ $# -gt 0 ]; then
    units=$(printf '%s\n' "$units" | grep -Fx -f <(for f in "$@"; do realpath "$f"; done) || true)
  fi
  [ -n "$units" ] || return 0
  # One clang-tidy per file, $(nproc) at a time; findings on stdout ("N warnings generated" and
  # other compiler chatter go to stderr, dropped).
  printf '%s\n' "$units" | xargs -P "$(nproc)" -I{} clang-tidy-14 -p build-lint --quiet \
    --header-filter="^$root/(src|include|tests|bench|examples)/" {} 2> /dev/null
}

case "${1:-}" in
  --fix)
    clang-format-14 -i "${cxx_files[@]}"
    "$ruff" check --fix --quiet "${python_paths[@]}" || true  # what is left, make lint reports
    "$ruff" format --quiet "${python_paths[@]}"
    exit 0 ;;
  --tidy)
    shift
    tidy "$@"
    exit ;;
esac

status=0
echo "== clang-format"
for file in "${cxx_files[@]}"; do
  clang-format-14 --dry-run -Werror "$file" 2> /dev/null || { echo "needs formatting: $file"; status=1; }
done
echo "== ruff"
"$ruff" format --check --quiet "${python_paths[@]}" || status=1
"$ruff" check --quiet "${python_paths[@]}" || status=1
echo "== clang-tidy"
tidy || status=1

if [ $status -ne 0 ]; then echo "lint: findings above (make format fixes the formatting)" >&2; fi
exit $status

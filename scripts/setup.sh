#!/usr/bin/env bash
# Installs what building and testing mhc needs, from Debian's packages, only where missing.
set -euo pipefail

# clang-format and clang-tidy 14 for `make lint` (one version: formatting differs between them;
# ruff comes from requirements-dev.txt); llvm-14 for llvm-cov and llvm-profdata (the C++ line
# coverage of make sanitize); ccache for the repeated compiles of make test's builds (the Makefile
# sets it as CMake's compiler launcher when it is installed).
packages=(cmake g++ make libgtest-dev libbenchmark-dev clang libclang-rt-14-dev
  clang-format-14 clang-tidy-14 llvm-14 ccache)
missing=()
# The Python package is built in a virtual environment; Debian's python3 needs python3-venv and
# the headers for that (a pyenv or other self-built python3 has both).
if ! python3 -c "import venv, ensurepip, sysconfig, os; assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" 2>/dev/null; then
  packages+=(python3-venv python3-dev)
fi
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "setup: installing ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo apt-get update -qq && sudo apt-get install -y -qq "${missing[@]}"
  else
    echo "setup: missing packages ${missing[*]}; install them as root: apt-get install ${missing[*]}" >&2
    exit 1
  fi
else
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

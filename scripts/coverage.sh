#!/usr/bin/env bash
# Python line coverage: tests/python under coverage.py (pytest-cov), measuring the installed mhc
# package, held to MIN_COVERAGE percent (default 85). The C++ line coverage is measured by the
# ASan run of scripts/sanitize.sh (make sanitize), which carries clang's coverage instrumentation.
# This run replaces the plain pytest run in `make test`; `make test-python` is the uninstrumented one.
set -euo pipefail
cd "$(dirname "$0")/.."
min=${MIN_COVERAGE:-85}
jobs=$(nproc)

echo "== Python coverage (coverage.py over tests/python)"
rm -f .coverage .coverage.*
# One pytest worker per core (pytest-xdist): much of the suite's time is JAX tracing and XLA
# compilation on one thread, which a second worker overlaps (docs/performance.md, "CI time").
# --durations: the slowest tests of every run, where the next CI-time saving is found
# (docs/testing.md, "CI time").
.venv/bin/python -m pytest -q -n "$jobs" tests/python --durations=30 --cov --cov-report=term-missing \
  --cov-fail-under="$min"

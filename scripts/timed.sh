#!/usr/bin/env bash
# Runs a make test stage and prints its time: `scripts/timed.sh NAME COMMAND...`. The wall time and
# the CPU time (user + sys, its children included) of every stage are where docs/testing.md's "CI
# time" table comes from; CPU time is the one to compare on a machine that other work shares.
set -uo pipefail
stage=$1
shift
TIMEFORMAT="== stage $stage: %R s wall, %U s user, %S s sys"
time "$@"

"""Compile-only for real chips (issue: TPU backend): the post kernels and V4.1's collapse, forward
and backward, at a steady-state shape (n = 4, D = 2048, T = 4096, bf16) through libtpu's compile-only topologies for
v5e and v6e, by mhc.tpu.compile_report. Mosaic's compiler and XLA:TPU must accept them, fit the
chip's VMEM (an overuse is a compile error) and put no relayout copy of x around them. Nothing
runs on a chip. The pre, boundary and head kernels take minutes each to compile on 2 cores:
`make tpu-compile` (D = 2048) and `make tpu-compile-v4` compile every kernel outside the tests."""

import os
import re
import subprocess
import sys

import pytest

CHIP_VMEM_MIB = {"v5e": 128, "v6e": 128}

pytest.importorskip("libtpu", reason="libtpu (jax[tpu], requirements-dev.txt) compiles for the chips")

# Compiles for v5e and v6e in a fresh process (pyproject.toml, markers: make check skips it).
pytestmark = pytest.mark.slow


def test_post_kernels_compile_for_v5e_and_v6e_and_fit_vmem():
    # With DeepSeek-V4.1's collapse, the post kernels' grid and plan (seconds to compile).
    kernels = ["mhc_post_forward", "mhc_post_backward", "mhc_collapse_forward", "mhc_collapse_backward"]
    command = [
        sys.executable,
        "-m",
        "mhc.tpu.compile_report",
        "--chips",
        *CHIP_VMEM_MIB,
        "--d",
        "2048",
        "--kernels",
        *kernels,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if re.match(r"\| v\d", line)]
    seen = {(row[0].strip(), row[1].strip()) for row in rows}
    assert seen == {(chip, name.removeprefix("mhc_")) for chip in CHIP_VMEM_MIB for name in kernels}, result.stdout
    for chip, _, d, _, _, vmem_mib, _, _, copies in (tuple(cell.strip() for cell in row) for row in rows):
        assert d == "2048"
        assert 0 < float(vmem_mib) < CHIP_VMEM_MIB[chip], result.stdout  # the compiler reserved VMEM, under the chip's
        assert copies == "0", result.stdout  # no x-sized relayout around the kernel


def test_static_estimate_of_the_post_forward_from_its_compiled_bundles():
    # mhc.tpu.compile_report --estimate: libtpu's final-bundle dumps of a real compile read by
    # mhc.tpu._schedule (its parser is tested on a fixed sample in test_tpu_schedule.py).
    import mhc.tpu
    from mhc.tpu import _schedule

    command = [
        sys.executable,
        "-m",
        "mhc.tpu.compile_report",
        "--chips",
        "v5e",
        "--kernels",
        "mhc_post_forward",
        "--estimate",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (row,) = [
        line.split("|")[1:-1]
        for line in result.stdout.splitlines()
        if re.match(r"\| v5e \| post_forward \| 2048 \| \d+x", line)
    ]
    chip, _, _, grid, bundles, estimate, floor, ratio, spills, fills, busiest = (cell.strip() for cell in row)
    steps = 1
    for axis in grid.split("x"):
        steps *= int(axis)
    bundles, spills, fills = (int(value.replace(",", "")) for value in (bundles, spills, fills))
    assert steps >= 4096 // max(mhc.tpu.TOKEN_TILES)  # at least the token tiles
    assert bundles > 0 and spills >= 0 and fills >= 0
    assert float(estimate.replace(",", "")) == pytest.approx(
        bundles * steps / _schedule.CHIPS[chip]["clock_hz"] * 1e6, abs=0.5
    )
    assert float(floor.replace(",", "")) == pytest.approx(4096 * 9 * 2048 * 2 / 819e9 * 1e6, abs=0.5)
    assert float(ratio.removesuffix("x")) == pytest.approx(
        float(estimate.replace(",", "")) / float(floor.replace(",", "")), abs=0.06
    )
    assert re.fullmatch(r"(\w+ \d+%, ){2}\w+ \d+%", busiest), busiest

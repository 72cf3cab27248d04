"""Compile the TPU kernels (mhc.tpu) for real chips on a host without one, through libtpu's
compile-only topologies (docs/tpu.md), and report per kernel and chip: the token tile the VMEM
plan chose, the compile time, the VMEM the compiler reserved for the kernel (its
used_scoped_memory_configs), the spec's minimum HBM bytes and the time they take at the chip's
HBM bandwidth (the floor a TPU run can be held to), and the x-sized copies XLA put around the
kernel (a relayout of x costs a pass over it). Nothing runs: speed and hardware numerics are not
measured. Slow (tens of seconds to minutes per compile on 2 cores), so not part of make check: make
tpu-compile (n = 4, D = 2048) and make tpu-compile-v4 (DeepSeek-V4's D = 4096 and 7168).

    python -m mhc.tpu.compile_report [--chips v5e v6e] [--n 4] [--d 2048 ...] [--tokens 4096]
        [--dtype bfloat16] [--mix sinkhorn] [--kernels mhc_pre_forward ...] [--estimate]

Every operation of mhc.tpu.KERNELS is compiled (OPERATIONS gives its operands and spec bytes); the
token tile is read back from the Mosaic kernel's grid. With --estimate, libtpu also dumps each
kernel's final bundles and a second table gives the static time estimate by the compiled schedule
(mhc.tpu._schedule: the grid loop's bundles per step x grid steps / clock) against the floor, the
ratio, the spill stores and fills per grid step and the busiest units (docs/tpu.md, "Speed by the
compiled schedule").
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import re
import shutil
import sys
import tempfile
import time

# libtpu takes a lock file (/tmp/libtpu_lockfile) meant to keep two processes off one TPU; a
# compile-only topology uses no TPU, and other jax processes on this host may hold the lock.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import mhc.tpu  # noqa: E402
from mhc._config import Config  # noqa: E402
from mhc.tpu import _schedule  # noqa: E402

# Per operation of mhc.tpu.KERNELS: its operands in the C++ contract's order (x [T, n, D] and
# the like in the activation dtype, "features" [T, D] in it too, "gates" [T, n] and "mix"
# [T, n, n] f32, "params" the four Params, "head" the three HeadParams) and the spec's minimum
# bytes per token in units of D e, as a function of n (spec: Minimum memory traffic, Boundary).
OPERATIONS = {
    "mhc_pre_forward": (("x", "params"), lambda n: n + 1),
    "mhc_post_forward": (("x", "features", "gates", "mix"), lambda n: 2 * n + 1),
    "mhc_post_backward": (("x", "x", "features", "gates", "mix"), lambda n: 3 * n + 2),
    "mhc_pre_backward": (("features", "x", "gates", "mix", "x", "params"), lambda n: 3 * n + 1),
    "mhc_boundary_forward": (("x", "features", "gates", "mix", "params"), lambda n: 2 * n + 2),
    "mhc_boundary_backward": (
        ("features", "x", "gates", "mix", "x", "features", "gates", "mix", "params"),
        lambda n: 3 * n + 3,
    ),
    # Spec: Head, steps 1-4 and 6 (the pre forward's traffic); its backward reads x and dh, writes dx.
    "mhc_head_forward": (("x", "head"), lambda n: n + 1),
    "mhc_head_backward": (("features", "x", "head"), lambda n: 2 * n + 1),
    # DeepSeek-V4.1 (spec: Single-pass schedule): the carried mix is a "gates" [T, n] f32 operand; the
    # same bytes as V4's operations (the collapse: x read, out written; its backward dout and x read,
    # dx written).
    "mhc_pre_forward_carried": (("x", "gates", "params"), lambda n: n + 1),
    "mhc_pre_backward_carried": (
        ("features", "x", "gates", "gates", "mix", "x", "gates", "params"),
        lambda n: 3 * n + 1,
    ),
    "mhc_collapse_forward": (("x", "gates"), lambda n: n + 1),
    "mhc_collapse_backward": (("features", "x", "gates"), lambda n: 2 * n + 1),
    "mhc_boundary_forward_carried": (("x", "features", "gates", "gates", "mix", "params"), lambda n: 2 * n + 2),
    "mhc_boundary_backward_carried": (
        ("features", "x", "gates", "gates", "mix", "x", "features", "gates", "gates", "mix", "params"),
        lambda n: 3 * n + 3,
    ),
    # The split forms (D split over devices), one device's share: "partials" [T, N + 1] f32 and
    # "scales" alpha [3], bias [N]. The partials read x (and dlayer_in); the finishes the pre's
    # traffic (the backward's: x, dx_partial, dlayer_in read, dx written).
    "mhc_pre_forward_partials": (("x", "rows"), lambda n: n),
    "mhc_pre_forward_finish": (("x", "partials", "scales"), lambda n: n + 1),
    "mhc_pre_forward_finish_carried": (("x", "partials", "gates", "scales"), lambda n: n + 1),
    "mhc_pre_backward_partials": (("features", "x"), lambda n: n + 1),
    "mhc_pre_backward_finish": (
        ("features", "x", "gates", "gates", "mix", "x", "partials", "params"),
        lambda n: 3 * n + 1,
    ),
    "mhc_pre_backward_finish_carried": (
        ("features", "x", "gates", "gates", "mix", "x", "partials", "gates", "params"),
        lambda n: 3 * n + 1,
    ),
}


def _operands(kinds, config: Config, d: int, t: int, dtype, sharding):
    n, width = config.n, config.projection_width

    def shape(dims, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=sharding)

    shapes = {
        "x": [shape((t, n, d), dtype)],
        "features": [shape((t, d), dtype)],
        "gates": [shape((t, n))],
        "mix": [shape((t, n, n))],
        "params": [shape((n * d,)), shape((n * d, width)), shape((3,)), shape((width,))],
        "rows": [shape((n * d,)), shape((n * d, width))],  # norm_weight, phi
        "scales": [shape((3,)), shape((width,))],  # alpha, bias
        "partials": [shape((t, width + 1))],
        "head": [shape((n, n * d)), shape((n,)), shape((1,))],
    }
    return [s for kind in kinds for s in shapes[kind]]


def _grid(lowered_text: str) -> list[int] | None:
    """The Mosaic kernel's grid, read from its iteration bounds in the lowered module (the token
    tiles first, or for the backwards' three axes the cores then the tiles per core: _token_tiles),
    or None if it is not found."""
    match = re.search(r"iteration_bounds = array<i64: ([\d, ]+)>", lowered_text)
    return [int(v) for v in match.group(1).split(",")] if match else None


def _token_tiles(grid: list[int]) -> int:
    """The token tiles of a kernel's grid: its first axis, or for the backwards (cores, tiles per
    core, feature chunks: mhc.tpu._layout.CoreSplit) the first two."""
    return grid[0] * grid[1] if len(grid) == 3 else grid[0]


def _report(compiled_text: str, x_bytes: int):
    """(VMEM bytes reserved by the Mosaic kernel, x-sized copies/transposes in the program)."""
    vmem = [
        int(size)
        for line in compiled_text.splitlines()
        if 'custom_call_target="tpu_custom_call"' in line
        for size in re.findall(r'"used_scoped_memory_configs":\[\{"memory_space":"1","offset":"0","size":"(\d+)"', line)
    ]
    copies = 0
    for line in compiled_text.splitlines():
        match = re.match(r"\s*%\S+ = (bf16|f32)\[([\d,]+)\]\S* (copy|transpose)\(", line)
        if match:
            elements = 1
            for dim in match.group(2).split(","):
                elements *= int(dim)
            copies += elements * (2 if match.group(1) == "bf16" else 4) >= x_bytes
    return max(vmem, default=0), copies


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"], choices=sorted(_schedule.CHIPS))
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--d", type=int, nargs="+", default=[2048])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--mix", default="sinkhorn", choices=["sinkhorn", "permutations"])
    parser.add_argument("--kernels", nargs="+", default=None, help="names in mhc.tpu.KERNELS (default: all of them)")
    parser.add_argument(
        "--estimate", action="store_true", help="dump the final bundles and add the static time estimate per kernel"
    )
    args = parser.parse_args()
    dtype, config = jnp.dtype(args.dtype), Config(n=args.n, mix=args.mix)
    names = args.kernels or list(mhc.tpu.KERNELS)
    unknown = sorted(set(names) - set(mhc.tpu.KERNELS) | set(names) - set(OPERATIONS))
    if unknown:
        parser.error(f"--kernels: {unknown} not in mhc.tpu.KERNELS with a known contract ({sorted(OPERATIONS)})")
    if args.estimate:
        # libtpu reads its flags once, when the first topology initializes it.
        dump = tempfile.mkdtemp(prefix="mhc-tpu-bundles-")
        atexit.register(shutil.rmtree, dump, ignore_errors=True)  # also after an error
        os.environ["LIBTPU_INIT_ARGS"] = " ".join(
            filter(None, [os.environ.get("LIBTPU_INIT_ARGS"), _schedule.dump_flags(dump)])
        )
        seen: set[str] = set()
        estimates = []
    size = dtype.itemsize
    print(f"n={args.n} T={args.tokens} {args.dtype} mix={args.mix} jax {jax.__version__}")
    print("| chip | kernel | D | token tile | compile s | VMEM reserved MiB | spec bytes MiB | floor us | x copies |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in args.d:
        for chip in args.chips:
            device = topologies.get_topology_desc(f"{chip}:2x2", "tpu").devices[0]
            sharding = jax.sharding.SingleDeviceSharding(device)
            for name in names:
                kinds, units = OPERATIONS[name]
                structs = _operands(kinds, config, d, args.tokens, dtype, sharding)
                function = jax.jit(lambda *a, kernel=mhc.tpu.KERNELS[name]: kernel(config, *a))
                start = time.perf_counter()
                with jax.default_device(device):
                    lowered = function.trace(*structs).lower()
                    compiled = lowered.compile()
                seconds = time.perf_counter() - start
                grid = _grid("\n".join(_schedule.mosaic_modules(lowered.as_text())))
                tile = -(-args.tokens // _token_tiles(grid)) if grid else "?"
                spec_bytes = args.tokens * units(args.n) * d * size
                vmem, copies = _report(compiled.as_text(), args.tokens * args.n * d * size)
                floor_us = _schedule.floor_us(spec_bytes, chip)
                if args.estimate:
                    # Each row also goes to stderr at once: a long run stopped early keeps its rows.
                    estimates.append(_estimate_row(chip, name, d, grid, floor_us, _schedule.kernel_dumps(dump, seen)))
                    print(estimates[-1], file=sys.stderr, flush=True)
                print(
                    f"| {chip} | {name.removeprefix('mhc_')} | {d} | {tile} | {seconds:.1f} | {vmem / 2**20:.1f} | "
                    f"{spec_bytes / 2**20:.1f} | {floor_us:.1f} | {copies} |",
                    flush=True,
                )
    if args.estimate:
        print(f"\n{ESTIMATE_HEADER}")
        print("\n".join(estimates), flush=True)


ESTIMATE_HEADER = (
    "| chip | kernel | D | grid | bundles per step | est. us | floor us | ratio | spill stores per step "
    "| fills per step | busiest units (share of slots) |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def _estimate_row(chip: str, name: str, d: int, grid, floor_us: float, dumps) -> str:
    """One row of the static estimate table (a kernel of several pallas_calls sums them, each at
    the grid of the first Mosaic module)."""
    if not dumps or grid is None:
        return f"| {chip} | {name.removeprefix('mhc_')} | {d} | ? | no kernel dump found | | | | | | |"
    steps = math.prod(grid)
    schedules = [_schedule.step_schedule(bundles, utilization, tuple(grid)) for bundles, utilization in dumps]
    estimate = sum(_schedule.estimate_us(step, steps, chip) for step in schedules)
    busiest = ", ".join(f"{unit} {share:.0%}" for unit, share in schedules[0].busiest(3))
    unknown = sum(step.unknown_trips for step in schedules)
    note = f" ({unknown} inner loops counted once)" if unknown else ""
    return (
        f"| {chip} | {name.removeprefix('mhc_')} | {d} | {'x'.join(map(str, grid))} | "
        f"{sum(step.bundles for step in schedules):,.0f}{note} | {estimate:,.0f} | {floor_us:,.0f} | "
        f"{estimate / floor_us:.1f}x | {sum(step.spill_stores for step in schedules):,.0f} | "
        f"{sum(step.fills for step in schedules):,.0f} | {busiest} |"
    )


if __name__ == "__main__":
    main()

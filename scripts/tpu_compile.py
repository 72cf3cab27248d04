"""Compile the TPU kernels (mhc.tpu) for real chips on a host without one, through libtpu's
compile-only topologies (docs/tpu.md), and report per kernel and chip: the token tile the VMEM
plan chose, the compile time, the VMEM the compiler reserved for the kernel (its
used_scoped_memory_configs), the spec's minimum HBM bytes and the time they take at the chip's
HBM bandwidth (the floor a TPU run can be held to), and the x-sized copies XLA put around the
kernel (a relayout of x costs a pass over it). Nothing runs: speed and hardware numerics are not
measured. Slow (tens of seconds per compile on 2 cores), so not part of the tests: make tpu-compile.

    python scripts/tpu_compile.py [--chips v5e v6e] [--n 4] [--d 2048] [--tokens 4096] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import re
import time

# libtpu takes a lock file (/tmp/libtpu_lockfile) meant to keep two processes off one TPU; a
# compile-only topology uses no TPU, and other jax processes on this host may hold the lock.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import mhc.jax as mj  # noqa: E402
import mhc.tpu  # noqa: E402
from mhc.tpu import _post, _pre  # noqa: E402

# HBM bandwidth per chip, bytes/s (Google Cloud's published TPU specifications).
HBM_BANDWIDTH = {"v5e": 819e9, "v6e": 1640e9}


def _kernels(config: mj.Config, n: int, d: int, t: int, dtype, sharding):
    """(name, function, arguments (shapes on the chip), the spec's minimum bytes per token in units
    of D e, tile)."""

    def shape(dims, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=sharding)

    x, lo = shape((t, n, d), dtype), shape((t, d), dtype)
    params = mj.Params(
        shape((n * d,)), shape((n * d, config.projection_width)), shape((3,)), shape((config.projection_width,))
    )
    h_post, h_res = shape((t, n)), shape((t, n, n))
    return [
        (
            "pre_forward",
            lambda x, p: mhc.tpu.pre_forward(config, x, p),
            (x, params),
            n + 1,
            _pre.token_tile(config, d, dtype),
        ),
        (
            "post_forward",
            lambda *a: mhc.tpu.post_forward(config, *a),
            (x, lo, h_post, h_res),
            2 * n + 1,
            _post.forward_tile(config, d, dtype, dtype),
        ),
        (
            "post_backward",
            lambda *a: mhc.tpu.post_backward(config, *a),
            (x, x, lo, h_post, h_res),
            3 * n + 2,
            _post.backward_tile(config, d, dtype, dtype),
        ),
    ]


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
    parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"], choices=sorted(HBM_BANDWIDTH))
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    dtype, config = jnp.dtype(args.dtype), mj.Config(n=args.n)
    size = dtype.itemsize
    print(f"n={args.n} D={args.d} T={args.tokens} {args.dtype} jax {jax.__version__}")
    print("| chip | kernel | token tile | compile s | VMEM reserved MiB | spec bytes MiB | floor us | x-sized copies |")
    print("|---|---|---|---|---|---|---|---|")
    for chip in args.chips:
        device = topologies.get_topology_desc(f"{chip}:2x2", "tpu").devices[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        for name, function, structs, units, tile in _kernels(config, args.n, args.d, args.tokens, dtype, sharding):
            start = time.perf_counter()
            with jax.default_device(device):
                compiled = jax.jit(function).trace(*structs).lower().compile()
            seconds = time.perf_counter() - start
            spec_bytes = args.tokens * units * args.d * size
            vmem, copies = _report(compiled.as_text(), args.tokens * args.n * args.d * size)
            floor_us = spec_bytes / HBM_BANDWIDTH[chip] * 1e6
            print(
                f"| {chip} | {name} | {tile} | {seconds:.1f} | {vmem / 2**20:.1f} | "
                f"{spec_bytes / 2**20:.1f} | {floor_us:.1f} | {copies} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

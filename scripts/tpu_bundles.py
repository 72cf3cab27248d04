"""A quick static estimate of one mhc.tpu kernel by its compiled schedule on v5e and v6e (the method
of docs/tpu.md, "A speed estimate without a TPU"; make tpu-compile is to carry the full table):
compile through libtpu's compile-only topology with its final-bundle dumps, count the bundles of
the kernel's grid loop body (a '>' per loop level in *-final_bundles.txt), an inner loop's
bundles times --inner-trips (the trip count of the kernel's own fori_loop, which the caller knows),
times the grid steps over the chip's clock, against the spec's HBM-byte floor; spill stores and
fills per grid step counted the same way. n = 4, T = 4096, bf16.

    python scripts/tpu_bundles.py mhc_post_forward [--d 2048] [--chips v5e v6e] [--inner-trips 32]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

CLOCK_HZ = {"v5e": 1.50e9, "v6e": 1.75e9}  # docs/tpu.md: the bf16 peak over the MXU count and size
HBM_BANDWIDTH = {"v5e": 819e9, "v6e": 1640e9}

# Runs in a fresh process: LIBTPU_INIT_ARGS is read once, when libtpu loads.
_COMPILE = r"""
import json, re, sys
import jax, jax.numpy as jnp
from jax.experimental import topologies
import mhc.jax as mj, mhc.tpu
import tpu_compile
name, chip, d, t, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
config = mj.Config(n=n)
device = topologies.get_topology_desc(f"{chip}:2x2", "tpu").devices[0]
kinds, units = tpu_compile.OPERATIONS[name]
structs = tpu_compile._operands(kinds, config, d, t, jnp.bfloat16, jax.sharding.SingleDeviceSharding(device))
with jax.default_device(device):
    lowered = jax.jit(lambda *a: mhc.tpu.KERNELS[name](config, *a)).trace(*structs).lower()
    lowered.compile()
bounds = re.findall(r"iteration_bounds = array<i64: ([\d, ]+)>", tpu_compile._mosaic_text(lowered.as_text()))
print(json.dumps({"grid": [int(v) for v in bounds[0].split(", ")], "bytes": t * units(n) * d * 2}))
"""


def _bundles(path: str):
    """The bundle lines of a final_bundles dump with their loop depth (the '>' marks)."""
    with open(path) as dump:
        lines = dump.read().splitlines()
    for line in lines:
        match = re.match(r"\s*(?:0x[0-9a-f]+|\d+)\s+(?:L[HBE])?:\s*([> ]*)\{", line)
        if match:
            yield match.group(1).count(">"), line


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", help="a name of mhc.tpu.KERNELS, e.g. mhc_post_forward")
    parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"], choices=sorted(CLOCK_HZ))
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--inner-trips", type=int, default=1, help="trip count of a loop inside the grid step")
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    print("| chip | kernel | grid | bundles per step | spill stores | fills per step | est. us | floor us | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for chip in args.chips:
        dump = tempfile.mkdtemp(prefix=f"{args.kernel}_{chip}_")
        env = dict(
            os.environ,
            ALLOW_MULTIPLE_LIBTPU_LOAD="1",
            LIBTPU_INIT_ARGS=f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true "
            "--xla_jf_dump_llo_pass_label_regex=final",
            PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
        )
        command = [sys.executable, "-c", _COMPILE, args.kernel, chip, str(args.d), str(args.tokens), str(args.n)]
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            sys.exit(result.stderr[-4000:])
        info = json.loads(result.stdout.strip().splitlines()[-1])
        kernel = args.kernel.removeprefix("mhc_")
        paths = [p for p in glob.glob(f"{dump}/*-final_bundles.txt") if f"-{kernel}" in os.path.basename(p)]
        paths = [p for p in paths if "schedule-analysis" not in p]
        if len(paths) != 1:
            sys.exit(f"{chip}: expected one final_bundles dump of {kernel} in {dump}, found {paths}")
        bundles = spills = fills = 0
        for depth, line in _bundles(paths[0]):
            if depth == 0:
                continue
            weight = args.inner_trips if depth >= 2 else 1
            bundles += weight
            spills += weight * len(re.findall(r"= vst \[vmem:\[#allocation\d+_spill", line))
            fills += weight * len(re.findall(r"= vld \[vmem:\[#allocation\d+_spill", line))
        steps = 1
        for size in info["grid"]:
            steps *= size
        estimate = bundles * steps / CLOCK_HZ[chip] * 1e6
        floor = info["bytes"] / HBM_BANDWIDTH[chip] * 1e6
        print(
            f"| {chip} | {kernel} | {info['grid']} | {bundles} | {spills} | {fills} | {estimate:.0f} | "
            f"{floor:.0f} | {estimate / floor:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()

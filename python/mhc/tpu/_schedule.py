"""A static speed estimate of the TPU kernels from libtpu's compiled schedule (docs/tpu.md,
"Speed by the compiled schedule").

A TPU core is statically scheduled: each VLIW bundle issues in one cycle, so the bundles of a
kernel's grid loop, once per grid step, over the chip's clock, bound its compute time from below.
libtpu writes the final bundles and each bundle's functional-unit use when it compiles for a
compile-only topology with the flags of ``dump_flags`` (``python -m mhc.tpu.compile_report --estimate``
sets them). This module reads those two files:

- ``*-final_bundles.txt``: one line per bundle, ``<address> [LB|LH|...]: > { op ;; op ... }``,
  with ``/* Start region N */`` comments; a loop is a backward ``sbr.rel ... target = $regionN``
  (to a region that starts at or before the branch), and its trip count is the constant of the
  compare marked ``/* loop exit test */`` inside it.
- ``*-final_hlo-static-per-bundle-utilization.txt``: a ``CAPACTIY`` header (libtpu's spelling)
  naming the units and their slots per bundle, then one row per bundle, in address order.

A forward ``sbr.rel (%p) target = $regionN`` inside the grid loop skips the bundles up to the one
that starts region N (libtpu marks it ``Start region N`` or, where the branch's region ends there,
``Start/End empty region N``): a ``pl.when``. Where its predicate compares a grid index with a
constant (``scmp.eq|ne.s32.totalorder %s, C``, the register traced through ``smov`` copies and
scalar spills to the loop's ``sphi`` that libtpu annotates ``iteration index, stage = S iter bound
= A``: grid axis A), the skipped bundles count at the share of grid steps that run them, e.g. a
quarter for a first-chunk branch over four feature chunks (``step_schedule``'s ``grid``).

Limits (why it is a lower bound): DMA waits the pipeline does not hide and stalls are not in the
bundle count; a predicated region whose predicate is not such a compare (the pipeline's DMA
conditions, a core split's tile test) is counted at every step (an overestimate where it is
skipped); inner loops with a trip count held in a register (not a constant) are counted once and
reported.
"""

from __future__ import annotations

import base64
import dataclasses
import pathlib
import re

# Per chip: the TensorCore clock (Hz) and the HBM bandwidth (bytes/s). Bandwidths are Google
# Cloud's TPU specifications (https://cloud.google.com/tpu/docs/v5e: 819 GBps;
# https://cloud.google.com/tpu/docs/v6e: 1638 GBps, 1640 in this project's tables since the first
# TPU session). Clocks are not published as such; they follow from the published bf16 peak over
# the MXUs' multiply-adds per cycle: v5e 197 TFLOPs / (4 MXUs x 128 x 128 x 2) = 1.50 GHz
# (cloud.google.com/tpu/docs/v5e), v6e 918 TFLOPs / (4 MXUs x 256 x 256 x 2) = 1.75 GHz (the v6e
# page lists 918 TFLOPs and 256 x 256 MXUs; four per TensorCore give libtpu's own static profile
# within 3% of the bundle count, issue 42).
CHIPS = {
    "v5e": {"clock_hz": 197e12 / (4 * 128 * 128 * 2), "hbm_bytes_per_s": 819e9},
    "v6e": {"clock_hz": 918e12 / (4 * 256 * 256 * 2), "hbm_bytes_per_s": 1640e9},
}


def dump_flags(directory: str | pathlib.Path) -> str:
    """LIBTPU_INIT_ARGS that make libtpu write every program's final bundles and per-bundle unit
    use into `directory` (only the final pass: without the regex a large kernel writes hundreds
    of MB of per-pass dumps). Read once, when libtpu initializes: set before the first topology."""
    return f"--xla_jf_dump_to={directory} --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=final"


_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:[A-Z]{2})?:\s*>*\s*\{")  # one > per loop level
_START_REGION = re.compile(r"Start region (\d+)")
_BRANCH = re.compile(r"sbr\.rel (?:\((!?)(%\w+)\) )?target = \$region(\d+)")
# Where a forward branch lands: the bundle that starts its target region (an empty region's start
# and end are one label).
_REGION_LABEL = re.compile(r"Start(?:/End empty)? region (\d+)")
# A program that is all one Mosaic kernel: every scheduled bundle belongs to a tpu_custom_call.
_KERNEL_PROGRAM = re.compile(r"\(100\.00%\): %\S+ = [^\n]*custom_call_target=\"tpu_custom_call\"")
_EXIT_TEST = re.compile(r"scmp\.\w+\.s32\.totalorder (%\w+), (\d+) /\* loop exit test \*/")


@dataclasses.dataclass(frozen=True)
class Loop:
    """Bundles first..last (addresses, inclusive) run `trips` times (None: not a constant)."""

    first: int
    last: int
    trips: int | None


def parse_bundles(text: str) -> list[str]:
    """The bundles of a final_bundles dump, indexed by address (multi-line comments joined to the
    bundle they belong to)."""
    bundles: list[str] = []
    for line in text.splitlines():
        match = _BUNDLE.match(line)
        if match:
            address = int(match.group(1), 0)
            if address != len(bundles):
                raise ValueError(f"mhc.tpu._schedule.parse_bundles: bundle {address:#x} after {len(bundles)} bundles")
            bundles.append(line)
        elif bundles:
            bundles[-1] += "\n" + line
    return bundles


def find_loops(bundles: list[str]) -> list[Loop]:
    """Every loop of the program: a backward branch to a region that starts at or before it."""
    region_start: dict[str, int] = {}
    loops = []
    for address, bundle in enumerate(bundles):
        for region in _START_REGION.findall(bundle):
            region_start.setdefault(region, address)
        for _, _, region in _BRANCH.findall(bundle):
            first = region_start.get(region)
            if first is None or first > address:
                continue  # a forward branch (a predicated region or an exit)
            tests = [m for b in bundles[first : address + 1] for m in _EXIT_TEST.findall(b)]
            loops.append(Loop(first, address, _trip_count(bundles, *tests[-1]) if tests else None))
    return loops


@dataclasses.dataclass(frozen=True)
class Conditional:
    """Bundles first..last (addresses, inclusive), skipped by a forward branch: they run where grid
    index `axis` equals `value` (`when_equal`) or differs from it; axis None: the predicate is not
    such a compare (they run at every step, as far as the reader knows)."""

    first: int
    last: int
    axis: int | None
    value: int | None
    when_equal: bool

    def share(self, grid: tuple[int, ...] | None) -> float:
        """The share of the grid's steps that run the bundles (1 where unknown)."""
        if self.axis is None or grid is None or self.axis >= len(grid):
            return 1.0
        matching = 1 if 0 <= self.value < grid[self.axis] else 0
        runs = matching if self.when_equal else grid[self.axis] - matching
        return runs / grid[self.axis]


def find_conditionals(bundles: list[str]) -> list[Conditional]:
    """Every forward branch's skipped bundles (a pl.when), with the grid index its predicate tests
    where it compares one with a constant (the module docstring)."""
    label: dict[str, int] = {}
    for address, bundle in enumerate(bundles):
        for region in _REGION_LABEL.findall(bundle):
            label.setdefault(region, address)
    program = "\n".join(bundles)
    conditionals = []
    for address, bundle in enumerate(bundles):
        for negated, predicate, region in _BRANCH.findall(bundle):
            target = label.get(region)
            if target is None or target <= address or not predicate:
                continue  # a loop's backward branch, or an unconditional jump
            axis = value = None
            when_equal = True
            compare = re.search(re.escape(predicate) + r" = scmp\.(eq|ne)\.s32\.totalorder (%\w+), (\d+)\b", program)
            if compare:
                axis = _grid_axis(program, compare.group(2))
                value = int(compare.group(3))
                # The branch skips when its predicate holds: a skip on "index != C" runs at C.
                when_equal = (compare.group(1) == "ne") != bool(negated)
            conditionals.append(
                Conditional(address + 1, target - 1, axis, value if axis is not None else None, when_equal)
            )
    return conditionals


def _grid_axis(program: str, register: str, depth: int = 0) -> int | None:
    """The grid axis whose index `register` holds, through smov copies and scalar spills (a
    register spilled to SMEM and loaded back), or None."""
    if depth > 16:
        return None
    definition = re.search(re.escape(register) + r" = ([^;}]*)", program)
    if not definition:
        return None
    operation = definition.group(1)
    phi = re.match(r"sphi [^;}]*?iteration index, stage = \d+ iter bound = (\d+)", operation)
    if phi:
        return int(phi.group(1))
    copy = re.match(r"smov (%\w+)\s*(?:/\*|$)", operation)
    if copy:
        return _grid_axis(program, copy.group(1), depth + 1)
    load = re.match(r"sld \[smem:\[(#allocation\d+_spill)\]\]", operation)
    if load:
        stores = re.findall(r"sst \[smem:\[" + re.escape(load.group(1)) + r"\]\] (%\w+)", program)
        axes = {_grid_axis(program, stored, depth + 1) for stored in stores}
        return axes.pop() if len(axes) == 1 else None
    return None


def _trip_count(bundles: list[str], counter: str, bound: str) -> int:
    """Trips of a loop whose exit test compares `counter` with `bound`: the counter is
    `sadd.s32 STEP, %phi`, the phi starts at an `smov START` (an unrolled loop steps by more than
    one); STEP 1 and START 0 where the program does not say."""
    program = "\n".join(bundles)

    def defined(register: str, pattern: str):
        match = re.search(re.escape(register) + r" = " + pattern, program)
        return match.groups() if match else None

    step, phi = defined(counter, r"sadd\.s32 (\d+), (%\w+)") or ("1", None)
    start = 0
    if phi is not None:
        initial = defined(phi, r"sphi (%\w+), " + re.escape(counter))
        value = initial and defined(initial[0], r"smov (\d+)")
        start = int(value[0]) if value else 0
    return max(0, -(-(int(bound) - start) // int(step)))


def parse_utilization(text: str) -> tuple[list[str], list[int], list[list[int]]]:
    """(unit names, slots per bundle of each, one row of slots used per bundle)."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = next(i for i, line in enumerate(lines) if line.startswith("== CAPAC"))
    units = [name.strip() for name in lines[header + 1].split(",")]
    capacity = [int(v) for v in lines[header + 2].split()]
    start = next(i for i, line in enumerate(lines) if line.startswith("== UTILIZATION")) + 1
    rows = [[int(v) for v in line.split()] for line in lines[start:]]
    if any(len(row) != len(units) for row in rows):
        raise ValueError(f"mhc.tpu._schedule.parse_utilization: a row without one value per unit ({units})")
    return units, capacity, rows


@dataclasses.dataclass(frozen=True)
class StepSchedule:
    """One grid step of a kernel: its bundles (inner loops times their trip counts, a predicated
    region at the share of steps that run it: an average over the grid's steps), the slots each
    unit uses in them, and what the estimate could not count."""

    bundles: float
    units: dict[str, float]
    capacity: dict[str, int]
    loop_trips: int  # trip count of the grid loop's exit test (grid steps plus pipeline stages)
    unknown_trips: int  # inner loops counted once: their trip count is not a constant

    @property
    def spill_stores(self) -> float:
        return self.units.get("VSTORE:SPILL", 0)

    @property
    def fills(self) -> float:
        return self.units.get("VLOAD:FILL", 0)

    def busiest(self, count: int = 2) -> list[tuple[str, float]]:
        """The `count` units with the largest share of their slots in use, (name, share); the spill
        and fill columns are parts of VSTORE and VLOAD, not units of their own."""
        shares = {
            unit: used / (self.capacity[unit] * self.bundles) for unit, used in self.units.items() if ":" not in unit
        }
        return sorted(shares.items(), key=lambda item: -item[1])[:count]


def step_schedule(bundles_text: str, utilization_text: str, grid: tuple[int, ...] | None = None) -> StepSchedule:
    """The grid step of one kernel's dumps: the outermost, longest loop is the grid loop. `grid`:
    the kernel's grid (the Mosaic module's iteration bounds), which prices a predicated region on
    a grid index at the share of steps that run it; without it every region counts at every step."""
    bundles = parse_bundles(bundles_text)
    names, slots, rows = parse_utilization(utilization_text)
    if len(rows) < len(bundles):
        raise ValueError(
            f"mhc.tpu._schedule.step_schedule: {len(rows)} utilization rows for {len(bundles)} bundles "
            "(the two dumps are not of the same program)"
        )
    loops = find_loops(bundles)
    if not loops:
        raise ValueError("mhc.tpu._schedule.step_schedule: the bundles have no loop (no grid loop to count)")
    grid_loop = max(loops, key=lambda loop: loop.last - loop.first)
    # Each bundle's share of the steps that run it: the product over the predicated regions it is in.
    weight = [1.0] * len(bundles)
    for conditional in find_conditionals(bundles):
        share = conditional.share(grid)
        for address in range(conditional.first, conditional.last + 1):
            weight[address] *= share
    unknown = 0

    def cost(loop: Loop) -> tuple[float, list[float]]:
        """Bundles and unit slots of one iteration of `loop`, its inner loops expanded."""
        nonlocal unknown
        inner = [
            other for other in loops if other is not loop and loop.first <= other.first and other.last <= loop.last
        ]
        direct = [
            other
            for other in inner
            if not any(o is not other and o.first <= other.first and other.last <= o.last for o in inner)
        ]
        covered = set()
        count, used = 0, [0] * len(names)
        for child in direct:
            trips = child.trips
            if trips is None:
                unknown += 1
                trips = 1
            child_count, child_used = cost(child)
            count += trips * child_count
            used = [u + trips * c for u, c in zip(used, child_used, strict=True)]
            covered.update(range(child.first, child.last + 1))
        for address in range(loop.first, loop.last + 1):
            if address not in covered:
                count += weight[address]
                used = [u + weight[address] * r for u, r in zip(used, rows[address], strict=True)]
        return count, used

    count, used = cost(grid_loop)
    return StepSchedule(
        bundles=count,
        units=dict(zip(names, used, strict=True)),
        capacity=dict(zip(names, slots, strict=True)),
        loop_trips=grid_loop.trips or 0,
        unknown_trips=unknown,
    )


def kernel_dumps(directory: str | pathlib.Path, seen: set[str]) -> list[tuple[str, str]]:
    """(final bundles, unit use) texts of the Mosaic kernels (tpu_custom_call programs) dumped into
    `directory` since the names in `seen` (which it updates): one pair per pallas_call."""
    directory = pathlib.Path(directory)
    pairs = []
    for analysis in sorted(directory.glob("*-schedule-analysis_final_bundles.txt")):
        prefix = analysis.name.removesuffix("-schedule-analysis_final_bundles.txt").rsplit("-", 1)[0]
        if prefix in seen:
            continue
        seen.add(prefix)
        if not _KERNEL_PROGRAM.search(analysis.read_text()):
            continue  # another program: XLA's fusions, copies, the top-level program
        (bundles,) = directory.glob(f"{glob_escape(prefix)}-*-final_bundles.txt")
        (utilization,) = directory.glob(f"{glob_escape(prefix)}-*-final_hlo-static-per-bundle-utilization.txt")
        pairs.append((bundles.read_text(), utilization.read_text()))
    return pairs


def glob_escape(name: str) -> str:
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def estimate_us(step: StepSchedule, grid_steps: int, chip: str) -> float:
    """The kernel's compute time by its schedule: bundles per step x grid steps / clock."""
    return step.bundles * grid_steps / CHIPS[chip]["clock_hz"] * 1e6


def floor_us(spec_bytes: float, chip: str) -> float:
    """The spec's minimum HBM bytes at the chip's bandwidth."""
    return spec_bytes / CHIPS[chip]["hbm_bytes_per_s"] * 1e6


def mosaic_modules(lowered_text: str) -> list[str]:
    """The Mosaic kernels of a lowered or exported module, as text: each tpu_custom_call carries
    its kernel as serialized MLIR bytecode in its backend config (compile_report reads the grid
    from it, the tests the MXU precision and the layouts)."""
    from jax._src.interpreters import mlir
    from jax._src.lib import tpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager

    kernels = []
    for body in re.findall(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22", lowered_text):
        context = mlir.make_ir_context()
        tpu.register_dialect(context)
        with context, ir.Location.unknown():
            context.allow_unregistered_dialects = True
            module = ir.Module.parse(base64.b64decode(body))
            PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
            kernels.append(str(module))
    return kernels

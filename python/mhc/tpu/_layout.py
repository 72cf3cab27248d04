"""Block layout and VMEM plan shared by the TPU kernels.

x [T, n, D] is read as it is, in blocks [tile, n, Dp] (Dp = D rounded up to the 128 lanes), and
each stream x[:, k, :] is taken in the kernel. In VMEM the stream axis, second-minor, pads to 8
(f32) or 16 (bf16) sublanes: 2-4x the VMEM of the values at n = 4 (stream_sublanes). The other
way, x reshaped to [T, n Dp] outside the kernel so that the streams sit side by side in the
lanes, pads nothing in VMEM, but XLA:TPU stores [T, n, D] in (n, 128) tiles and the reshape
became a relayout copy of x in HBM (a read and a write of x more: seen in the v5e and v6e
compiles, one copy per x-sized operand), which the spec's one pass over x cannot afford.

The pre kernel's per-token coefficient math runs with tokens in the lanes instead (a row of the
logits per coefficient, the token tile across the lanes): the Sinkhorn steps are then whole-vreg
operations and reductions over sublanes, not 1-lane slices. Each coefficient group (pre gates,
post gates, one row of H_res per input stream) starts on a multiple of 8 rows, so every slice
and store is sublane-aligned; the rows past n in a group are padding, masked out of the
softmax and the sums.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
SUBLANES = 8
# Token tiles the wrappers choose from, largest first. Multiples of 16 (bf16 packs two tokens to a
# sublane row). The pre kernels' coefficient outputs carry the tokens in the lanes, as
# [token tiles, rows, tile] so that a tile under 128 lanes is a whole last dimension; 64 and 32
# are for large n D (DeepSeek-V4's D = 7168), where a tile of 128 would not fit VMEM.
TOKEN_TILES = (512, 256, 128, 64, 32)
# The post kernels' largest feature chunk (lanes).
FEATURE_CHUNK_LANES = 512
# VMEM per core by jax's device_kind: v5e and v6e 128 MiB, v7x 64 MiB (Google Cloud's TPU
# specifications). Other chips (v4, v5p, unknown, or no TPU: the interpreter) get DEFAULT_VMEM, the
# smallest of them. Every kernel's plan and compiler limit derive from it (vmem_budget, vmem_limit):
# one policy, the chip's.
VMEM_BY_DEVICE_KIND = {"TPU v5 lite": 128 * 2**20, "TPU v6 lite": 128 * 2**20, "TPU7x": 64 * 2**20}
DEFAULT_VMEM = 64 * 2**20
# TensorCores one jax device drives, by device_kind: v4 and v5p ("TPU v5") are megacore chips, two
# TensorCores presented as one device, and Mosaic splits a grid's "parallel" axes between them
# (JAX's pltpu.ChipVersion: supports_megacore). v5e and v6e have one TensorCore per chip; v7x's
# two are separate jax devices. Anything else (or no TPU: the interpreter) counts as one.
TENSOR_CORES_BY_DEVICE_KIND = {"TPU v4": 2, "TPU v5": 2}
# The activation dtypes the kernels take (x, layer_out and the cotangents of the same shapes).
ACTIVATION_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def stream_sublanes(n: int, itemsize: int) -> int:
    """Sublanes the n streams of one token occupy in a VMEM block: n rounded up to 8 rows of 32
    bits (16 for bf16, packed two to a row)."""
    return round_up(n, SUBLANES * 4 // itemsize)


def padded_features(d: int) -> int:
    """Dp: D rounded up to the lane width."""
    return round_up(d, LANES)


def feature_chunk(padded: int) -> int:
    """The post kernels' feature chunk: the largest multiple of 128 lanes that divides Dp and is at
    most FEATURE_CHUNK_LANES."""
    lanes = padded // LANES
    return LANES * max(k for k in range(1, FEATURE_CHUNK_LANES // LANES + 1) if lanes % k == 0)


def group_rows(n: int) -> int:
    """G: rows of one coefficient group (n rounded up to the sublanes)."""
    return round_up(n, SUBLANES)


def residual_rows(n: int, mix: str) -> int:
    """Rows of the residual logits: n groups of G (Sinkhorn, row i of H_res per group) or the n!
    permutation logits rounded up to the sublanes."""
    return n * group_rows(n) if mix == "sinkhorn" else round_up(math.factorial(n), SUBLANES)


def logit_rows(n: int, mix: str) -> int:
    """Rows of the transposed, group-aligned projection: pre, post, residual."""
    return 2 * group_rows(n) + residual_rows(n, mix)


def coefficient_rows(n: int) -> int:
    """Rows of the pre kernel's coefficient output: h_pre, h_post, then H_res row i at (2 + i) G."""
    return (2 + n) * group_rows(n)


def _traced_device():
    """The device jax traces for: the default device (jax.default_device, as
    mhc.tpu.compile_report sets for a compile-only topology) or else the first device of the
    default backend."""
    device = jax.config.jax_default_device
    return device if hasattr(device, "device_kind") else jax.devices()[0]


def chip_vmem() -> int:
    """VMEM per core of the chip jax traces for (_traced_device); DEFAULT_VMEM for a chip not in
    VMEM_BY_DEVICE_KIND or a host without a TPU."""
    return VMEM_BY_DEVICE_KIND.get(_traced_device().device_kind, DEFAULT_VMEM)


def tensor_cores() -> int:
    """TensorCores of the device jax traces for (TENSOR_CORES_BY_DEVICE_KIND; 1 if not listed)."""
    return TENSOR_CORES_BY_DEVICE_KIND.get(_traced_device().device_kind, 1)


@dataclasses.dataclass(frozen=True)
class CoreSplit:
    """The backwards' grid (cores, token tiles per core, feature chunks): the first axis
    "parallel" (one per TensorCore on a megacore chip), the others sequential, since each core
    adds its tiles' parameter gradients into its own resident output blocks.

    Core p takes the consecutive token tiles p * tiles_per_core ... (tiles_per_core =
    ceil(tiles / cores requested)); only as many cores as hold a tile are used (`cores`), so no
    core is empty, but the last one may hold fewer tiles: its trailing steps map every block to
    its last tile's last chunk (the block it has just written, so nothing is fetched or written
    back in between) and do nothing (`when_holding_a_tile`). With one core the grid is the
    tiles in order, as before the split."""

    tiles: int
    chunks: int
    cores: int
    tiles_per_core: int

    @classmethod
    def plan(cls, operation: str, tokens: int, tile: int, chunks: int, cores: int | None = None) -> CoreSplit:
        """For T = tokens > 0 in tiles of `tile` tokens; `cores`: those asked for (default: the
        traced device's, tensor_cores()). `operation` names the kernel in the error for bad cores."""
        if cores is not None and (not isinstance(cores, int) or isinstance(cores, bool) or cores < 1):
            raise ValueError(f"mhc.tpu.{operation}: cores: expected a positive int or None, got {cores!r}")
        tiles = pl.cdiv(tokens, tile)
        per_core = pl.cdiv(tiles, max(1, min(cores or tensor_cores(), tiles)))
        return cls(tiles, chunks, pl.cdiv(tiles, per_core), per_core)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.cores, self.tiles_per_core, self.chunks)

    @property
    def dimension_semantics(self) -> tuple[str, str, str]:
        return ("parallel", "arbitrary", "arbitrary")

    def token_tile(self, core, step):
        """The token tile at grid step (core, step), unclamped: past the last at a trailing step."""
        return core * self.tiles_per_core + step

    def tile_block(self, core, step, chunk):
        """The index map of a per-tile block (first block axis: the token tile)."""
        del chunk
        return jnp.minimum(self.token_tile(core, step), self.tiles - 1)

    def chunk_block(self, core, step, chunk):
        """(token tile, feature chunk) of a per-chunk block: a trailing step stays on the last
        tile's last chunk."""
        holds_tile = self.token_tile(core, step) < self.tiles
        return self.tile_block(core, step, chunk), jnp.where(holds_tile, chunk, self.chunks - 1)

    @staticmethod
    def core_block(core, step, chunk):
        """The index map of a core's own accumulator block (first block axis: the core)."""
        del step, chunk
        return core

    def position(self):
        """In the kernel: (token tile, feature chunk, this core's first step) of this grid step."""
        core, step, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        return self.token_tile(core, step), chunk, (step == 0) & (chunk == 0)

    def when_holding_a_tile(self, body):
        """body() at every grid step that holds a token tile (all but the trailing steps)."""
        if self.cores * self.tiles_per_core == self.tiles:
            body()
        else:
            pl.when(self.token_tile(pl.program_id(0), pl.program_id(1)) < self.tiles)(body)


def sum_over_cores(partials):
    """The per-core partial sums [cores, ...] added in core order (a fixed order: bitwise
    reproducible; with one core, partials[0] itself)."""
    return functools.reduce(jnp.add, [partials[core] for core in range(partials.shape[0])])


def vmem_budget(capacity: int) -> int:
    """VMEM a kernel's plan may fill on a chip with `capacity` bytes: three quarters (48 MiB of
    64, 96 of 128); the compiler's own scratch and the estimate's slack take the rest."""
    return capacity * 3 // 4


def vmem_limit(capacity: int) -> int:
    """The scoped VMEM limit asked of the compiler: seven eighths of the chip's VMEM."""
    return capacity * 7 // 8


def compiler_params(*dimension_semantics: str, capacity: int | None = None):
    """Mosaic's parameters for a grid of these axes ("parallel", or "arbitrary" where an output
    accumulates over the axis): the scoped VMEM limit of the chip traced for (or of `capacity`)."""
    return pltpu.CompilerParams(
        dimension_semantics=dimension_semantics, vmem_limit_bytes=vmem_limit(capacity or chip_vmem())
    )


def kernel_name(operation: str, tile: int) -> str:
    """The pallas_call's name (pallas_call's `name=`): what a TPU profile, the HLO and libtpu's
    dumps call the kernel, e.g. mhc_post_forward_tile512."""
    return f"mhc_{operation}_tile{tile}"


def check_activation(operation: str, name: str, value) -> None:
    """A ValueError naming `operation` (e.g. "mhc.tpu.pre_forward") and the argument unless
    `value` is float32 or bfloat16."""
    if value.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{operation}: {name}: expected float32 or bfloat16, got {value.dtype}")


def pad_features(a, padded: int):
    """a with its last axis (the features) zero-padded to `padded` lanes (Dp): a copy in HBM
    unless D is already a multiple of 128 (then jnp.pad is the identity and costs nothing)."""
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, padded - a.shape[-1])])


def choose_token_tile(operation: str, per_token_bytes: int, fixed_bytes: int, budget: int | None = None) -> int:
    """The largest tile of TOKEN_TILES whose VMEM estimate fits `budget` (default: the plan's
    share of the chip traced for, vmem_budget); a clear error when even the smallest does not
    (the kernels keep one token tile of every stream resident)."""
    budget = budget or vmem_budget(chip_vmem())
    for tile in TOKEN_TILES:
        if tile * per_token_bytes + fixed_bytes <= budget:
            return tile
    smallest = TOKEN_TILES[-1]
    raise ValueError(
        f"mhc.tpu.{operation}: a tile of {smallest} tokens needs about "
        f"{(smallest * per_token_bytes + fixed_bytes) / 2**20:.1f} MiB of VMEM, over the "
        f"{budget / 2**20:.0f} MiB budget of this chip: n * D is too large for the TPU kernels "
        "(they keep every stream of a token tile in VMEM)"
    )


def tokens_in_lanes(values, row_of_column, rows: int, tile: int):
    """[T, C] f32 -> [token tiles, rows, tile]: column c at row row_of_column[c] of each tile, the
    tokens in the lanes (a whole last dimension at any tile), the rest zero."""
    t = values.shape[0]
    tiles = pl.cdiv(t, tile)
    packed = jnp.zeros((tiles * tile, rows), jnp.float32).at[:t, np.asarray(row_of_column)].set(values)
    return jnp.transpose(packed.reshape(tiles, tile, rows), (0, 2, 1))


def tokens_from_lanes(packed, t: int, columns: int):
    """[token tiles, rows, tile] (the tokens in the lanes) -> [T, columns]: rows 0..columns."""
    return jnp.transpose(packed, (0, 2, 1)).reshape(-1, packed.shape[1])[:t, :columns]

"""The post forward and backward as Pallas TPU kernels, one grid step per token tile and feature
chunk (unverified on TPU hardware: checked in TPU interpret mode, by lowering to Mosaic and by
compiling for v5e/v6e, never run on a chip).

Layout as the pre kernel's x (_layout): blocks [tile, n, chunk] of x, g, out and dx, each stream
x[:, k, :] with the tokens in the sublanes; the coefficients [T, n] and [T, n n] with the tokens
in the sublanes too, each one a 1-lane column broadcast over the features. Post needs no whole
token at once, so the features come in chunks of at most 512 lanes: the stream axis, padded to
16 sublanes in bf16, would otherwise not fit VMEM at D = 2048. The backward's sums over D (dh_post,
dh_res) accumulate over the chunks in order (the chunk axis is sequential), in f32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mhc._config import Config
from mhc.tpu import _layout, _pre

_F32 = jnp.float32
# _bf16_pairs_forward_kernel's loop: tokens per step (two f32 vregs of 8 sublanes per value, two
# sublanes a token) and steps unrolled into one body (more independent work for the scheduler;
# more spills beyond 2 in the v5e and v6e compiles).
_PAIR_ROWS = 8
_PAIR_UNROLL = 2
# _bf16_pairs_backward_kernel's: 8 tokens a step, unrolled by 2 (bundles per grid step at D =
# 2048, v5e / v6e: 14,448 / 12,541; not unrolled 17,096 / 14,361; 16 tokens 14,768 / 12,141, not
# unrolled 15,208 / 12,124: the least over both chips, the fewest spills on v5e).
_BACKWARD_ROWS = 8
_BACKWARD_UNROLL = 2


def _stream(ref, k: int):
    return ref[:, k, :].astype(_F32)


def _forward_kernel(x_ref, layer_out_ref, h_post_ref, h_res_ref, out_ref, *, n: int):
    layer_out = layer_out_ref[...].astype(_F32)
    h_post, h_res = h_post_ref[...], h_res_ref[...]
    streams = [_stream(x_ref, i) for i in range(n)]
    for j in range(n):
        # out_j = sum_i H_res[i, j] x_i + H_post[j] layer_out (spec: Forward step 8).
        out = h_post[:, j : j + 1] * layer_out
        for i in range(n):
            out += h_res[:, i * n + j : i * n + j + 1] * streams[i]
        out_ref[:, j, :] = out.astype(out_ref.dtype)


def _bf16_pairs_forward_kernel(x_ref, layer_out_ref, mix_ref, out_ref, *, rows: int):
    """post_forward's kernel for bf16 x and layer_out at n = 4, on x's own VMEM layout (the
    general _forward_kernel relayouts each stream x[:, k, :], a sublane gather, and keeps whole
    (tile, chunk) f32 values live: spills). A block [tile, 4, chunk] of bf16 sits in VMEM as one
    (4, 128) tile per token and 128 lanes, two streams packed in each 32-bit sublane (streams 0
    and 1, then 2 and 3): `rows` tokens by 128 lanes, viewed as uint32, are a dense [2 rows, 128]
    value, so no relayout is needed. The low halves (streams 0 and 2 of token t, in sublanes 2t
    and 2t + 1) and the high halves (streams 1 and 3) become f32 by a shift and a mask (exact);
    each stream reaches its token's other sublane by a sublane rotation; the output streams 2h
    and 2h + 1 of sublane 2t + h are rounded to bf16 (to nearest even, as astype) and packed
    back. The loop streams `rows` tokens at a time through registers.
    mix_ref [2 tile, 10] f32 (_bf16_pairs_mix): row 2t + h holds, at column 5p + i, the
    coefficient of stream i in output stream 2h + p: H_res[t, i, 2h + p] for i < 4, H_post[t, 2h
    + p] at i = 4. The same f32 products and sums in the same order as _forward_kernel, the same
    rounding: the same bits."""
    n, height = 4, 2 * rows
    vreg, values = (_layout.SUBLANES, _layout.LANES), (height, _layout.LANES)
    # (bit operations: Mosaic's integer division and remainder need the chip's kind to lower)
    even = (jax.lax.broadcasted_iota(jnp.int32, values, 0) & 1) == 0
    # layer_out's row of token t on both of its sublanes, a sublane gather per vreg: sublane r of
    # output vreg v takes token 4 v + r // 2, row r // 2 + 4 (v % 2) of the f32 vreg that holds
    # tokens 8 (v // 2) to 8 (v // 2) + 7.
    gathers = [(jax.lax.broadcasted_iota(jnp.int32, vreg, 0) >> 1) + 4 * (v % 2) for v in range(height // 8)]
    high = jnp.uint32(0xFFFF0000)

    def row_group(group, carry):
        first = pl.multiple_of(group * rows, rows)
        tokens = pl.ds(first, rows)
        mix = mix_ref[pl.ds(pl.multiple_of(first * 2, height), height), :]
        columns = [jnp.broadcast_to(mix[:, c : c + 1], values) for c in range(2 * (n + 1))]
        for lane_tile in range(x_ref.shape[2] // _layout.LANES):
            lanes = pl.ds(lane_tile * _layout.LANES, _layout.LANES)
            layer_out_rows = layer_out_ref[tokens, lanes].astype(_F32)
            layer_out = jnp.concatenate(
                [
                    jnp.take_along_axis(layer_out_rows[8 * (v // 2) : 8 * (v // 2) + 8], g, axis=0)
                    for v, g in enumerate(gathers)
                ],
                axis=0,
            )
            packed = pltpu.bitcast(x_ref[tokens, :, lanes].reshape(rows * n, _layout.LANES), jnp.uint32)
            low_streams = pltpu.bitcast(packed << 16, _F32)  # stream 0 at sublane 2t, stream 2 at 2t + 1
            high_streams = pltpu.bitcast(packed & high, _F32)  # streams 1 and 3
            # stream i of token t on both of its sublanes
            streams = [
                jnp.where(even, low_streams, pltpu.roll(low_streams, 1, 0)),
                jnp.where(even, high_streams, pltpu.roll(high_streams, 1, 0)),
                jnp.where(even, pltpu.roll(low_streams, height - 1, 0), low_streams),
                jnp.where(even, pltpu.roll(high_streams, height - 1, 0), high_streams),
            ]
            halves = []
            for p in range(2):
                # out_j = sum_i H_res[i, j] x_i + H_post[j] layer_out (spec: Forward step 8).
                out = columns[p * (n + 1) + n] * layer_out
                for i in range(n):
                    out += columns[p * (n + 1) + i] * streams[i]
                bits = pltpu.bitcast(out, jnp.uint32)
                # round to nearest even at bit 16 (astype's rounding); a NaN stays a (quiet) NaN
                rounded = bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))
                halves.append(jnp.where(out != out, jnp.uint32(0x7FC00000), rounded) & high)
            words = halves[1] | (halves[0] >> 16)
            out_ref[tokens, :, lanes] = pltpu.bitcast(words, out_ref.dtype).reshape(rows, n, _layout.LANES)
        return carry

    jax.lax.fori_loop(0, x_ref.shape[0] // rows, row_group, 0, unroll=_PAIR_UNROLL)


def _bf16_pairs_mix(h_post, h_res):
    """_bf16_pairs_forward_kernel's mix_ref [2 T, 10] from h_post [T, 4] and h_res [T, 4, 4]."""
    t, n = h_post.shape
    coefficients = jnp.concatenate([h_res, h_post[:, None, :]], axis=1)  # [T, i, j]
    by_output = jnp.swapaxes(coefficients, 1, 2).reshape(t, 2, 2, n + 1)  # [T, h, p, i], j = 2h + p
    return by_output.reshape(2 * t, 2 * (n + 1))


def _bf16_pairs_backward_kernel(
    g_ref,
    x_ref,
    layer_out_ref,
    h_post_ref,
    h_res_ref,
    dx_ref,
    dlayer_out_ref,
    dh_post_ref,
    dh_res_ref,
    *,
    rows: int,
    chunk_axis: int = 1,
):
    """post_backward's kernel for bf16 g, x and layer_out at n = 4 (_backward_kernel's operands and
    results), on their own VMEM layout, streamed through registers `rows` tokens at a time instead
    of whole (tile, chunk) f32 streams relaid out per use (_backward_kernel: spills). `rows`
    tokens x 128 lanes of a [tile, 4, chunk] block are, as 32-bit words, a dense [2 rows, 128]
    value (_bf16_pairs_forward_kernel): word row 2t holds streams 0 (low half) and 1 (high half) of
    token t, row 2t + 1 streams 2 and 3. Stored once to VMEM, two sublane-strided loads give them
    back with one token per sublane, a shift or a mask makes each half an f32 (as
    _pre._pairs_streams); dx goes back the same way (two strided stores of its packed halves, one
    dense load). Each lane tile and use has its own scratch words, so the scheduler can overlap
    them. dx and dlayer_out are the same f32 products and sums in the same order as
    _backward_kernel, rounded the same way (to nearest even; a NaN stays a NaN): the same bits. The
    sums over D (dh_post, dh_res) add per lane over the chunk's 128-lane tiles, then over the
    lanes, then over the chunks (chunk_axis), in f32."""
    n = 4
    values = (rows, _layout.LANES)
    high = jnp.uint32(0xFFFF0000)
    post_lanes = jax.lax.broadcasted_iota(jnp.int32, (rows, n), 1)
    res_lanes = jax.lax.broadcasted_iota(jnp.int32, (rows, n * n), 1)

    @pl.when(pl.program_id(chunk_axis) == 0)
    def _first_chunk():
        dh_post_ref[...] = jnp.zeros(dh_post_ref.shape, _F32)
        dh_res_ref[...] = jnp.zeros(dh_res_ref.shape, _F32)

    def body(words_ref):
        """words_ref [3 lane tiles, 2 rows, 128] uint32: per lane tile, g's words, x's, dx's."""

        def row_group(group, carry):
            tokens = pl.ds(pl.multiple_of(group * rows, rows), rows)
            h_post, h_res = h_post_ref[tokens, :], h_res_ref[tokens, :]
            post = [jnp.broadcast_to(h_post[:, j : j + 1], values) for j in range(n)]
            res = [jnp.broadcast_to(h_res[:, c : c + 1], values) for c in range(n * n)]
            sums = [jnp.zeros(values, _F32) for _ in range(n + n * n)]
            for lane_tile in range(x_ref.shape[2] // _layout.LANES):
                lanes = pl.ds(lane_tile * _layout.LANES, _layout.LANES)
                layer_out = layer_out_ref[tokens, lanes].astype(_F32)
                g = _pre._pairs_streams(g_ref, words_ref.at[3 * lane_tile], tokens, lanes, rows)
                # Spec, Backward (post), in _backward_kernel's order.
                dlayer_out = post[0] * g[0]
                for j in range(1, n):
                    dlayer_out += post[j] * g[j]
                dlayer_out_ref[tokens, lanes] = dlayer_out.astype(dlayer_out_ref.dtype)
                for j in range(n):
                    sums[j] += layer_out * g[j]
                x = _pre._pairs_streams(x_ref, words_ref.at[3 * lane_tile + 1], tokens, lanes, rows)
                halves = []
                for i in range(n):
                    for j in range(n):
                        sums[n + i * n + j] += x[i] * g[j]
                    dx = res[i * n] * g[0]
                    for j in range(1, n):
                        dx += res[i * n + j] * g[j]
                    # to bf16, to nearest even (astype's rounding), the high half of a word
                    bits = pltpu.bitcast(dx, jnp.uint32)
                    rounded = bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))
                    halves.append(jnp.where(dx != dx, jnp.uint32(0x7FC00000), rounded) & high)
                # streams 0 and 1 of token t into word row 2t, 2 and 3 into 2t + 1: the block's layout
                out_ref = words_ref.at[3 * lane_tile + 2]
                out_ref[pl.ds(0, rows, stride=2), :] = halves[1] | (halves[0] >> 16)
                out_ref[pl.ds(1, rows, stride=2), :] = halves[3] | (halves[2] >> 16)
                dx_ref[tokens, :, lanes] = pltpu.bitcast(out_ref[...], dx_ref.dtype).reshape(rows, n, _layout.LANES)
            # One lane reduction per sum and group of tokens (a chunk's lane tiles added first).
            dh_post = jnp.zeros((rows, n), _F32)
            for j in range(n):
                dh_post = jnp.where(post_lanes == j, jnp.sum(sums[j], axis=1, keepdims=True), dh_post)
            dh_res = jnp.zeros((rows, n * n), _F32)
            for c in range(n * n):
                dh_res = jnp.where(res_lanes == c, jnp.sum(sums[n + c], axis=1, keepdims=True), dh_res)
            dh_post_ref[tokens, :] += dh_post
            dh_res_ref[tokens, :] += dh_res
            return carry

        jax.lax.fori_loop(0, x_ref.shape[0] // rows, row_group, 0, unroll=_BACKWARD_UNROLL)

    pl.run_scoped(body, pltpu.VMEM((3 * (x_ref.shape[2] // _layout.LANES), 2 * rows, _layout.LANES), jnp.uint32))


def pairs(n: int, dtype, layer_out_dtype) -> bool:
    """Whether the post kernels run on x's own layout (the bf16 pairs kernels): bf16 x and layer_out
    at n = 4."""
    return n == 4 and jnp.dtype(dtype) == jnp.bfloat16 and jnp.dtype(layer_out_dtype) == jnp.bfloat16


def backward_body(n: int, on_pairs: bool):
    """The post backward's kernel body, post_backward's and the fused boundary backward's: the bf16
    pairs kernel on x's own layout where pairs(...) holds, else the general one."""
    if on_pairs:
        return functools.partial(_bf16_pairs_backward_kernel, rows=_BACKWARD_ROWS)
    return functools.partial(_backward_kernel, n=n)


def _columns(values, width: int):
    """[(tile, 1)] * width -> (tile, width): column c from values[c], by lane selects (no lane
    concatenation of 1-lane pieces)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, (values[0].shape[0], width), 1)
    result = jnp.zeros((values[0].shape[0], width), _F32)
    for c, value in enumerate(values):
        result = jnp.where(lane == c, value, result)
    return result


def _backward_kernel(
    g_ref,
    x_ref,
    layer_out_ref,
    h_post_ref,
    h_res_ref,
    dx_ref,
    dlayer_out_ref,
    dh_post_ref,
    dh_res_ref,
    *,
    n,
    chunk_axis=1,
):
    """chunk_axis: the grid axis of the feature chunks, over which dh_post and dh_res accumulate
    (the fused boundary backward's grid has a core axis in front: 2)."""
    layer_out = layer_out_ref[...].astype(_F32)
    h_post, h_res = h_post_ref[...], h_res_ref[...]
    g = [_stream(g_ref, j) for j in range(n)]
    # Spec, Backward (post); the per-token sums over D in f32 (the padded lanes are zero).
    dlayer_out = h_post[:, 0:1] * g[0]
    for j in range(1, n):
        dlayer_out += h_post[:, j : j + 1] * g[j]
    dlayer_out_ref[...] = dlayer_out.astype(dlayer_out_ref.dtype)
    dh_post = _columns([jnp.sum(layer_out * g[j], axis=1, keepdims=True) for j in range(n)], n)
    dh_res = []
    for i in range(n):
        x_i = _stream(x_ref, i)
        dh_res += [jnp.sum(x_i * g[j], axis=1, keepdims=True) for j in range(n)]
        dx = h_res[:, i * n : i * n + 1] * g[0]
        for j in range(1, n):
            dx += h_res[:, i * n + j : i * n + j + 1] * g[j]
        dx_ref[:, i, :] = dx.astype(dx_ref.dtype)
    dh_res = _columns(dh_res, n * n)

    @pl.when(pl.program_id(chunk_axis) == 0)
    def _first_chunk():
        dh_post_ref[...] = jnp.zeros_like(dh_post)
        dh_res_ref[...] = jnp.zeros_like(dh_res)

    dh_post_ref[...] += dh_post
    dh_res_ref[...] += dh_res


def _tile(operation: str, chunk: int, sizes: tuple[int, ...], temporaries: int) -> int:
    """Token tile from the VMEM plan: every [T, n, chunk] or [T, chunk] operand double-buffered
    (sizes: bytes per token of each, the stream axis padded to the sublanes), plus `temporaries`
    f32 [tile, chunk] values."""
    per_token = 2 * sum(sizes) + temporaries * chunk * 4
    return _layout.choose_token_tile(operation, per_token, 0)


def _check(operation: str, config: Config, x, layer_out, h_post, h_res, tile):
    t, n, d = x.shape
    if n != config.n:
        raise ValueError(f"mhc.tpu.{operation}: x: expected n = {config.n} streams (axis 1), got shape {x.shape}")
    for name, value, shape in (
        ("layer_out", layer_out, (t, d)),
        ("h_post", h_post, (t, n)),
        ("h_res", h_res, (t, n, n)),
    ):
        if value.shape != shape:
            raise ValueError(f"mhc.tpu.{operation}: {name}: expected shape {shape}, got {value.shape}")
    for name, value in (("x", x), ("layer_out", layer_out)):
        _layout.check_activation(f"mhc.tpu.{operation}", name, value)
    if tile is not None and tile not in _layout.TOKEN_TILES:
        raise ValueError(f"mhc.tpu.{operation}: tile: expected one of {_layout.TOKEN_TILES}, got {tile!r}")


class _Blocks(NamedTuple):
    padded: int  # Dp
    grid: tuple[int, int]  # (token tiles, feature chunks)
    streams: pl.BlockSpec  # [tile, n, chunk] of x, g, out, dx
    features: pl.BlockSpec  # [tile, chunk] of layer_out, dlayer_out
    h_post: pl.BlockSpec  # [tile, n] of h_post, dh_post: every chunk sees the tile's whole rows
    h_res: pl.BlockSpec  # [tile, n n] of h_res, dh_res


def _blocks(t: int, n: int, d: int, tile: int) -> _Blocks:
    """The grid and block specs the forward and the backward share (one layout for both)."""
    padded = _layout.padded_features(d)
    chunk = _layout.feature_chunk(padded)
    rows = lambda i, c: (i, 0)  # noqa: E731
    return _Blocks(
        padded,
        (pl.cdiv(t, tile), padded // chunk),
        pl.BlockSpec((tile, n, chunk), lambda i, c: (i, 0, c)),
        pl.BlockSpec((tile, chunk), lambda i, c: (i, c)),
        pl.BlockSpec((tile, n), rows),
        pl.BlockSpec((tile, n * n), rows),
    )


def forward_tile(config: Config, d: int, dtype, layer_out_dtype) -> int:
    chunk = _layout.feature_chunk(_layout.padded_features(d))
    size, lo_size = jnp.dtype(dtype).itemsize, jnp.dtype(layer_out_dtype).itemsize
    streams = _layout.stream_sublanes(config.n, size)
    sizes = (streams * chunk * size, chunk * lo_size, streams * chunk * size)
    return _tile("post_forward", chunk, sizes, config.n + 2)


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret"))
def post_forward(config: Config, x, layer_out, h_post, h_res, *, tile: int | None = None, interpret=None):
    """out [T, n, D] (x's dtype) = H_res^T x + H_post layer_out, per token: the contract of mhc.jax's
    post_forward kernel. `tile`, `interpret`: as mhc.tpu.pre_forward."""
    _check("post_forward", config, x, layer_out, h_post, h_res, tile)
    t, n, d = x.shape
    if t == 0:
        return jnp.zeros(x.shape, x.dtype)
    tile = tile or forward_tile(config, d, x.dtype, layer_out.dtype)
    b = _blocks(t, n, d, tile)
    padded = b.padded
    size, lo_size = x.dtype.itemsize, layer_out.dtype.itemsize
    if n == 4 and x.dtype == jnp.bfloat16 and layer_out.dtype == jnp.bfloat16:
        kernel = functools.partial(_bf16_pairs_forward_kernel, rows=_PAIR_ROWS)
        coefficient_specs = [pl.BlockSpec((2 * tile, 2 * (n + 1)), lambda i, c: (i, 0))]
        coefficients = [_bf16_pairs_mix(h_post, h_res)]
    else:
        kernel = functools.partial(_forward_kernel, n=n)
        coefficient_specs = [b.h_post, b.h_res]
        coefficients = [h_post, h_res.reshape(t, n * n)]
    out = pl.pallas_call(
        kernel,
        grid=b.grid,
        in_specs=[b.streams, b.features, *coefficient_specs],
        out_specs=b.streams,
        out_shape=jax.ShapeDtypeStruct((t, n, padded), x.dtype),
        name=_layout.kernel_name("post_forward", tile),
        compiler_params=_layout.compiler_params("parallel", "parallel"),
        cost_estimate=pl.CostEstimate(
            flops=int(2 * t * n * (n + 1) * padded),
            transcendentals=0,
            bytes_accessed=int(t * padded * (2 * n * size + lo_size) + t * (n + n * n) * 4),
        ),
        interpret=interpret if interpret is not None else False,
    )(_layout.pad_features(x, padded), _layout.pad_features(layer_out, padded), *coefficients)
    return out[:, :, :d]


def backward_tile(config: Config, d: int, dtype, layer_out_dtype) -> int:
    chunk = _layout.feature_chunk(_layout.padded_features(d))
    size, lo_size = jnp.dtype(dtype).itemsize, jnp.dtype(layer_out_dtype).itemsize
    streams = _layout.stream_sublanes(config.n, size)
    sizes = (
        streams * chunk * size,
        streams * chunk * size,
        chunk * lo_size,
        streams * chunk * size,
        chunk * lo_size,
    )
    return _tile("post_backward", chunk, sizes, config.n + 3)


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret"))
def post_backward(config: Config, g, x, layer_out, h_post, h_res, *, tile: int | None = None, interpret=None):
    """(dx_partial [T, n, D] x's dtype, dlayer_out [T, D] layer_out's dtype, dh_post [T, n] f32,
    dh_res [T, n, n] f32) for the cotangent g of out: the contract of mhc.jax's post_backward
    kernel. `tile`, `interpret`: as mhc.tpu.pre_forward."""
    _check("post_backward", config, x, layer_out, h_post, h_res, tile)
    if g.shape != x.shape or g.dtype != x.dtype:
        raise ValueError(
            f"mhc.tpu.post_backward: g: expected x's shape and dtype {x.shape} {x.dtype}, got {g.shape} {g.dtype}"
        )
    t, n, d = x.shape
    if t == 0:
        return empty_backward(x, layer_out)
    tile = tile or backward_tile(config, d, x.dtype, layer_out.dtype)
    b = _blocks(t, n, d, tile)
    padded = b.padded
    size, lo_size = x.dtype.itemsize, layer_out.dtype.itemsize
    kernel = backward_body(n, pairs(n, x.dtype, layer_out.dtype))
    dx, dlayer_out, dh_post, dh_res = pl.pallas_call(
        kernel,
        grid=b.grid,
        in_specs=[b.streams, b.streams, b.features, b.h_post, b.h_res],
        out_specs=[b.streams, b.features, b.h_post, b.h_res],
        out_shape=[
            jax.ShapeDtypeStruct((t, n, padded), x.dtype),
            jax.ShapeDtypeStruct((t, padded), layer_out.dtype),
            jax.ShapeDtypeStruct((t, n), _F32),
            jax.ShapeDtypeStruct((t, n * n), _F32),
        ],
        name=_layout.kernel_name("post_backward", tile),
        # dh_post and dh_res add over the feature chunks in order.
        compiler_params=_layout.compiler_params("parallel", "arbitrary"),
        cost_estimate=pl.CostEstimate(
            flops=int(4 * t * n * (n + 1) * padded),
            transcendentals=0,
            bytes_accessed=int(t * padded * (3 * n * size + 2 * lo_size) + 2 * t * (n + n * n) * 4),
        ),
        interpret=interpret if interpret is not None else False,
    )(
        _layout.pad_features(g, padded),
        _layout.pad_features(x, padded),
        _layout.pad_features(layer_out, padded),
        h_post,
        h_res.reshape(t, n * n),
    )
    return dx[:, :, :d], dlayer_out[:, :d], dh_post, dh_res.reshape(t, n, n)


def empty_backward(x, layer_out) -> tuple:
    """post_backward's results for no tokens (T = 0): (dx, dlayer_out, dh_post, dh_res), each empty;
    shared by the fused boundary backward."""
    n = x.shape[1]
    return (
        jnp.zeros(x.shape, x.dtype),
        jnp.zeros(layer_out.shape, layer_out.dtype),
        jnp.zeros((0, n), _F32),
        jnp.zeros((0, n, n), _F32),
    )

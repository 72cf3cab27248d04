"""DeepSeek-V4.1's final collapse (spec: Single-pass schedule), forward and backward, as Pallas TPU
kernels (unverified on TPU hardware: checked in TPU interpret mode and by lowering to Mosaic, never
run on a chip).

out[t, d] = sum_k carried[t, k] x[t, k, d], no parameters. No whole token is needed, so the grid
is (token tiles, feature chunks of at most 512 lanes) as the post kernels'. The carried mix comes
in with the tokens in the lanes, (G, tile) per token tile as the pre kernels take it, and the
forward is the pre kernel's pre-apply (_pre.pre_apply): the same sum in the same order. The
backward writes dx[t, k, d] = carried[t, k] dout[t, d] per chunk and adds dcarried[t, k] =
sum_d x dout (the MXU's ones product, as the pre backward's sums) over the chunks in order (the
chunk axis is sequential), in f32. A [T, 0] carried is the one-hot on stream 0: out = x_0, dx_0 =
dout, and dcarried is [T, 0].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mhc._config import Config, PreApply
from mhc.tpu import _layout, _post, _pre

_F32 = jnp.float32


def _forward_kernel(*refs, n: int, one_hot: bool):
    x_ref, *refs = refs
    carried = None if one_hot else refs.pop(0)[...]
    (out_ref,) = refs
    out_ref[...] = _pre.pre_apply(carried, x_ref, n).astype(out_ref.dtype)


def _backward_kernel(*refs, n: int, one_hot: bool):
    if one_hot:
        dout_ref, dx_ref = refs
    else:
        dout_ref, x_ref, carried_ref, dx_ref, dcarried_ref = refs
    dout = dout_ref[...].astype(_F32)
    if one_hot:
        dx_ref[:, 0, :] = dout.astype(dx_ref.dtype)
        for k in range(1, n):
            dx_ref[:, k, :] = jnp.zeros(dout.shape, dx_ref.dtype)
        return
    weights = carried_ref[...].T  # (tile, G): the tokens back in the sublanes
    for k in range(n):
        dx_ref[:, k, :] = (weights[:, k : k + 1] * dout).astype(dx_ref.dtype)

    @pl.when(pl.program_id(1) == 0)
    def _first_chunk():
        dcarried_ref[...] = jnp.zeros_like(dcarried_ref)

    dcarried_ref[...] += _pre.stream_dots(x_ref, dout, n)


def _check(operation: str, config: Config, x, carried, tile):
    t, n, d = x.shape if x.ndim == 3 else (None, None, None)
    if x.ndim != 3 or n != config.n:
        raise ValueError(f"mhc.tpu.{operation}: x: expected [T, n = {config.n}, D], got shape {x.shape}")
    _layout.check_activation(f"mhc.tpu.{operation}", "x", x)
    _pre.check_carried(f"mhc.tpu.{operation}", carried, t, n)
    _pre.check_tile(operation, tile)


def token_tile(config: Config, d: int, dtype, *, backward: bool) -> int:
    """Token tile from the fixed VMEM plan of the post kernels (every chip): x's [tile, n, chunk]
    block (and dx's, backward), the [tile, chunk] out or dout block, double-buffered, the carried
    mix (and dcarried) (G, tile) f32, and f32 temporaries of a chunk."""
    chunk = _layout.feature_chunk(_layout.padded_features(d))
    size = jnp.dtype(dtype).itemsize
    streams = _layout.stream_sublanes(config.n, size) * chunk * size
    g = _layout.group_rows(config.n)
    sizes = (streams, chunk * size, g * 4) + ((streams, g * 4) if backward else ())
    operation = "collapse_backward" if backward else "collapse_forward"
    return _post._tile(operation, chunk, sizes, config.n + 2)


def _blocks(t: int, n: int, d: int, tile: int):
    """(Dp, grid, x's [tile, n, chunk] block, a [tile, chunk] block, the carried mix's (G, tile))."""
    padded = _layout.padded_features(d)
    chunk = _layout.feature_chunk(padded)
    return (
        padded,
        (pl.cdiv(t, tile), padded // chunk),
        pl.BlockSpec((tile, n, chunk), lambda i, c: (i, 0, c)),
        pl.BlockSpec((tile, chunk), lambda i, c: (i, c)),
        pl.BlockSpec((None, _layout.group_rows(n), tile), lambda i, c: (i, 0, 0)),
    )


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret"))
def collapse_forward(config: Config, x, carried, *, tile: int | None = None, interpret=None):
    """out [T, D] (x's dtype) = sum_k carried[t, k] x[t, k, :] for x [T, n, D] f32/bf16 and the
    carried mix f32 [T, n] (the last sublayer's h_pre), or x[:, 0] for a [T, 0] carried: the
    contract of the mhc_collapse_forward target. `tile`, `interpret`: as mhc.tpu.pre_forward."""
    _check("collapse_forward", config, x, carried, tile)
    t, n, d = x.shape
    if t == 0:
        return jnp.zeros((0, d), x.dtype)
    tile = tile or token_tile(config, d, x.dtype, backward=False)
    padded, grid, streams, features, mix = _blocks(t, n, d, tile)
    one_hot = _pre.carried_mode(carried) is PreApply.ONE_HOT
    operands = [_layout.pad_features(x, padded)] + ([] if one_hot else [_pre.carried_lanes(config, carried, tile)])
    size = x.dtype.itemsize
    out = pl.pallas_call(
        functools.partial(_forward_kernel, n=n, one_hot=one_hot),
        grid=grid,
        in_specs=[streams] + ([] if one_hot else [mix]),
        out_specs=features,
        out_shape=jax.ShapeDtypeStruct((t, padded), x.dtype),
        name=_layout.kernel_name("collapse_forward", tile),
        compiler_params=_layout.compiler_params("parallel", "parallel"),
        # x read and out written: (n + 1) D e per token, plus the carried mix.
        cost_estimate=pl.CostEstimate(
            flops=int(2 * t * n * padded),
            transcendentals=0,
            bytes_accessed=int(t * (n + 1) * padded * size + t * n * 4),
        ),
        interpret=interpret if interpret is not None else False,
    )(*operands)
    return out[:, :d]


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret"))
def collapse_backward(config: Config, dout, x, carried, *, tile: int | None = None, interpret=None):
    """(dx [T, n, D] x's dtype, dcarried [T, n] f32, or [T, 0] for a [T, 0] carried) for the
    cotangent dout [T, D] (x's dtype) of collapse_forward's out: dx[t, k] = carried[t, k] dout[t],
    dcarried[t, k] = sum_d x[t, k, d] dout[t, d]. The contract of the mhc_collapse_backward
    target. `tile`, `interpret`: as mhc.tpu.pre_forward."""
    _check("collapse_backward", config, x, carried, tile)
    t, n, d = x.shape
    if dout.shape != (t, d) or dout.dtype != x.dtype:
        raise ValueError(
            f"mhc.tpu.collapse_backward: dout: expected shape {(t, d)} and dtype {x.dtype}, got {dout.shape} "
            f"{dout.dtype}"
        )
    one_hot = _pre.carried_mode(carried) is PreApply.ONE_HOT
    dcarried_shape = (t, 0 if one_hot else n)
    if t == 0:
        return jnp.zeros(x.shape, x.dtype), jnp.zeros(dcarried_shape, _F32)
    tile = tile or token_tile(config, d, x.dtype, backward=True)
    padded, grid, streams, features, mix = _blocks(t, n, d, tile)
    # The one-hot's dx needs no x.
    operands = [_layout.pad_features(dout, padded)]
    out_shape = [jax.ShapeDtypeStruct((t, n, padded), x.dtype)]
    if not one_hot:
        lanes = _pre.carried_lanes(config, carried, tile)
        operands += [_layout.pad_features(x, padded), lanes]
        out_shape.append(jax.ShapeDtypeStruct(lanes.shape, _F32))
    size = x.dtype.itemsize
    dx, *dcarried = pl.pallas_call(
        functools.partial(_backward_kernel, n=n, one_hot=one_hot),
        grid=grid,
        in_specs=[features] + ([] if one_hot else [streams, mix]),
        out_specs=[streams] + ([] if one_hot else [mix]),
        out_shape=out_shape,
        # dcarried adds over the chunks in order.
        name=_layout.kernel_name("collapse_backward", tile),
        compiler_params=_layout.compiler_params("parallel", "arbitrary"),
        # dout and x read, dx written: (2n + 1) D e per token (the one-hot reads no x: (n + 1) D e),
        # plus the carried mix and dcarried.
        cost_estimate=pl.CostEstimate(
            flops=int(3 * t * n * padded),
            transcendentals=0,
            bytes_accessed=int(t * ((n + 1) if one_hot else (2 * n + 1)) * padded * size + 2 * t * n * 4),
        ),
        interpret=interpret if interpret is not None else False,
    )(*operands)
    if one_hot:
        return dx[:, :, :d], jnp.zeros(dcarried_shape, _F32)
    return dx[:, :, :d], _layout.tokens_from_lanes(dcarried[0], t, n)

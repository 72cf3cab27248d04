"""The fused boundary forward (spec: Boundary) as one Pallas TPU kernel per token tile (unverified on
TPU hardware: checked in TPU interpret mode, by lowering to Mosaic and by compiling for v5e/v6e,
never run on a chip).

Per tile: the post of sublayer l writes x_{l+1} into its output block, in x's dtype; the pre of
sublayer l+1 then reads that block back from VMEM (the projection, the sum of squares and the
pre-apply), so x_{l+1} goes to HBM once and is never read from it: (2n + 2) D e bytes per token
instead of (2n + 1) D e + (n + 1) D e. The two halves are the post and pre kernels' own bodies,
so a token's results equal post_forward then pre_forward with the same tile, bit for bit.

The pre needs a whole token (every feature) before its pre-apply, so unlike the post kernels
there is no feature chunk axis: a tile holds x and x_{l+1} of every stream; large n D take
smaller token tiles (_layout.TOKEN_TILES down to 32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mhc.jax._types import Config, Params
from mhc.tpu import _layout, _post, _pre

_F32 = jnp.float32


def _forward_kernel(*refs, config: Config, features: int):
    x_ref, layer_out_ref, h_post_ref, h_res_ref, *parameters, x_next_ref, layer_in_ref, coefficients_ref = refs
    weight_ref, scale_ref, bias_ref, table_ref = (*parameters, None)[:4]
    _post._forward_kernel(x_ref, layer_out_ref, h_post_ref, h_res_ref, x_next_ref, n=config.n)
    _pre.pre_body(
        x_next_ref,
        weight_ref,
        scale_ref,
        bias_ref,
        table_ref,
        layer_in_ref,
        coefficients_ref,
        config=config,
        features=features,
    )


def forward_tile(config: Config, d: int, dtype, layer_out_dtype, capacity: int | None = None) -> int:
    """The token tile boundary_forward chooses for x [T, n, d] of dtype and layer_out of
    layer_out_dtype on a chip with `capacity` bytes of VMEM (default: the chip traced for)."""
    padded, n = _layout.padded_features(d), config.n
    size, lo_size = jnp.dtype(dtype).itemsize, jnp.dtype(layer_out_dtype).itemsize
    # Double-buffered: x in, x_next out (the stream axis padded to the sublanes), layer_out in,
    # layer_in out, h_post and h_res in (tokens in the sublanes, padded to the 128 lanes).
    per_token = 2 * (2 * _layout.stream_sublanes(n, size) * padded * size + padded * (lo_size + size))
    per_token += 2 * 2 * _layout.round_up(n * n, _layout.LANES) * 4
    # The post's f32 streams and its sum, then the pre's coefficient step (counted apart: the
    # compiler need not reuse the post's temporaries).
    per_token += (n + 1) * padded * 4 + _pre.coefficient_bytes_per_token(config, padded)
    return _layout.choose_token_tile(
        "boundary_forward",
        per_token,
        _pre.parameter_bytes(config, padded),
        _layout.vmem_budget(capacity or _layout.chip_vmem()),
    )


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret"))
def boundary_forward(config: Config, x, layer_out, h_post, h_res, params: Params, *, tile=None, interpret=None):
    """(x_next [T, n, D] x's dtype, layer_in [T, D] x's dtype, h_pre [T, n], h_post [T, n],
    h_res [T, n, n] f32 of sublayer l+1) for x [T, n, D], layer_out [T, D], h_post [T, n],
    h_res [T, n, n] of sublayer l and the Params of l+1: x_next = post_l(x, layer_out) and
    pre_{l+1}(x_next), the contract of mhc.jax's boundary_forward kernel. `tile`, `interpret`: as
    mhc.tpu.pre_forward."""
    _post._check("boundary_forward", config, x, layer_out, h_post, h_res, tile)
    _pre.check_params("boundary_forward", config, x, params)
    t, n, d = x.shape
    tile = tile or forward_tile(config, d, x.dtype, layer_out.dtype)
    if t == 0:
        return (
            jnp.zeros(x.shape, x.dtype),
            jnp.zeros((0, d), x.dtype),
            jnp.zeros((0, n), _F32),
            jnp.zeros((0, n), _F32),
            jnp.zeros((0, n, n), _F32),
        )
    padded = _layout.padded_features(d)
    streams = pl.BlockSpec((tile, n, padded), lambda i: (i, 0, 0))
    features = pl.BlockSpec((tile, padded), lambda i: (i, 0))
    parameters, parameter_specs = _pre.parameter_operands(config, params, d)
    coefficient_spec, coefficient_shape = _pre.coefficient_output(config, t, tile)
    flops, transcendentals, coefficient_bytes = _pre.coefficient_cost(config, t, padded)
    size, lo_size = x.dtype.itemsize, layer_out.dtype.itemsize
    x_next, layer_in, coefficients = pl.pallas_call(
        functools.partial(_forward_kernel, config=config, features=d),
        grid=(pl.cdiv(t, tile),),
        in_specs=[
            streams,
            features,
            pl.BlockSpec((tile, n), lambda i: (i, 0)),
            pl.BlockSpec((tile, n * n), lambda i: (i, 0)),
            *parameter_specs,
        ],
        out_specs=[streams, features, coefficient_spec],
        out_shape=[
            jax.ShapeDtypeStruct((t, n, padded), x.dtype),
            jax.ShapeDtypeStruct((t, padded), x.dtype),
            coefficient_shape,
        ],
        compiler_params=_pre.compiler_params(),
        # Spec: Boundary, (2n + 2) D e per token (x and layer_out read, x_next and layer_in
        # written), plus the coefficients of l read and of l+1 written.
        cost_estimate=pl.CostEstimate(
            flops=int(2 * t * n * (n + 1) * padded + flops),
            transcendentals=int(transcendentals),
            bytes_accessed=int(t * padded * (2 * n * size + lo_size + size) + t * (n + n * n) * 4 + coefficient_bytes),
        ),
        interpret=interpret if interpret is not None else False,
    )(_post._padded(x, padded), _post._padded(layer_out, padded), h_post, h_res.reshape(t, n * n), *parameters)
    return (x_next[:, :, :d], layer_in[:, :d], *_pre.split_coefficients(config, coefficients, t))

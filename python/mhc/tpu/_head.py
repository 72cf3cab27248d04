"""DeepSeek-V4's head (spec: Head) as Pallas TPU kernels (unverified on TPU hardware: checked in
TPU interpret mode, by lowering to Mosaic and by compiling for v5e/v6e, never run on a chip).

The head is the pre operations with only the pre gates: g = sigmoid(scale r (fn x) + base) +
pre_eps, out = sum_k g_k x_k. Both kernels are the pre kernels' own code on the head's parameters
laid out as the pre kernels' transposed weight: fn [n, n D] is already (norm_weight phi)^T with
no norm weight, one group of G rows; alpha is the scale and the bias the base on those rows. The
forward is _pre's projection, gates and pre-apply; the backward is _pre_backward's body with the
gates only (no dx_partial, dH_post or dH_res), so dfn is its projection gradient and dscale,
dbase its alpha and bias sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from mhc._config import Config, HeadParams
from mhc.tpu import _layout, _pre, _pre_backward

_F32 = jnp.float32


def _check(operation: str, config: Config, x, head: HeadParams, tile):
    if x.ndim != 3 or x.shape[1] != config.n:
        raise ValueError(f"mhc.tpu.{operation}: x: expected [T, n = {config.n}, D], got shape {x.shape}")
    _layout.check_activation(f"mhc.tpu.{operation}", "x", x)
    n, m = config.n, config.n * x.shape[2]
    for name, value, shape in zip(HeadParams._fields, head, ((n, m), (n,), (1,)), strict=True):
        if np.shape(value) != shape:
            raise ValueError(
                f"mhc.tpu.{operation}: head.{name}: expected shape {shape} for x {x.shape}, got {np.shape(value)}"
            )
    _pre.check_tile(operation, tile)


def _weight(config: Config, head: HeadParams, d: int):
    """The head in the pre kernels' layout: fn as the transposed weight (G, n Dp) (the padded
    features and the rows past n zero), the scale and base columns (G, 1)."""
    n, g, padded = config.n, _layout.group_rows(config.n), _layout.padded_features(d)
    fn = jnp.pad(jnp.asarray(head.fn, _F32).reshape(n, n, d), ((0, 0), (0, 0), (0, padded - d)))
    weight = jnp.zeros((g, n * padded), _F32).at[:n].set(fn.reshape(n, n * padded))
    scale = jnp.zeros((g, 1), _F32).at[:n, 0].set(jnp.broadcast_to(jnp.asarray(head.scale, _F32)[0], (n,)))
    bias = jnp.zeros((g, 1), _F32).at[:n, 0].set(jnp.asarray(head.base, _F32))
    return weight, scale, bias


def _stacked_weight(config: Config, head: HeadParams, d: int):
    """The head's fn as the pre forward's streamed projection operand (_pre.stacked_weight_terms):
    column j of stream k is fn[j, k D:(k + 1) D], on row j of the G gate rows."""
    n, padded = config.n, _layout.padded_features(d)
    folded = jnp.transpose(jnp.asarray(head.fn, _F32).reshape(n, n, d), (1, 2, 0))  # [k, d, j]
    return _pre.stacked_weight_terms(folded, padded, np.arange(n), _layout.group_rows(n))


def _forward_kernel(x_ref, weight_ref, scale_ref, bias_ref, out_ref, gates_ref, *, config: Config, features: int):
    """The pre forward's streamed projection and pre-apply (_pre) with the head's weight."""
    logits, r = _pre.streamed_projection(x_ref, weight_ref, n=config.n, features=features, rms_eps=config.rms_eps)
    gates = _pre.sigmoid(scale_ref[...] * (r * logits) + bias_ref[...]) + config.pre_eps
    gates_ref[...] = gates
    _pre.streamed_pre_apply(out_ref, gates, x_ref, config.n)


def forward_tile(config: Config, d: int, dtype, capacity: int | None = None) -> int:
    """The token tile of head_forward from the VMEM plan of a chip with `capacity` bytes (default:
    the chip traced for): double-buffered x and out blocks, three f32 temporaries of one stream,
    the logits and the double-buffered gates; fixed: the weight, single-buffered."""
    padded, size = _layout.padded_features(d), jnp.dtype(dtype).itemsize
    g = _layout.group_rows(config.n)
    per_token = 2 * _layout.stream_sublanes(config.n, size) * padded * size + 2 * padded * size
    per_token += 3 * padded * 4 + 3 * g * 4
    fixed = _pre.stacked_bytes(config.n, config.n, padded, g)
    budget = _layout.vmem_budget(capacity or _layout.chip_vmem())
    return _layout.choose_token_tile("head_forward", per_token, fixed, budget)


def backward_tile(config: Config, d: int, dtype, capacity: int | None = None) -> int:
    """The token tile of head_backward: _pre_backward's plan with the gates only."""
    return _pre_backward.backward_tile(
        config,
        d,
        dtype,
        rows=_layout.group_rows(config.n),
        gates_only=True,
        operation="head_backward",
        capacity=capacity,
    )


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret"))
def head_forward(config: Config, x, head: HeadParams, *, tile: int | None = None, interpret=None):
    """(out [T, D] x's dtype, gates [T, n] f32) for x [T, n, D] f32 or bf16 and HeadParams (fn
    [n, n D], base [n], scale [1]): the contract of mhc.jax's head_forward kernel. Uses config's n,
    rms_eps and pre_eps. `tile`, `interpret`: as mhc.tpu.pre_forward."""
    _check("head_forward", config, x, head, tile)
    t, n, d = x.shape
    if t == 0:
        return jnp.zeros((0, d), x.dtype), jnp.zeros((0, n), _F32)
    tile = tile or forward_tile(config, d, x.dtype)
    padded, g = _layout.padded_features(d), _layout.group_rows(n)
    _, scale, bias = _weight(config, head, d)
    weight = _stacked_weight(config, head, d)
    whole = lambda i: (0, 0)  # noqa: E731
    once = pl.Buffered(buffer_count=1)
    size = x.dtype.itemsize
    tiles = pl.cdiv(t, tile)
    out, gates = pl.pallas_call(
        functools.partial(_forward_kernel, config=config, features=d),
        grid=(tiles,),
        in_specs=[
            pl.BlockSpec((tile, n, padded), lambda i: (i, 0, 0)),
            pl.BlockSpec(weight.shape, whole, pipeline_mode=once),
            pl.BlockSpec((g, 1), whole, pipeline_mode=once),
            pl.BlockSpec((g, 1), whole, pipeline_mode=once),
        ],
        out_specs=[
            pl.BlockSpec((tile, padded), lambda i: (i, 0)),
            # The tokens in the lanes, as [tiles, G, tile]: a whole last dimension at any tile.
            pl.BlockSpec((None, g, tile), lambda i: (i, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((t, padded), x.dtype),
            jax.ShapeDtypeStruct((tiles, g, tile), _F32),
        ],
        name=_layout.kernel_name("head_forward", tile),
        compiler_params=_layout.compiler_params("parallel"),
        # Spec, Minimum memory traffic (as the pre forward): read n D, write D per token.
        cost_estimate=pl.CostEstimate(
            flops=int(t * 2 * n * padded * (g + _layout.SUBLANES + 1)),
            transcendentals=int(t * (g + 1)),
            bytes_accessed=int(t * (n + 1) * padded * size + t * g * 4 + g * (n * padded + 2) * 4),
        ),
        interpret=interpret if interpret is not None else False,
    )(jnp.pad(x, ((0, 0), (0, 0), (0, padded - d))), weight, scale, bias)
    gates = jnp.transpose(gates, (1, 0, 2)).reshape(g, tiles * tile)[:n, :t].T
    return out[:, :d], gates


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret", "cores"))
def head_backward(
    config: Config, dout, x, head: HeadParams, *, tile: int | None = None, interpret=None, cores: int | None = None
):
    """(dx [T, n, D] x's dtype, dfn [n, n D], dbase [n], dscale [1] f32) for the cotangent dout
    [T, D] (x's dtype) of head_forward's out: the contract of mhc.jax's head_backward kernel.
    `tile`, `interpret`: as mhc.tpu.pre_forward; `cores`: as mhc.tpu.pre_backward."""
    _check("head_backward", config, x, head, tile)
    t, n, d = x.shape
    if dout.shape != (t, d) or dout.dtype != x.dtype:
        raise ValueError(
            f"mhc.tpu.head_backward: dout: expected shape {(t, d)} and dtype {x.dtype}, got {dout.shape} {dout.dtype}"
        )
    if t == 0:
        return jnp.zeros(x.shape, x.dtype), jnp.zeros((n, n * d), _F32), jnp.zeros((n,), _F32), jnp.zeros((1,), _F32)
    tile = tile or backward_tile(config, d, x.dtype)
    weight, scale, bias = _weight(config, head, d)
    dx, _, gram, dbias, dalpha = _pre_backward.run(
        config,
        x,
        dout,
        None,
        None,
        weight,
        scale,
        bias,
        None,
        tile=tile,
        interpret=interpret,
        cores=cores,
        projection=_stacked_weight(config, head, d),
    )
    padded = _layout.padded_features(d)
    dfn = gram[:n].reshape(n, n, padded)[:, :, :d].reshape(n, n * d)
    return dx, dfn, dbias[:n], jnp.sum(dalpha[:n]).reshape(1)

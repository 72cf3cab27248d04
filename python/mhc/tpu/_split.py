"""The pre's split forms as Pallas TPU kernels: D (x's last axis) split over devices, tensor
parallelism (spec: Tensor parallelism). Unverified on TPU hardware: checked in TPU interpret mode
against the float64 reference and one device, never run on a chip.

The contract is the C++ backends' (src/cpu/pre_forward.cc, pre_backward.cc): per device, the
partials over its slice of D, one all-reduce of them over the devices (the caller's psum), then
the finish on the all-reduced partials and the same slice:

- pre_forward_partials: x [T, n, Dl] -> [T, N + 1] f32, the projection's raw sums of products
  sum_d x norm_weight phi (column c) and, last, the sum of squares sum_d x^2, over this slice
  (_pre.streamed_sums: the pre forward's streamed projection, without the RMS factor).
- pre_forward_finish(_carried): the coefficients from the all-reduced partials (the RMS mean over
  the whole n D = n Dl slices) and the pre-apply of this slice (_pre.finish_body: the pre forward
  after its projection).
- pre_backward_partials: dlayer_in [T, Dl], x -> [T, n] f32, sum_d x_k dlayer_in over this
  slice (_pre.stream_dots): V4's dH_pre, V4.1's dcarried, once all-reduced.
- pre_backward_finish(_carried): the pre backward (_pre_backward.backward_body) with P and the
  sum of squares read from the all-reduced partials instead of recomputed, and dH_pre given;
  dx and the parameter gradients of this slice's rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from mhc._config import Config, Params, PreApply
from mhc.tpu import _layout, _pre, _pre_backward

_F32 = jnp.float32


def _check_partials(operation: str, config: Config, partials, t: int):
    expected = (t, config.projection_width + 1)
    if partials.shape != expected or partials.dtype != _F32:
        raise ValueError(
            f"{operation}: partials: expected float32 {list(expected)} (the all-reduced [T, N + 1]), "
            f"got {partials.shape} {partials.dtype}"
        )


def _check_slices(operation: str, slices):
    if not isinstance(slices, int) or isinstance(slices, bool) or slices < 1:
        raise ValueError(f"{operation}: slices: expected a positive int (the devices D is split over), got {slices!r}")


def _check_x(operation: str, config: Config, x):
    if x.ndim != 3 or x.shape[1] != config.n:
        raise ValueError(f"{operation}: x: expected [T, n = {config.n}, D], got shape {x.shape}")
    _layout.check_activation(operation, "x", x)


def _check_scales(operation: str, config: Config, alpha, bias):
    for name, value, shape in (("alpha", alpha, (3,)), ("bias", bias, (config.projection_width,))):
        if np.shape(value) != shape:
            raise ValueError(f"{operation}: {name}: expected shape {shape}, got {np.shape(value)}")


def _partials_kernel(x_ref, weight_ref, partials_ref, *, n: int):
    logits, squares = _pre.streamed_sums(x_ref, weight_ref, n=n)
    tile = x_ref.shape[0]
    partials_ref[...] = jnp.concatenate([logits, jnp.broadcast_to(squares, (_layout.SUBLANES, tile))], axis=0)


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret"))
def pre_forward_partials(config: Config, x, norm_weight, phi, *, tile: int | None = None, interpret=None):
    """partials [T, N + 1] f32 for x [T, n, Dl] f32 or bf16 (this device's D slice) and its rows of
    the parameters, norm_weight [n Dl] and phi [n Dl, N]: the contract of the
    mhc_pre_forward_partials target. `tile`, `interpret`: as mhc.tpu.pre_forward."""
    operation = "mhc.tpu.pre_forward_partials"
    _check_x(operation, config, x)
    t, n, d = x.shape
    width = config.projection_width
    for name, value, shape in (("norm_weight", norm_weight, (n * d,)), ("phi", phi, (n * d, width))):
        if np.shape(value) != shape:
            raise ValueError(f"{operation}: {name}: expected shape {shape} for x {x.shape}, got {np.shape(value)}")
    _pre.check_tile(operation.removeprefix("mhc.tpu."), tile)
    if t == 0:
        return jnp.zeros((0, width + 1), _F32)
    tile = tile or _pre.token_tile(config, d, x.dtype)
    padded = _layout.padded_features(d)
    rows = _layout.logit_rows(n, config.mix)
    weight = _pre.stacked_projection(config, Params(norm_weight, phi, None, None), d, padded)
    out_rows = rows + _layout.SUBLANES
    packed = pl.pallas_call(
        functools.partial(_partials_kernel, n=n),
        grid=(pl.cdiv(t, tile),),
        in_specs=[
            pl.BlockSpec((tile, n, padded), lambda i: (i, 0, 0)),
            pl.BlockSpec(weight.shape, lambda i: (0, 0), pipeline_mode=pl.Buffered(buffer_count=1)),
        ],
        out_specs=pl.BlockSpec((None, out_rows, tile), lambda i: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((pl.cdiv(t, tile), out_rows, tile), _F32),
        name=_layout.kernel_name("pre_forward_partials", tile),
        compiler_params=_layout.compiler_params("parallel"),
        # x read once, the partials written.
        cost_estimate=pl.CostEstimate(
            flops=int(2 * t * n * padded * (rows + 1)),
            transcendentals=0,
            bytes_accessed=int(t * n * padded * x.dtype.itemsize + t * out_rows * 4 + weight.size * 2),
        ),
        interpret=interpret if interpret is not None else False,
    )(_layout.pad_features(x, padded), weight)
    return _pre.partials_from_lanes(config, packed, t)


def _forward_finish_kernel(*refs, config: Config, features: int, mode: PreApply):
    x_ref, partials_ref, *refs = refs
    carried_ref = _pre.pop_carried_ref(mode, refs)
    *finish_refs, layer_in_ref, coefficients_ref = refs
    rows = _layout.logit_rows(config.n, config.mix)
    logits = partials_ref[0:rows, :]
    r = _pre.inverse_rms(partials_ref[rows : rows + 1, :], config.n * features, config.rms_eps)
    _pre.finish_body(
        logits, r, x_ref, finish_refs, layer_in_ref, coefficients_ref, config=config, mode=mode, carried_ref=carried_ref
    )


def _forward_finish(config: Config, x, partials, mode: PreApply, carried, alpha, bias, *, slices: int, tile, interpret):
    """pre_forward_finish for checked operands; mode and carried as _pre.run's."""
    t, n, d = x.shape
    if t == 0:
        return _pre.empty_forward(x)
    tile = tile or _pre.token_tile(config, d, x.dtype, carried=mode is PreApply.CARRIED)
    padded = _layout.padded_features(d)
    rows = _layout.logit_rows(n, config.mix)
    once = pl.Buffered(buffer_count=1)
    per_tile = lambda i: (i, 0, 0)  # noqa: E731
    operands = [_layout.pad_features(x, padded), _pre.partials_lanes(config, partials, tile)]
    in_specs = [
        pl.BlockSpec((tile, n, padded), per_tile),
        pl.BlockSpec((None, rows + _layout.SUBLANES, tile), per_tile),
    ]
    if mode is PreApply.CARRIED:
        operands.append(_pre.carried_lanes(config, carried, tile))
        in_specs.append(pl.BlockSpec((None, _layout.group_rows(n), tile), per_tile))
    finish_operands = list(_pre.scale_bias_columns(config, jnp.asarray(alpha, _F32), jnp.asarray(bias, _F32)))
    if config.mix == "permutations":
        finish_operands.append(jnp.asarray(_pre._permutation_table(n)))
    operands += finish_operands
    in_specs += [pl.BlockSpec(a.shape, lambda i: (0, 0), pipeline_mode=once) for a in finish_operands]
    coefficient_spec, coefficient_shape = _pre.coefficient_output(config, t, tile)
    name = "pre_forward_finish" if mode is PreApply.OWN_GATES else "pre_forward_finish_carried"
    layer_in, coefficients = pl.pallas_call(
        functools.partial(_forward_finish_kernel, config=config, features=d * slices, mode=mode),
        grid=(pl.cdiv(t, tile),),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((tile, padded), lambda i: (i, 0)), coefficient_spec],
        out_shape=[jax.ShapeDtypeStruct((t, padded), x.dtype), coefficient_shape],
        name=_layout.kernel_name(name, tile),
        compiler_params=_layout.compiler_params("parallel"),
        # x read, layer_in written, the partials read and the coefficients written.
        cost_estimate=pl.CostEstimate(
            flops=int(t * (2 * n * padded + 6 * config.sinkhorn_iters * n * _layout.group_rows(n))),
            transcendentals=int(t * (rows + 1)),
            bytes_accessed=int(
                t * (n + 1) * padded * x.dtype.itemsize
                + t * (rows + _layout.SUBLANES) * 4
                + t * _layout.coefficient_rows(n) * 4
            ),
        ),
        interpret=interpret if interpret is not None else False,
    )(*operands)
    return (layer_in[:, :d], *_pre.split_coefficients(config, coefficients, t))


@functools.partial(jax.jit, static_argnames=("config", "slices", "tile", "interpret"))
def pre_forward_finish(config: Config, x, partials, alpha, bias, *, slices: int = 1, tile=None, interpret=None):
    """(layer_in [T, Dl] x's dtype, h_pre [T, n], h_post [T, n], h_res [T, n, n] f32) from this
    device's x [T, n, Dl] and the all-reduced partials [T, N + 1] f32 (pre_forward_partials summed
    over the `slices` devices D is split over): the contract of the mhc_pre_forward_finish
    target. `tile`, `interpret`: as mhc.tpu.pre_forward."""
    operation = "mhc.tpu.pre_forward_finish"
    _check_x(operation, config, x)
    _check_partials(operation, config, partials, x.shape[0])
    _check_scales(operation, config, alpha, bias)
    _check_slices(operation, slices)
    _pre.check_tile("pre_forward_finish", tile)
    return _forward_finish(
        config, x, partials, PreApply.OWN_GATES, None, alpha, bias, slices=slices, tile=tile, interpret=interpret
    )


@functools.partial(jax.jit, static_argnames=("config", "slices", "tile", "interpret"))
def pre_forward_finish_carried(
    config: Config, x, partials, carried, alpha, bias, *, slices: int = 1, tile=None, interpret=None
):
    """DeepSeek-V4.1's finish (spec: Single-pass schedule), the contract of the
    mhc_pre_forward_finish_carried target: pre_forward_finish's outputs, with the pre-apply mixing
    this slice of x by the carried mix (f32 [T, n], or [T, 0] for the one-hot on stream 0)."""
    operation = "mhc.tpu.pre_forward_finish_carried"
    _check_x(operation, config, x)
    _check_partials(operation, config, partials, x.shape[0])
    _pre.check_carried(operation, carried, *x.shape[:2])
    _check_scales(operation, config, alpha, bias)
    _check_slices(operation, slices)
    _pre.check_tile("pre_forward_finish_carried", tile)
    mode = _pre.carried_mode(carried)
    return _forward_finish(
        config, x, partials, mode, carried, alpha, bias, slices=slices, tile=tile, interpret=interpret
    )


def _backward_partials_kernel(dli_ref, x_ref, out_ref, *, n: int):
    out_ref[...] = _pre.stream_dots(x_ref, dli_ref[...].astype(_F32), n)


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret"))
def pre_backward_partials(config: Config, dlayer_in, x, *, tile: int | None = None, interpret=None):
    """[T, n] f32: sum over this device's features of x_k dlayer_in, for dlayer_in [T, Dl] and
    x [T, n, Dl] (one dtype): the contract of the mhc_pre_backward_partials target (once
    all-reduced, V4's dH_pre and V4.1's dcarried). `tile`, `interpret`: as mhc.tpu.pre_forward."""
    operation = "mhc.tpu.pre_backward_partials"
    _check_x(operation, config, x)
    t, n, d = x.shape
    if dlayer_in.shape != (t, d) or dlayer_in.dtype != x.dtype:
        raise ValueError(
            f"{operation}: dlayer_in: expected shape {(t, d)} and dtype {x.dtype}, "
            f"got {dlayer_in.shape} {dlayer_in.dtype}"
        )
    _pre.check_tile("pre_backward_partials", tile)
    if t == 0:
        return jnp.zeros((0, n), _F32)
    tile = tile or _pre.token_tile(config, d, x.dtype)
    padded, g = _layout.padded_features(d), _layout.group_rows(n)
    packed = pl.pallas_call(
        functools.partial(_backward_partials_kernel, n=n),
        grid=(pl.cdiv(t, tile),),
        in_specs=[
            pl.BlockSpec((tile, padded), lambda i: (i, 0)),
            pl.BlockSpec((tile, n, padded), lambda i: (i, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, g, tile), lambda i: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((pl.cdiv(t, tile), g, tile), _F32),
        name=_layout.kernel_name("pre_backward_partials", tile),
        compiler_params=_layout.compiler_params("parallel"),
        # x and dlayer_in read once, [T, n] written.
        cost_estimate=pl.CostEstimate(
            flops=int(4 * t * n * padded),
            transcendentals=0,
            bytes_accessed=int(t * (n + 1) * padded * x.dtype.itemsize + t * g * 4),
        ),
        interpret=interpret if interpret is not None else False,
    )(_layout.pad_features(dlayer_in, padded), _layout.pad_features(x, padded))
    return _layout.tokens_from_lanes(packed, t, n)


def _check_backward_finish(operation, config, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials, params):
    cotangents = _pre_backward._v4_cotangents(dlayer_in, dx_partial, dh_post, dh_res)
    cotangents += (("dh_pre", dh_pre, lambda t, n, d: (t, n), _F32),)
    _check_x(operation, config, x)
    _pre_backward._check(operation, config, cotangents, x, params, None)
    _check_partials(operation, config, partials, x.shape[0])


@functools.partial(jax.jit, static_argnames=("config", "slices", "tile", "interpret", "cores"))
def pre_backward_finish(
    config: Config,
    dlayer_in,
    dx_partial,
    dh_pre,
    dh_post,
    dh_res,
    x,
    partials,
    params: Params,
    *,
    slices: int = 1,
    tile: int | None = None,
    interpret=None,
    cores: int | None = None,
):
    """(dx [T, n, Dl] x's dtype, dnorm_weight [n Dl], dphi [n Dl, N], dalpha [3], dbias [N] f32):
    the contract of the mhc_pre_backward_finish target. As mhc.tpu.pre_backward on this device's
    slice of D, with dh_pre [T, n] f32 the all-reduced pre_backward_partials and partials
    [T, N + 1] the forward's all-reduced ones (D split over `slices` devices); the parameter
    gradients are this slice's rows (dalpha, dbias the same on every device)."""
    operation = "mhc.tpu.pre_backward_finish"
    _check_backward_finish(operation, config, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials, params)
    _check_slices(operation, slices)
    _pre.check_tile("pre_backward_finish", tile)
    dx, _, *grads = _pre_backward._backward(
        config,
        dlayer_in,
        dx_partial,
        dh_pre,
        dh_post,
        dh_res,
        x,
        PreApply.OWN_GATES,
        params,
        tile,
        interpret,
        cores,
        partials=partials,
        slices=slices,
    )
    return (dx, *grads)


@functools.partial(jax.jit, static_argnames=("config", "slices", "tile", "interpret", "cores"))
def pre_backward_finish_carried(
    config: Config,
    dlayer_in,
    dx_partial,
    dh_pre,
    dh_post,
    dh_res,
    x,
    partials,
    carried,
    params: Params,
    *,
    slices: int = 1,
    tile: int | None = None,
    interpret=None,
    cores: int | None = None,
):
    """DeepSeek-V4.1's finish (spec: Single-pass schedule), the contract of the
    mhc_pre_backward_finish_carried target: pre_backward_finish's outputs, dh_pre the cotangent
    of this sublayer's own h_pre (all-reduced), dx's pre-apply term taking the carried mix (f32
    [T, n], or [T, 0] for the one-hot on stream 0). dcarried is pre_backward_partials'."""
    operation = "mhc.tpu.pre_backward_finish_carried"
    _check_backward_finish(operation, config, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials, params)
    _pre.check_carried(operation, carried, *x.shape[:2])
    _check_slices(operation, slices)
    _pre.check_tile("pre_backward_finish_carried", tile)
    dx, _, *grads = _pre_backward._backward(
        config,
        dlayer_in,
        dx_partial,
        dh_pre,
        dh_post,
        dh_res,
        x,
        _pre.carried_mode(carried),
        params,
        tile,
        interpret,
        cores,
        carried=carried,
        partials=partials,
        slices=slices,
    )
    return (dx, *grads)

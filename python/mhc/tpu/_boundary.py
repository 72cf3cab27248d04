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

DeepSeek-V4.1's boundary (boundary_forward_carried, boundary_backward_carried; spec: Single-pass
schedule; unverified on TPU hardware as the rest) is the same kernels with sublayer l's h_pre as
the carried mix of l+1: one (G, tile) block more in, and in the backward l+1's dcarried (the
cotangent of l's h_pre) out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mhc._config import Config, Params, PreApply
from mhc.tpu import _layout, _post, _pre, _pre_backward

_F32 = jnp.float32


def _forward_kernel(*refs, config: Config, features: int, carried: bool, pairs: bool = False):
    """carried: V4.1's boundary, whose h_pre of l ((G, tile), after the post's coefficients) is
    l+1's carried mix. pairs (_post_pairs): the post's coefficients are one mix block [2 tile, 10]
    (_post._bf16_pairs_mix), not h_post and h_res."""
    x_ref, layer_out_ref, *parameters, x_next_ref, layer_in_ref, coefficients_ref = refs
    post_refs = [parameters.pop(0) for _ in range(1 if pairs else 2)]
    mode = PreApply.CARRIED if carried else PreApply.OWN_GATES
    carried_ref = _pre.pop_carried_ref(mode, parameters)
    if pairs:
        _post_pairs(x_ref, layer_out_ref, post_refs[0], x_next_ref)
    else:
        _post._forward_kernel(x_ref, layer_out_ref, *post_refs, x_next_ref, n=config.n)
    _pre.pre_body(
        x_next_ref,
        parameters,
        layer_in_ref,
        coefficients_ref,
        config=config,
        features=features,
        mode=mode,
        carried_ref=carried_ref,
    )


def _post_pairs(x_ref, layer_out_ref, mix_ref, x_next_ref):
    """x_{l+1} by post_forward's bf16 pairs kernel, over the feature chunks post_forward takes (a
    Python loop: each chunk its own token loop, the loop post_forward's estimate measured): the
    same products, sums and rounding, the same bits as post_forward."""
    padded = x_ref.shape[2]
    chunk = _layout.feature_chunk(padded)
    for c in range(padded // chunk):
        chunk_lanes = pl.ds(c * chunk, chunk)
        _post._bf16_pairs_forward_kernel(
            x_ref.at[:, :, chunk_lanes],
            layer_out_ref.at[:, chunk_lanes],
            mix_ref,
            x_next_ref.at[:, :, chunk_lanes],
            rows=_post._PAIR_ROWS,
        )


def forward_tile(
    config: Config, d: int, dtype, layer_out_dtype, capacity: int | None = None, *, carried: bool = False
) -> int:
    """The token tile boundary_forward chooses for x [T, n, d] of dtype and layer_out of
    layer_out_dtype on a chip with `capacity` bytes of VMEM (default: the chip traced for);
    `carried`: V4.1's (boundary_forward_carried), with h_pre of l in."""
    padded, n = _layout.padded_features(d), config.n
    size, lo_size = jnp.dtype(dtype).itemsize, jnp.dtype(layer_out_dtype).itemsize
    # Double-buffered: x in, x_next out (the stream axis padded to the sublanes), layer_out in,
    # layer_in out, h_post and h_res in (tokens in the sublanes, padded to the 128 lanes).
    per_token = 2 * (2 * _layout.stream_sublanes(n, size) * padded * size + padded * (lo_size + size))
    per_token += 2 * 2 * _layout.round_up(n * n, _layout.LANES) * 4
    # The post's f32 streams and its sum, then the pre's coefficient step (counted apart: the
    # compiler need not reuse the post's temporaries).
    per_token += (n + 1) * padded * 4 + _pre.coefficient_bytes_per_token(config, padded)
    per_token += 2 * _layout.group_rows(n) * 4 if carried else 0
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
    return _forward(config, x, layer_out, None, h_post, h_res, params, tile, interpret)


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret"))
def boundary_forward_carried(
    config: Config, x, layer_out, h_pre, h_post, h_res, params: Params, *, tile=None, interpret=None
):
    """DeepSeek-V4.1's boundary (spec: Single-pass schedule), the contract of the
    mhc_boundary_forward_carried target: as boundary_forward, but the pre of l+1 mixes x_next with
    the carried mix h_pre [T, n] f32 of sublayer l (pre_forward_carried(x_next, carried = h_pre)):
    x_next, layer_in, h_pre, h_post, h_res of l+1, the same bits as post_forward then
    pre_forward_carried. `tile`, `interpret`: as mhc.tpu.pre_forward."""
    operation = "boundary_forward_carried"
    _post._check(operation, config, x, layer_out, h_post, h_res, tile)
    _pre.check_params(operation, config, x, params)
    _check_h_pre(operation, h_pre, x)
    return _forward(config, x, layer_out, h_pre, h_post, h_res, params, tile, interpret)


def _check_h_pre(operation: str, h_pre, x):
    if h_pre.shape != x.shape[:2] or h_pre.dtype != _F32:
        raise ValueError(
            f"mhc.tpu.{operation}: h_pre: expected float32 {x.shape[:2]} (sublayer l's own pre gates, the carried "
            f"mix of l+1), got {h_pre.shape} {h_pre.dtype}"
        )


def _forward(config: Config, x, layer_out, h_pre, h_post, h_res, params: Params, tile, interpret):
    """The fused forward for checked operands; h_pre None (V4: the pre mixes with its own gates) or
    the carried mix [T, n]."""
    t, n, d = x.shape
    carried = h_pre is not None
    tile = tile or forward_tile(config, d, x.dtype, layer_out.dtype, carried=carried)
    if t == 0:
        return (jnp.zeros(x.shape, x.dtype), *_pre.empty_forward(x))
    padded = _layout.padded_features(d)
    streams = pl.BlockSpec((tile, n, padded), lambda i: (i, 0, 0))
    features = pl.BlockSpec((tile, padded), lambda i: (i, 0))
    parameters, parameter_specs = _pre.parameter_operands(config, params, d)
    if carried:
        parameters = [_pre.carried_lanes(config, h_pre, tile), *parameters]
        parameter_specs = [pl.BlockSpec((None, _layout.group_rows(n), tile), lambda i: (i, 0, 0)), *parameter_specs]
    coefficient_spec, coefficient_shape = _pre.coefficient_output(config, t, tile)
    flops, transcendentals, coefficient_bytes = _pre.coefficient_cost(config, t, padded)
    size, lo_size = x.dtype.itemsize, layer_out.dtype.itemsize
    pairs = _post.pairs(n, x.dtype, layer_out.dtype)
    if pairs:
        post_coefficients = [_post._bf16_pairs_mix(h_post, h_res)]
        post_specs = [pl.BlockSpec((2 * tile, 2 * (n + 1)), lambda i: (i, 0))]
    else:
        post_coefficients = [h_post, h_res.reshape(t, n * n)]
        post_specs = [pl.BlockSpec((tile, n), lambda i: (i, 0)), pl.BlockSpec((tile, n * n), lambda i: (i, 0))]
    x_next, layer_in, coefficients = pl.pallas_call(
        functools.partial(_forward_kernel, config=config, features=d, carried=carried, pairs=pairs),
        grid=(pl.cdiv(t, tile),),
        in_specs=[streams, features, *post_specs, *parameter_specs],
        out_specs=[streams, features, coefficient_spec],
        out_shape=[
            jax.ShapeDtypeStruct((t, n, padded), x.dtype),
            jax.ShapeDtypeStruct((t, padded), x.dtype),
            coefficient_shape,
        ],
        name=_layout.kernel_name("boundary_forward_carried" if carried else "boundary_forward", tile),
        compiler_params=_layout.compiler_params("parallel"),
        # Spec: Boundary, (2n + 2) D e per token (x and layer_out read, x_next and layer_in
        # written), plus the coefficients of l read and of l+1 written.
        cost_estimate=pl.CostEstimate(
            flops=int(2 * t * n * (n + 1) * padded + flops),
            transcendentals=int(transcendentals),
            bytes_accessed=int(
                t * padded * (2 * n * size + lo_size + size)
                + t * ((2 if carried else 1) * n + n * n) * 4
                + coefficient_bytes
            ),
        ),
        interpret=interpret if interpret is not None else False,
    )(
        _layout.pad_features(x, padded),
        _layout.pad_features(layer_out, padded),
        *post_coefficients,
        *parameters,
    )
    return (x_next[:, :, :d], layer_in[:, :d], *_pre.split_coefficients(config, coefficients, t))


def _backward_kernel(
    *refs,
    config: Config,
    features: int,
    tokens: int,
    sinkhorn: bool,
    permutations: bool,
    carried: bool,
    split: _layout.CoreSplit,
    pairs: bool = False,
):
    """carried: V4.1's boundary: h_pre of l ((G, tile), after the parameters) is l+1's carried mix,
    dh_next starts with l+1's dH_pre group, and dh_pre of l ((G, tile), after dalpha) receives
    l+1's dcarried. pairs (_post.pairs): the post's mix block [2 tile, 10] follows the projection
    operand, x_{l+1} is recomputed by post_forward's bf16 pairs kernel and the post backward is
    post_backward's (_post._bf16_pairs_backward_kernel). Runs only at the grid
    steps that hold a token tile (split)."""
    refs = list(refs)
    dli_ref, dx_partial_next_ref, dh_next_ref, x_ref, layer_out_ref, h_post_ref, h_res_ref = refs[:7]
    weight_ref, scale_ref, bias_ref, projection_ref = refs[7:11]
    refs = refs[11:]
    mix_ref = refs.pop(0) if pairs else None
    table_t_ref = refs.pop(0) if permutations else None
    mode = PreApply.CARRIED if carried else PreApply.OWN_GATES
    carried_ref = _pre.pop_carried_ref(mode, refs)
    dx_partial_ref, dlayer_out_ref, dh_post_ref, dh_res_ref, gram_ref, dbias_ref, dalpha_ref = refs[:7]
    refs = refs[7:]
    dh_pre_ref = refs.pop(0) if carried else None
    x_next_ref, g_ref = refs[:2]
    steps_ref = refs[2] if sinkhorn else None
    columns_ref = refs[-1]
    chunk = g_ref.shape[2]

    def step():
        _, chunk_index, _ = split.position()

        # x_{l+1} of this tile, recomputed once (the first chunk) by the post kernel's body: the
        # bits the forward stored.
        @pl.when(chunk_index == 0)
        def _recompute():
            if pairs:
                _post_pairs(x_ref, layer_out_ref, mix_ref, x_next_ref)
            else:
                _post._forward_kernel(x_ref, layer_out_ref, h_post_ref, h_res_ref, x_next_ref, n=config.n)

        # The pre backward of l+1 writes this chunk of dx_{l+1} (in x's dtype, as the separate
        # calls store it) into g_ref: the cotangent of post l's output, never stored in HBM.
        _pre_backward.backward_body(
            dli_ref,
            dx_partial_next_ref,
            dh_next_ref,
            x_next_ref,
            weight_ref,
            scale_ref,
            bias_ref,
            table_t_ref,
            g_ref,
            gram_ref,
            dbias_ref,
            dalpha_ref,
            steps_ref,
            columns_ref,
            config=config,
            features=features,
            tokens=tokens,
            split=split,
            mode=mode,
            carried_ref=carried_ref,
            dcarried_ref=dh_pre_ref,
            projection_ref=projection_ref,
        )
        lanes = pl.ds(pl.multiple_of(chunk_index * chunk, _layout.LANES), chunk)
        _post.backward_body(config.n, pairs)(
            g_ref,
            x_ref.at[:, :, lanes],
            layer_out_ref.at[:, lanes],
            h_post_ref,
            h_res_ref,
            dx_partial_ref,
            dlayer_out_ref,
            dh_post_ref,
            dh_res_ref,
            chunk_axis=len(split.grid) - 1,
        )

    split.when_holding_a_tile(step)


def backward_tile(
    config: Config, d: int, dtype, layer_out_dtype, capacity: int | None = None, *, carried: bool = False
) -> int:
    """The token tile boundary_backward chooses (VMEM plan) on a chip with `capacity` bytes;
    `carried`: V4.1's (boundary_backward_carried)."""
    n, padded = config.n, _layout.padded_features(d)
    chunk = _layout.feature_chunk(padded)
    size, lo_size = jnp.dtype(dtype).itemsize, jnp.dtype(layer_out_dtype).itemsize
    stream_rows = _layout.stream_sublanes(n, size)
    rows, g = _layout.logit_rows(n, config.mix), _layout.group_rows(n)
    # Whole-token blocks, double-buffered: x, layer_out, dlayer_in; the x_{l+1} scratch.
    per_token = 2 * (stream_rows * padded * size + padded * (lo_size + size)) + stream_rows * padded * size
    # Chunk blocks, double-buffered: dx_partial of l+1 in, dx_partial and dlayer_out of l out; the
    # dx_{l+1} chunk scratch.
    per_token += 2 * (2 * stream_rows * chunk * size + chunk * lo_size) + stream_rows * chunk * size
    # h_post, h_res in and dh_post, dh_res out (tokens in the sublanes, 128 lanes), dh of l+1.
    per_token += 4 * 2 * _layout.round_up(n * n, _layout.LANES) * 4 + 2 * (1 + n) * g * 4
    # f32 temporaries: the post's n streams and its sum over a whole token, the pre backward's
    # streamed passes (_pre_backward.streamed_bytes_per_token); the Sinkhorn steps and the column
    # pack, the logits.
    per_token += (n + 1) * padded * 4 + (n + 3) * chunk * 4
    per_token += _pre_backward.streamed_bytes_per_token(n, rows, n * config.projection_width, chunk, padded, size)
    iterations = 2 * config.sinkhorn_iters if config.mix == "sinkhorn" else 0
    per_token += (iterations * n * g + _layout.round_up(rows + g + _layout.SUBLANES, _layout.LANES) + 8 * rows) * 4
    # V4.1: l+1's dH_pre group, h_pre of l in and its cotangent out, G f32 rows each, double-buffered.
    per_token += 2 * 3 * g * 4 if carried else 0
    # The weight (single-buffered) and the gradient accumulator (rows, n Dp) with its columns.
    # (parameter_bytes counts the larger of the transposed weight and the stacked projection
    # operand; the backward holds both.)
    fixed = _pre.parameter_bytes(config, padded) + 2 * (rows * n * padded + 2 * rows * _layout.LANES) * 4
    fixed += _pre.stacked_bytes(n, config.projection_width, padded, rows)
    return _layout.choose_token_tile(
        "boundary_backward", per_token, fixed, _layout.vmem_budget(capacity or _layout.chip_vmem())
    )


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret", "cores"))
def boundary_backward(
    config: Config,
    dlayer_in,
    dx_partial_next,
    dh_post_next,
    dh_res_next,
    x,
    layer_out,
    h_post,
    h_res,
    params: Params,
    *,
    tile=None,
    interpret=None,
    cores=None,
):
    """The backward of boundary_forward: pre_backward of sublayer l+1 (x_{l+1} recomputed from x and
    layer_out) and post_backward of l with g = its dx, fused (dx_{l+1} never stored). Operands:
    the cotangents of l+1's layer_in [T, D] and x_{l+1} [T, n, D] (x's dtype), of its h_post
    [T, n] and h_res [T, n, n] (f32); then boundary_forward's x, layer_out, h_post, h_res and
    Params. Returns (dx_partial [T, n, D] x's dtype, dlayer_out [T, D] layer_out's dtype, dh_post
    [T, n], dh_res [T, n, n], dnorm_weight [n D], dphi [n D, N], dalpha [3], dbias [N] f32): the
    contract of mhc.jax's boundary_backward kernel. `tile`, `interpret`: as mhc.tpu.pre_forward;
    `cores`: as mhc.tpu.pre_backward."""
    operation = "boundary_backward"
    cotangents = (dlayer_in, dx_partial_next, None, dh_post_next, dh_res_next)
    _check_backward(operation, config, cotangents, x, layer_out, h_post, h_res, params, tile)
    return _backward(config, cotangents, x, layer_out, None, h_post, h_res, params, tile, interpret, cores)


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret", "cores"))
def boundary_backward_carried(
    config: Config,
    next_dlayer_in,
    next_dx_partial,
    next_dh_pre,
    next_dh_post,
    next_dh_res,
    x,
    layer_out,
    h_pre,
    h_post,
    h_res,
    params: Params,
    *,
    tile=None,
    interpret=None,
    cores=None,
):
    """The backward of boundary_forward_carried (DeepSeek-V4.1): pre_backward_carried of l+1
    (carried = h_pre of l, x_{l+1} recomputed) and post_backward of l with g = its dx, fused.
    Operands: l+1's cotangents (as boundary_backward's, with next_dh_pre [T, n] f32, the cotangent
    of l+1's own h_pre, after next_dx_partial), then x, layer_out, h_pre, h_post, h_res of l and
    l+1's Params. Returns (dx_partial, dlayer_out, dh_post, dh_res, dh_pre [T, n] f32 (l+1's
    dcarried: the cotangent of l's h_pre), dnorm_weight, dphi, dalpha, dbias): the contract of the
    mhc_boundary_backward_carried target. `tile`, `interpret`: as mhc.tpu.pre_forward; `cores`: as
    mhc.tpu.pre_backward."""
    operation = "boundary_backward_carried"
    cotangents = (next_dlayer_in, next_dx_partial, next_dh_pre, next_dh_post, next_dh_res)
    _check_backward(operation, config, cotangents, x, layer_out, h_post, h_res, params, tile)
    _check_h_pre(operation, h_pre, x)
    return _backward(config, cotangents, x, layer_out, h_pre, h_post, h_res, params, tile, interpret, cores)


def _check_backward(operation: str, config: Config, cotangents, x, layer_out, h_post, h_res, params, tile):
    _post._check(operation, config, x, layer_out, h_post, h_res, tile)
    _pre.check_params(operation, config, x, params)
    t, n, d = x.shape
    prefix = "next_" if operation.endswith("carried") else ""
    names = (f"{prefix}dlayer_in", "next_dx_partial" if prefix else "dx_partial_next", "next_dh_pre")
    names += ("next_dh_post", "next_dh_res") if prefix else ("dh_post_next", "dh_res_next")
    shapes = ((t, d), x.shape, (t, n), (t, n), (t, n, n))
    dtypes = (x.dtype, x.dtype, _F32, _F32, _F32)
    for name, value, shape, dtype in zip(names, cotangents, shapes, dtypes, strict=True):
        if value is not None and (value.shape != shape or value.dtype != dtype):
            raise ValueError(
                f"mhc.tpu.{operation}: {name}: expected shape {shape} and dtype {jnp.dtype(dtype)}, "
                f"got {value.shape} {value.dtype}"
            )


def _backward(config: Config, cotangents, x, layer_out, h_pre, h_post, h_res, params: Params, tile, interpret, cores):
    """The fused backward for checked operands: cotangents (dlayer_in, dx_partial, dh_pre or None
    (V4), dh_post, dh_res) of l+1; h_pre None (V4) or l's, the carried mix of l+1."""
    dlayer_in, dx_partial_next, dh_pre_next, dh_post_next, dh_res_next = cotangents
    t, n, d = x.shape
    carried = h_pre is not None
    tile = tile or backward_tile(config, d, x.dtype, layer_out.dtype, carried=carried)
    if t == 0:
        return (
            *_post.empty_backward(x, layer_out),
            *([jnp.zeros((0, n), _F32)] if carried else []),
            *(jnp.zeros(jnp.shape(p), _F32) for p in params),
        )
    padded = _layout.padded_features(d)
    chunk = _layout.feature_chunk(padded)
    rows, g = _layout.logit_rows(n, config.mix), _layout.group_rows(n)
    weight, scale, bias = _pre._transposed_weight(config, params, d, padded)
    parameters = [weight, scale, bias, _pre.stacked_projection(config, params, d, padded)]
    pairs = _post.pairs(n, x.dtype, layer_out.dtype)
    if pairs:
        parameters.append(_post._bf16_pairs_mix(h_post, h_res))
    if config.mix == "permutations":
        parameters.append(jnp.asarray(_pre._permutation_table(n).T))
    dh_next = _pre_backward.coefficient_cotangents(config, dh_pre_next, dh_post_next, dh_res_next, tile)
    operation = "boundary_backward_carried" if carried else "boundary_backward"
    split = _layout.CoreSplit.plan(operation, t, tile, padded // chunk, cores)
    whole_stream = pl.BlockSpec((tile, n, padded), lambda *step: (split.tile_block(*step), 0, 0))
    whole_features = pl.BlockSpec((tile, padded), lambda *step: (split.tile_block(*step), 0))
    chunk_stream = pl.BlockSpec((tile, n, chunk), lambda *step: _pre_backward._chunk_stream_block(split, *step))
    chunk_features = pl.BlockSpec((tile, chunk), lambda *step: split.chunk_block(*step))
    gates = pl.BlockSpec((tile, n), lambda *step: (split.tile_block(*step), 0))
    mix = pl.BlockSpec((tile, n * n), lambda *step: (split.tile_block(*step), 0))
    single = pl.Buffered(buffer_count=1)
    resident = lambda *step: (0, 0)  # noqa: E731
    parameter_specs = [pl.BlockSpec(p.shape, resident, pipeline_mode=single) for p in parameters]
    if pairs:  # the post's mix: a block per token tile
        parameter_specs[4] = pl.BlockSpec((2 * tile, 2 * (n + 1)), lambda *step: (split.tile_block(*step), 0))
    per_tile = pl.BlockSpec((None, g, tile), lambda *step: (split.tile_block(*step), 0, 0))
    if carried:
        parameters.append(_pre.carried_lanes(config, h_pre, tile))
        parameter_specs.append(per_tile)
    scratch = [pltpu.VMEM((tile, n, padded), x.dtype), pltpu.VMEM((tile, n, chunk), x.dtype)]
    if config.mix == "sinkhorn":
        scratch.append(pltpu.VMEM((2 * config.sinkhorn_iters, n * g, tile), _F32))
    scratch.append(pltpu.VMEM((tile, rows + g + _layout.SUBLANES), _F32))
    size, lo_size = x.dtype.itemsize, layer_out.dtype.itemsize
    flops, transcendentals, coefficient_bytes = _pre.coefficient_cost(config, t, padded)
    dx_partial, dlayer_out, dh_post, dh_res, gram, dbias_rows, dalpha_rows, *dh_pre = pl.pallas_call(
        functools.partial(
            _backward_kernel,
            config=config,
            features=d,
            tokens=t,
            sinkhorn=config.mix == "sinkhorn",
            permutations=config.mix == "permutations",
            carried=carried,
            split=split,
            pairs=pairs,
        ),
        grid=split.grid,
        in_specs=[
            whole_features,
            chunk_stream,
            pl.BlockSpec((None, dh_next.shape[1], tile), lambda *step: (split.tile_block(*step), 0, 0)),
            whole_stream,
            whole_features,
            gates,
            mix,
            *parameter_specs,
        ],
        out_specs=[
            chunk_stream,
            chunk_features,
            gates,
            mix,
            *_pre_backward.accumulator_specs(split, weight.shape, rows),
            *([per_tile] if carried else []),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((t, n, padded), x.dtype),
            jax.ShapeDtypeStruct((t, padded), layer_out.dtype),
            jax.ShapeDtypeStruct((t, n), _F32),
            jax.ShapeDtypeStruct((t, n * n), _F32),
            *_pre_backward.accumulator_shapes(split, weight.shape, rows),
            *([jax.ShapeDtypeStruct((pl.cdiv(t, tile), g, tile), _F32)] if carried else []),
        ],
        scratch_shapes=scratch,
        name=_layout.kernel_name(operation, tile),
        # The cores in parallel; each core's tiles and the chunks sequential: the parameter
        # gradients accumulate over a core's tiles in order, dh_post and dh_res over the chunks.
        compiler_params=_layout.compiler_params(*split.dimension_semantics),
        # Spec: Boundary, (3n + 3) D e per token (x, layer_out, dx_partial of l+1, dlayer_in read;
        # dx_partial, dlayer_out written), plus the coefficients and the parameters and their
        # gradients.
        cost_estimate=pl.CostEstimate(
            flops=int(2 * flops + 6 * t * n * (n + 1) * padded),
            transcendentals=int(2 * transcendentals),
            bytes_accessed=int(
                t * padded * (3 * n * size + 2 * lo_size + size)
                + 3 * t * (n + n * n) * 4
                + 2 * coefficient_bytes
                + (3 * t * n * 4 if carried else 0)
            ),
        ),
        interpret=interpret if interpret is not None else False,
    )(
        _layout.pad_features(dlayer_in, padded),
        _layout.pad_features(dx_partial_next, padded),
        dh_next,
        _layout.pad_features(x, padded),
        _layout.pad_features(layer_out, padded),
        h_post,
        h_res.reshape(t, n * n),
        *parameters,
    )
    return (
        dx_partial[:, :, :d],
        dlayer_out[:, :d],
        dh_post,
        dh_res.reshape(t, n, n),
        *([_layout.tokens_from_lanes(dh_pre[0], t, n)] if carried else []),
        *_pre_backward.parameter_grads(
            config,
            params,
            *(_layout.sum_over_cores(partials) for partials in (gram, dbias_rows[:, :, 0], dalpha_rows[:, :, 0])),
            d,
        ),
    )

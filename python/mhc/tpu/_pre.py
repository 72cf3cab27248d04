"""The pre forward as one Pallas TPU kernel per token tile (unverified on TPU hardware: checked in
TPU interpret mode, by lowering to Mosaic and by compiling for v5e/v6e, never run on a chip).

Per tile, x is read from HBM once: the projection and the sum of squares stream over it one
stream at a time (the MXU, full f32 precision), the coefficients follow with the tokens in the
lanes (spec: Forward steps 1-5), and the pre-apply re-reads the tile from VMEM.

pre_forward_carried is DeepSeek-V4.1's (spec: Single-pass schedule; unverified on TPU hardware as
the rest): the same kernel, whose pre-apply reads the carried mix (a (G, tile) block per token
tile, the tokens in the lanes as the gates) or, for the one-hot on stream 0, copies x_0.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from mhc._config import Config, Params
from mhc.tpu import _layout

_F32 = jnp.float32
# The projection and the sum of squares at full f32 accuracy on the MXU (spec: Precision
# policy): by default the MXU multiplies f32 operands in one bf16 pass.
_HIGHEST = jax.lax.Precision.HIGHEST
# a (rows, K) times b (cols, K) -> (rows, cols): contracts the lanes of both, so the tokens of the
# x tile (its sublanes) come out in the lanes.
_CONTRACT_LANES = (((1,), (1,)), ((), ()))


def _permutation_table(n: int) -> np.ndarray:
    """[n G, Rp] f32: row i G + j, column p is 1 where the p-th permutation (lexicographic) maps i
    to j, so table @ w gives H_res row i at rows i G .. i G + n (spec: Forward step 5)."""
    g = _layout.group_rows(n)
    table = np.zeros((n * g, _layout.residual_rows(n, "permutations")), np.float32)
    for p, perm in enumerate(itertools.permutations(range(n))):
        table[np.arange(n) * g + np.asarray(perm), p] = 1.0
    return table


def _masked_softmax(logits, valid):
    """Softmax over the sublanes (axis 0) of the valid rows; 0 in the others."""
    logits = jnp.where(valid, logits, -jnp.inf)
    e = jnp.exp(logits - jnp.max(logits, axis=0, keepdims=True))
    return e / jnp.sum(e, axis=0, keepdims=True)


def _sinkhorn(config: Config, logits, g: int, steps_ref=None):
    """H_res rows [(G, tile)] * n from the residual logits (n G, tile); row i of H_res has its
    output stream j in the sublanes. Finite iteration exactly as the spec's step 5. `steps_ref`
    (the backward's): a VMEM ref (2 iters, n G, tile) that receives the start (softmax + eps) at 0
    and the result of every normalization after it: the first column step at 1, then the row and
    column steps of iteration k at 2 + 2 k and 3 + 2 k."""
    n, eps = config.n, config.sinkhorn_eps
    valid = jax.lax.broadcasted_iota(jnp.int32, (g, logits.shape[1]), 0) < n
    rows = [jnp.where(valid, _masked_softmax(logits[i * g : (i + 1) * g], valid) + eps, 0.0) for i in range(n)]

    def save(index, rows):
        if steps_ref is not None:
            steps_ref[index] = jnp.concatenate(rows, axis=0)
        return rows

    def over_columns(rows):
        column_sums = functools.reduce(jnp.add, rows)
        # The padding rows (sums 0) divide by 1, not by eps: 0 / 0 at sinkhorn_eps = 0 would be NaN
        # and reach every row through the row sums.
        return [row / jnp.where(valid, column_sums + eps, 1.0) for row in rows]

    def over_rows(rows):
        return [row / (jnp.sum(row, axis=0, keepdims=True) + eps) for row in rows]

    def iteration(k, rows):
        rows = save(2 + 2 * k, over_rows(rows))
        return save(3 + 2 * k, over_columns(rows))

    rows = save(1, over_columns(save(0, rows)))
    rows = jax.lax.fori_loop(0, config.sinkhorn_iters - 1, iteration, rows)
    return rows


def projection(x_ref, weight_ref, *, n: int, features: int, rms_eps: float):
    """(P (rows, tile), r (1, tile)) for the token tile x_ref [tile, n, Dp] (spec: Forward steps
    1-2): the projection with the tokens in the lanes, one MXU product per stream at full f32
    precision, and the RMS factor from the sum of squares taken the same way (the padded lanes are
    zero and add nothing; the mean is over the true n D)."""
    tile, padded = x_ref.shape[0], x_ref.shape[2]
    logits = jnp.zeros((weight_ref.shape[0], tile), _F32)
    squares = jnp.zeros((_layout.SUBLANES, tile), _F32)
    ones = jnp.ones((_layout.SUBLANES, padded), _F32)
    for k in range(n):
        stream = x_ref[:, k, :].astype(_F32)
        weight = weight_ref[:, k * padded : (k + 1) * padded]
        logits += jax.lax.dot_general(weight, stream, _CONTRACT_LANES, precision=_HIGHEST, preferred_element_type=_F32)
        squares += jax.lax.dot_general(
            ones, stream * stream, _CONTRACT_LANES, precision=_HIGHEST, preferred_element_type=_F32
        )
    return logits, jax.lax.rsqrt(squares[0:1] / (n * features) + rms_eps)


def sigmoid(value):
    return 1.0 / (1.0 + jnp.exp(-value))


def stream_dots(x_ref, other, n: int):
    """(G, tile) f32: row k = sum over the lanes of x_ref[:, k, :] * other ((tile, lanes) f32), with
    the tokens in the lanes by the MXU's ones product at full f32 precision (V4's dH_pre from
    dlayer_in, V4.1's dcarried); the padded lanes are zero and add nothing."""
    g, tile = _layout.group_rows(n), x_ref.shape[0]
    ones = jnp.ones((_layout.SUBLANES, x_ref.shape[2]), _F32)
    sublane = jax.lax.broadcasted_iota(jnp.int32, (g, tile), 0)
    result = jnp.zeros((g, tile), _F32)
    for k in range(n):
        product = x_ref[:, k, :].astype(_F32) * other
        total = jax.lax.dot_general(ones, product, _CONTRACT_LANES, precision=_HIGHEST, preferred_element_type=_F32)
        result = jnp.where(sublane == k, total[0:1], result)
    return result


def pre_apply(h_pre, x_ref, n: int):
    """layer_in (tile, Dp) f32 = sum_k H_pre[k] x_k (spec: Forward step 6) from the pre-apply
    weights (G, tile) (the gates, or V4.1's carried mix), brought back to the tokens-in-sublanes
    layout by one transpose, and the tile in VMEM. h_pre None: V4.1's one-hot on stream 0, x_0
    itself."""
    if h_pre is None:
        return x_ref[:, 0, :].astype(_F32)
    gates = h_pre.T
    layer_in = gates[:, 0:1] * x_ref[:, 0, :].astype(_F32)
    for k in range(1, n):
        layer_in += gates[:, k : k + 1] * x_ref[:, k, :].astype(_F32)
    return layer_in


# pre_body's and the backward's `carried` for DeepSeek-V4's pre-apply, which mixes x with the
# sublayer's own h_pre (V4.1 passes its carried mix instead: a ref, or None for the one-hot).
OWN_GATES = "own gates"
# The wrappers' names of V4.1's two cases: the one-hot on stream 0 (a [T, 0] carried operand: no
# block), and a carried mix [T, n] (a (G, tile) block per token tile, the tokens in the lanes).
ONE_HOT, CARRIED = "one-hot", "carried"


def pre_body(
    x_ref,
    weight_ref,
    scale_ref,
    bias_ref,
    table_ref,
    layer_in_ref,
    coefficients_ref,
    *,
    config,
    features,
    carried_ref=OWN_GATES,
):
    """Spec: Forward steps 1-6 for one token tile of x_ref [tile, n, Dp] (an input block, or the
    boundary kernel's x_next output block, already in VMEM): layer_in_ref [tile, Dp] and
    coefficients_ref [coefficient rows, tile] (tokens in the lanes). table_ref: the permutation
    table, or None (Sinkhorn). carried_ref: OWN_GATES (V4: the pre-apply mixes with this tile's
    h_pre), or V4.1's carried mix (spec: Single-pass schedule) as a (G, tile) ref with the tokens
    in the lanes, or None for its one-hot on stream 0."""
    n, g = config.n, _layout.group_rows(config.n)
    tile = x_ref.shape[0]
    # Steps 1-2.
    logits, r = projection(x_ref, weight_ref, n=n, features=features, rms_eps=config.rms_eps)
    # Steps 2-3: Z = r P, a = alpha Z + bias (per row: its group's alpha).
    a = scale_ref[...] * (r * logits) + bias_ref[...]
    # Step 4.
    h_pre = sigmoid(a[0:g]) + config.pre_eps
    h_post = config.post_scale / (1.0 + jnp.exp(-a[g : 2 * g]))
    # Step 5.
    if config.mix == "sinkhorn":
        h_res = jnp.concatenate(_sinkhorn(config, a[2 * g :], g), axis=0)
    else:
        permutations = math.factorial(n)
        valid = jax.lax.broadcasted_iota(jnp.int32, (a.shape[0] - 2 * g, tile), 0) < permutations
        weights = _masked_softmax(a[2 * g :], valid)
        h_res = jax.lax.dot_general(
            table_ref[...], weights, (((1,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=_F32
        )
    coefficients_ref[...] = jnp.concatenate([h_pre, h_post, h_res], axis=0)
    # Step 6, from the tile in VMEM.
    mix = h_pre if carried_ref is OWN_GATES else (None if carried_ref is None else carried_ref[...])
    layer_in = pre_apply(mix, x_ref, n)
    layer_in_ref[...] = layer_in.astype(layer_in_ref.dtype)


def _kernel(*refs, config: Config, features: int, carried: str):
    """carried: OWN_GATES (V4), ONE_HOT, or CARRIED (a (G, tile) block of the mix follows x)."""
    x_ref, *refs = refs
    carried_ref = refs.pop(0) if carried == CARRIED else (None if carried == ONE_HOT else OWN_GATES)
    if config.mix == "permutations":
        weight_ref, scale_ref, bias_ref, table_ref, layer_in_ref, coefficients_ref = refs
    else:
        (weight_ref, scale_ref, bias_ref, layer_in_ref, coefficients_ref), table_ref = refs, None
    pre_body(
        x_ref,
        weight_ref,
        scale_ref,
        bias_ref,
        table_ref,
        layer_in_ref,
        coefficients_ref,
        config=config,
        features=features,
        carried_ref=carried_ref,
    )


def _transposed_weight(config: Config, params: Params, features: int, padded: int):
    """(norm_weight * phi)^T as [rows, n Dp]: each coefficient group on its own multiple of 8
    rows, the padded features zero. Also the per-row alpha and bias columns [rows, 1]."""
    n, g, width = config.n, _layout.group_rows(config.n), config.projection_width
    folded = (params.norm_weight[:, None] * params.phi).reshape(n, features, width)
    folded = jnp.pad(folded, ((0, 0), (0, padded - features), (0, 0))).reshape(n * padded, width)
    rows = _layout.logit_rows(n, config.mix)
    # Destination row of each projection column: pre k -> k, post k -> G + k, residual (i, j) ->
    # (2 + i) G + j (Sinkhorn) or p -> 2 G + p (permutations).
    if config.mix == "sinkhorn":
        residual = [(2 + i) * g + j for i in range(n) for j in range(n)]
    else:
        residual = [2 * g + p for p in range(config.residual_logits)]
    destination = np.asarray(list(range(n)) + [g + k for k in range(n)] + residual)
    weight = jnp.zeros((rows, n * padded), _F32).at[destination].set(folded.T)
    group_alpha = jnp.concatenate(
        [jnp.full((n,), params.alpha[0]), jnp.full((n,), params.alpha[1]), jnp.full((width - 2 * n,), params.alpha[2])]
    )
    scale = jnp.zeros((rows, 1), _F32).at[destination, 0].set(group_alpha)
    bias = jnp.zeros((rows, 1), _F32).at[destination, 0].set(params.bias)
    return weight, scale, bias


def token_tile(config: Config, d: int, dtype, capacity: int | None = None, *, carried: bool = False) -> int:
    """The token tile pre_forward chooses for x [T, n, d] of dtype on a chip with `capacity` bytes
    of VMEM (default: the chip traced for, _layout.chip_vmem) from the VMEM plan; `carried`: with
    V4.1's carried mix as an operand (pre_forward_carried)."""
    padded, size = _layout.padded_features(d), jnp.dtype(dtype).itemsize
    # Double-buffered x and layer_in tiles (and the carried mix, G f32 rows).
    per_token = 2 * _layout.stream_sublanes(config.n, size) * padded * size + 2 * padded * size
    per_token += 2 * _layout.group_rows(config.n) * 4 if carried else 0
    return _layout.choose_token_tile(
        "pre_forward",
        per_token + coefficient_bytes_per_token(config, padded),
        parameter_bytes(config, padded),
        _budget(capacity),
    )


def coefficient_bytes_per_token(config: Config, padded: int) -> int:
    """VMEM per token of the coefficient step: three f32 temporaries of one stream (its cast, its
    square, the pre-apply's sum), the logits and the double-buffered coefficient output."""
    return 3 * padded * 4 + (_layout.logit_rows(config.n, config.mix) + 2 * _layout.coefficient_rows(config.n)) * 4


def parameter_bytes(config: Config, padded: int) -> int:
    """VMEM of the projection weight, the alpha/bias columns, the permutation table and the
    sum-of-squares ones, each single-buffered (their block never changes)."""
    n, rows = config.n, _layout.logit_rows(config.n, config.mix)
    table = n * _layout.group_rows(n) * rows if config.mix == "permutations" else 0
    return (rows * n * padded + 2 * rows * _layout.LANES + table + _layout.SUBLANES * padded) * 4


def _budget(capacity: int | None) -> int:
    return _layout.vmem_budget(capacity or _layout.chip_vmem())


def check_params(operation: str, config: Config, x, params: Params):
    """x [T, n, D] f32/bf16 and Params of that n D and the config's projection width, or a
    ValueError naming the argument."""
    t, n, d = x.shape
    if n != config.n:
        raise ValueError(f"mhc.tpu.{operation}: x: expected n = {config.n} streams (axis 1), got shape {x.shape}")
    _layout.check_activation(f"mhc.tpu.{operation}", "x", x)
    m, width = n * d, config.projection_width
    for name, value, shape in zip(Params._fields, params, ((m,), (m, width), (3,), (width,)), strict=True):
        if np.shape(value) != shape:
            raise ValueError(
                f"mhc.tpu.{operation}: params.{name}: expected shape {shape} for x {x.shape}, got {np.shape(value)}"
            )


def check_tile(operation: str, tile):
    if tile is not None and tile not in _layout.TOKEN_TILES:
        raise ValueError(f"mhc.tpu.{operation}: tile: expected one of {_layout.TOKEN_TILES}, got {tile!r}")


def parameter_operands(config: Config, params: Params, d: int):
    """(operands, block specs) of the projection for a grid over token tiles: the transposed
    weight, the alpha and bias columns and (permutations) the table, each one whole block fetched
    once (single-buffered: its index never changes)."""
    weight, scale, bias = _transposed_weight(config, params, d, _layout.padded_features(d))
    operands = [weight, scale, bias]
    if config.mix == "permutations":
        operands.append(jnp.asarray(_permutation_table(config.n)))
    specs = [pl.BlockSpec(a.shape, lambda *_: (0, 0), pipeline_mode=pl.Buffered(buffer_count=1)) for a in operands]
    return operands, specs


def coefficient_output(config: Config, t: int, tile: int):
    """(block spec, shape) of the coefficient output for a grid over token tiles: [token tiles,
    coefficient rows, tile], the tokens in the lanes; the tile is a whole last dimension, so any
    tile of TOKEN_TILES is a legal block (128 lanes or not)."""
    rows = _layout.coefficient_rows(config.n)
    return (
        pl.BlockSpec((None, rows, tile), lambda i, *_: (i, 0, 0)),
        jax.ShapeDtypeStruct((pl.cdiv(t, tile), rows, tile), _F32),
    )


def split_coefficients(config: Config, coefficients, t: int):
    """(h_pre [T, n], h_post [T, n], h_res [T, n, n]) from the kernel's [tiles, rows, tile]."""
    n, g = config.n, _layout.group_rows(config.n)
    tiles, rows, tile = coefficients.shape
    coefficients = jnp.transpose(coefficients, (1, 0, 2)).reshape(2 + n, g, tiles * tile)[:, :n, :t]
    return coefficients[0].T, coefficients[1].T, jnp.transpose(coefficients[2:], (2, 0, 1))


def coefficient_cost(config: Config, t: int, padded: int) -> tuple[int, int, int]:
    """(flops, transcendentals, bytes) of the coefficient step for t tokens: the projection and the
    sum of squares over every stream, the gates and Sinkhorn; the bytes of the coefficients
    written and of the parameters read once."""
    n, g, rows = config.n, _layout.group_rows(config.n), _layout.logit_rows(config.n, config.mix)
    iterations = config.sinkhorn_iters if config.mix == "sinkhorn" else 0
    flops = t * (2 * n * padded * (rows + _layout.SUBLANES + 1) + 6 * iterations * n * g)
    return flops, t * (rows + 1), t * _layout.coefficient_rows(n) * 4 + parameter_bytes(config, padded)


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret"))
def pre_forward(config: Config, x, params: Params, *, tile: int | None = None, interpret=None):
    """(layer_in [T, D] in x's dtype, h_pre [T, n], h_post [T, n], h_res [T, n, n] f32) for
    x [T, n, D] f32 or bf16 and Params in the kernels' layout (norm_weight [n D], phi [n D, N]):
    the contract of mhc.jax's pre_forward kernel. `tile`: the token tile (one of
    mhc.tpu.TOKEN_TILES; default from the VMEM plan of the chip traced for). `interpret`:
    pltpu.InterpretParams to run in the TPU interpreter."""
    check_params("pre_forward", config, x, params)
    check_tile("pre_forward", tile)
    return run(config, x, params, OWN_GATES, tile=tile, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret"))
def pre_forward_carried(config: Config, x, carried, params: Params, *, tile: int | None = None, interpret=None):
    """DeepSeek-V4.1's pre forward (spec: Single-pass schedule), the contract of the
    mhc_pre_forward_carried target: the outputs of pre_forward (h_pre, h_post, h_res this
    sublayer's own, the same bits), but layer_in = sum_k carried[k] x_k with the carried mix
    carried f32 [T, n] (the previous sublayer's h_pre), or x_0 for a [T, 0] carried (the one-hot
    on stream 0, the first sublayer). `tile`, `interpret`: as pre_forward."""
    check_params("pre_forward_carried", config, x, params)
    check_tile("pre_forward_carried", tile)
    check_carried("mhc.tpu.pre_forward_carried", carried, *x.shape[:2])
    return run(config, x, params, None if carried.shape[1] == 0 else carried, tile=tile, interpret=interpret)


def check_carried(operation: str, carried, t: int, n: int):
    """V4.1's carried mix: f32 [T, n], or [T, 0] for the one-hot on stream 0, or a ValueError."""
    if carried.ndim != 2 or carried.shape[0] != t or carried.shape[1] not in (0, n) or carried.dtype != _F32:
        raise ValueError(
            f"{operation}: carried: expected float32 [T, n] = [{t}, {n}] (or [{t}, 0] for the one-hot on "
            f"stream 0), got {carried.shape} {carried.dtype}"
        )


def carried_lanes(config: Config, carried, tile: int):
    """A carried mix [T, n] f32 as [token tiles, G, tile] (tokens in the lanes, the padding 0)."""
    return _layout.tokens_in_lanes(carried, range(config.n), _layout.group_rows(config.n), tile)


def run(config: Config, x, params: Params, carried, *, tile: int | None, interpret):
    """pre_forward for checked operands; carried: OWN_GATES (V4), None (V4.1's one-hot on stream
    0) or V4.1's carried mix [T, n] f32, which the pre-apply reads instead of h_pre."""
    t, n, d = x.shape
    mode = OWN_GATES if carried is OWN_GATES else (ONE_HOT if carried is None else CARRIED)
    tile = tile or token_tile(config, d, x.dtype, carried=mode == CARRIED)
    if t == 0:
        return (
            jnp.zeros((0, d), x.dtype),
            jnp.zeros((0, n), _F32),
            jnp.zeros((0, n), _F32),
            jnp.zeros((0, n, n), _F32),
        )
    padded = _layout.padded_features(d)
    parameters, parameter_specs = parameter_operands(config, params, d)
    coefficient_spec, coefficient_shape = coefficient_output(config, t, tile)
    flops, transcendentals, coefficient_bytes = coefficient_cost(config, t, padded)
    operands = [_layout.pad_features(x, padded)]
    in_specs = [pl.BlockSpec((tile, n, padded), lambda i: (i, 0, 0))]
    if mode == CARRIED:
        operands.append(carried_lanes(config, carried, tile))
        in_specs.append(pl.BlockSpec((None, _layout.group_rows(n), tile), lambda i: (i, 0, 0)))
    layer_in, coefficients = pl.pallas_call(
        functools.partial(_kernel, config=config, features=d, carried=mode),
        grid=(pl.cdiv(t, tile),),
        in_specs=[*in_specs, *parameter_specs],
        out_specs=[pl.BlockSpec((tile, padded), lambda i: (i, 0)), coefficient_spec],
        out_shape=[jax.ShapeDtypeStruct((t, padded), x.dtype), coefficient_shape],
        name=_layout.kernel_name("pre_forward" if mode == OWN_GATES else "pre_forward_carried", tile),
        compiler_params=_layout.compiler_params("parallel"),
        # Spec: Minimum memory traffic, (n + 1) D e per token, plus the coefficients (and V4.1's
        # carried mix, 4 n bytes).
        cost_estimate=pl.CostEstimate(
            flops=int(flops),
            transcendentals=int(transcendentals),
            bytes_accessed=int(
                t * (n + 1) * padded * x.dtype.itemsize + coefficient_bytes + (t * n * 4 if mode == CARRIED else 0)
            ),
        ),
        interpret=interpret if interpret is not None else False,
    )(*operands, *parameters)
    return (layer_in[:, :d], *split_coefficients(config, coefficients, t))

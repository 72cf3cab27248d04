"""The pre backward as one Pallas TPU kernel (unverified on TPU hardware: checked in TPU interpret
mode, by lowering to Mosaic and by compiling for v5e/v6e, never run on a chip).

Grid (cores, token tiles per core, feature chunks: _layout.CoreSplit), the cores in parallel,
the rest sequential. The x block is the whole tile [tile, n, Dp] (its index does not change over
the chunks, so it is read from HBM once per tile); at the first
chunk the kernel recomputes the forward's coefficients from it (_pre's streamed projection, gates
and Sinkhorn, every Sinkhorn step kept in VMEM), runs the spec's backward through the gates, the
Sinkhorn steps or the permutation softmax and the RMS statistic with the tokens in the lanes, and
adds this tile's share of the parameter gradients to its core's output blocks, which stay
resident over the core's steps (so they are summed tile after tile, then over the cores in core
order: a fixed order, bitwise reproducible; with one core, the tiles in order). Every
chunk then writes its lanes of dx = dx_partial + H_pre dli + dP W - dr r^3 x / M, with dx_partial
and dx in [tile, n, chunk] blocks (whole ones would not fit VMEM in bf16 at D = 2048).
Every pass over x streams through lane chunks or token windows, no (tile, Dp) f32 value live;
the f32-accurate MXU products split their f32 operands into three bf16 terms (docs/tpu.md, "The
backwards streamed through the features").

The same body runs DeepSeek-V4's head backward (mhc.tpu._head): the pre gates only, no dx_partial;
and DeepSeek-V4.1's pre_backward_carried (spec: Single-pass schedule; unverified on TPU hardware
as the rest): dH_pre comes in with dH_post and dH_res, dx's pre-apply term takes the carried mix,
and the per-stream sums over D of x dli (V4's dH_pre) go out as dcarried.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mhc._config import Config, Params, PreApply
from mhc.tpu import _layout, _pre

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
_MATMUL = (((1,), (0,)), ((), ()))  # a (m, k) times b (k, n)
_CONTRACT_LANES = (((1,), (1,)), ((), ()))  # a (m, k) times b (n, k)
# Rows of the per-token column pack (_coefficient_step): the pre gates' group, then a group whose
# first row is the x coefficient dr r^3 / M.
_TOKEN_SCALARS = _layout.SUBLANES


def _group(rows, i: int, g: int):
    return rows[i * g : (i + 1) * g]


def _sinkhorn_backward(config: Config, logits, dh_res, g: int, steps_ref):
    """da_res (n G, tile) from dH_res (n G, tile): back through every step of the finite iteration
    (spec: Backward, Sinkhorn), each step's input and output read from steps_ref."""
    n, eps = config.n, config.sinkhorn_eps
    _pre._sinkhorn(config, logits, g, steps_ref)
    valid = jax.lax.broadcasted_iota(jnp.int32, (g, logits.shape[1]), 0) < n

    def step(index):
        return [_group(steps_ref[index], i, g) for i in range(n)]

    def back_over_columns(grads, index):
        # Y_i = X_i / (sum_i X_i + eps): dX_i = (dY_i - sum_i dY_i Y_i) / (sum_i X_i + eps).
        outputs, inputs = step(index), step(index - 1)
        divisor = jnp.where(valid, functools.reduce(jnp.add, inputs) + eps, 1.0)  # as the forward's
        dots = functools.reduce(jnp.add, [d * y for d, y in zip(grads, outputs, strict=True)])
        return [(d - dots) / divisor for d in grads]

    def back_over_rows(grads, index):
        # Y_i = X_i / (sum_j X_i + eps): dX_i = (dY_i - sum_j dY_i Y_i) / (sum_j X_i + eps), on the
        # n valid sublanes only (the padding rows stay 0: the next column step divides them by
        # eps alone).
        outputs, inputs = step(index), step(index - 1)
        return [
            jnp.where(
                valid, (d - jnp.sum(d * y, axis=0, keepdims=True)) / (jnp.sum(x, axis=0, keepdims=True) + eps), 0.0
            )
            for d, y, x in zip(grads, outputs, inputs, strict=True)
        ]

    def iteration(j, grads):
        k = config.sinkhorn_iters - 2 - j
        return back_over_rows(back_over_columns(grads, 3 + 2 * k), 2 + 2 * k)

    grads = [_group(dh_res, i, g) for i in range(n)]
    grads = jax.lax.fori_loop(0, config.sinkhorn_iters - 1, iteration, grads)
    grads = back_over_columns(grads, 1)
    # The softmax start (eps has no gradient): dA = S (dS - sum_j dS S).
    result = []
    for i, d in enumerate(grads):
        soft = _pre._masked_softmax(_group(logits, i, g), valid)
        result.append(soft * (d - jnp.sum(d * soft, axis=0, keepdims=True)))
    return jnp.concatenate(result, axis=0)


def _permutations_backward(config: Config, logits, dh_res, table_t_ref):
    """da_res (Rp, tile) from dH_res (n G, tile) (spec: Backward, Permutations): dw_p = sum_i
    dH_res[i, perm_p(i)] by one MXU product with the transposed 0/1 table, then the softmax."""
    valid = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 0) < math.factorial(config.n)
    w = _pre._masked_softmax(logits, valid)
    dw = jax.lax.dot_general(table_t_ref[...], dh_res, _MATMUL, precision=_HIGHEST, preferred_element_type=_F32)
    return w * (dw - jnp.sum(w * dw, axis=0, keepdims=True))


# Lanes per step of the streamed loops over the features (the forward projection's chunk: a full
# contraction depth of v6e's MXU, two of v5e's) and tokens per step of those that run on the VPU.
_STREAM_LANES = 2 * _layout.LANES
_STREAM_TOKENS = 64
# _stream_major's window at bf16 n = 4: 16 tokens (one packed bf16 vreg a stream) by 128 lanes.
_PAIRS_TOKENS = 16
# Tokens per step of the loop that writes dx (a few vregs per stream at 512 lanes).
_DX_TOKENS = 16
# The three bf16 terms (hi, mid, lo) of an f32 value: together its 24 bits (spec: Precision policy).
_TERMS = 3


def _stream_lanes(padded: int) -> int:
    return _STREAM_LANES if padded % _STREAM_LANES == 0 else _layout.LANES


def _bf16_terms(value):
    """(hi, mid, lo) bf16 with hi + mid + lo = value to 2^-24 (the f32 value's 24 bits)."""
    hi = value.astype(jnp.bfloat16)
    rest = value - hi.astype(_F32)
    mid = rest.astype(jnp.bfloat16)
    return hi, mid, (rest - mid.astype(_F32)).astype(jnp.bfloat16)


def _flat_steps(padded: int, tile: int, tokens: int):
    """(steps, decode) of one loop over (lane chunk, token group) pairs (not two nested loops:
    libtpu's schedule of a nested pair hides the outer trip count from the estimate); decode(i) ->
    (lanes, tokens) as pl.ds. Shifts and masks: the tiles and groups are powers of 2 (Mosaic
    lowers integer division only for a known chip)."""
    chunk, group = _stream_lanes(padded), min(tokens, tile)
    groups = tile // group

    def decode(i):
        c = i >> (groups.bit_length() - 1)
        first = pl.multiple_of((i & (groups - 1)) * group, group)
        return pl.ds(pl.multiple_of(c * chunk, chunk), chunk), pl.ds(first, group)

    return padded // chunk * groups, decode


def _stream_major(x_ref, streams_ref, pairs_ref, n: int):
    """streams_ref [n, tile, Dp] (x's dtype) = x_ref [tile, n, Dp] with the streams in front, so
    the passes after it read each stream in the dtype's own tiles (no relayout per use). bf16 at
    n = 4: the block's 32-bit words, 16 tokens x 128 lanes at a time (_pre._pairs_streams: two
    sublane-strided loads and a shift or a mask, exact), rounded back to bf16 (exact). Otherwise
    x_ref[:, k, lanes] per lane chunk (a relayout, once)."""
    tile, padded = x_ref.shape[0], x_ref.shape[2]
    if not _pre._rows_view(n, x_ref.dtype):
        chunk = _stream_lanes(padded)

        def copy(c, carry):
            lanes = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
            for k in range(n):
                streams_ref[k, :, lanes] = x_ref[:, k, lanes]
            return carry

        jax.lax.fori_loop(0, padded // chunk, copy, 0)
        return
    rows = min(_PAIRS_TOKENS, tile)
    windows = tile // rows

    def window(i, carry):
        # (lane tile, token window) pairs in one loop (shifts: powers of 2)
        lanes = pl.ds(pl.multiple_of((i >> (windows.bit_length() - 1)) * _layout.LANES, _layout.LANES), _layout.LANES)
        tokens = pl.ds(pl.multiple_of((i & (windows - 1)) * rows, rows), rows)
        for k, stream in enumerate(_pre._pairs_streams(x_ref, pairs_ref, tokens, lanes, rows)):
            streams_ref[k, tokens, lanes] = stream.astype(streams_ref.dtype)
        return carry

    jax.lax.fori_loop(0, padded // _layout.LANES * windows, window, 0, unroll=2)


def _streamed_stream_dots(streams_ref, dli_ref, sums_ref, n: int):
    """(G, tile) f32: row k = sum over the lanes of x_ref[:, k, :] * dli_ref (V4's dH_pre from
    dlayer_in, V4.1's dcarried), streamed: per (lane chunk, token group) the products folded over
    the 128-lane groups add into VMEM (no (tile, Dp) f32 value live), then one ones product per
    stream at full f32 precision sums the last 128 lanes with the tokens in the lanes. The padded
    lanes are zero and add nothing."""
    g, tile, padded = _layout.group_rows(n), streams_ref.shape[1], streams_ref.shape[2]
    steps, decode = _flat_steps(padded, tile, _STREAM_TOKENS)

    sums_ref[...] = jnp.zeros(sums_ref.shape, _F32)

    def step(i, carry):
        lanes, tokens = decode(i)
        dli = dli_ref[tokens, lanes].astype(_F32)
        for k in range(n):
            product = streams_ref[k, tokens, lanes].astype(_F32) * dli
            folded = functools.reduce(
                jnp.add,
                [product[:, j * _layout.LANES : (j + 1) * _layout.LANES] for j in range(product.shape[1] // 128)],
            )
            # (stream k's rows at k tile: an int index beside a pl.ds on a scoped ref does not
            # discharge in Pallas's plain interpreter)
            rows = pl.ds(pl.multiple_of(k * tile + tokens.start, tokens.size), tokens.size)
            sums_ref[rows, :] += folded
        return carry

    jax.lax.fori_loop(0, steps, step, 0)
    ones = jnp.ones((_layout.SUBLANES, _layout.LANES), _F32)
    sublane = jax.lax.broadcasted_iota(jnp.int32, (g, tile), 0)
    result = jnp.zeros((g, tile), _F32)
    for k in range(n):
        total = jax.lax.dot_general(
            ones,
            sums_ref[k * tile : (k + 1) * tile, :],
            _CONTRACT_LANES,
            precision=_HIGHEST,
            preferred_element_type=_F32,
        )
        result = jnp.where(sublane == k, total[0:1], result)
    return result


def _streamed_gram(gram_ref, dp, streams_ref, terms_ref, valid_tokens, n: int):
    """gram_ref (rows, n Dp) += dp (rows, tile) x_k (tile, Dp) for every stream k (the projection
    gradient before the norm weight; the tokens past valid_tokens, whatever their memory holds,
    count as zero), streamed over lane chunks of x. bf16 x: dp's three bf16 terms stacked on the
    sublanes, one MXU product with the chunk of x_k (exact products, f32 accumulation: dp at full
    f32 accuracy, x exact), then hi + (mid + lo); half the MXU passes of precision=HIGHEST, which
    also splits x. f32 x: dp times x_k at HIGHEST."""
    rows, tile = dp.shape
    padded = streams_ref.shape[2]
    chunk = _stream_lanes(padded)
    bf16 = streams_ref.dtype == jnp.bfloat16
    sublane_valid = jax.lax.broadcasted_iota(jnp.int32, (tile, 1), 0) < valid_tokens

    if bf16:
        terms_ref[...] = jnp.concatenate(_bf16_terms(dp), axis=0)
    else:
        terms_ref[...] = dp

    def step(c, carry):
        start = pl.multiple_of(c * chunk, chunk)
        for k in range(n):
            stream = jnp.where(sublane_valid, streams_ref[k, :, pl.ds(start, chunk)], 0)
            if bf16:
                product = jnp.dot(terms_ref[...], stream, preferred_element_type=_F32)
                product = product[0:rows] + (product[rows : 2 * rows] + product[2 * rows :])
            else:
                product = jax.lax.dot_general(
                    terms_ref[...], stream, _MATMUL, precision=_HIGHEST, preferred_element_type=_F32
                )
            lanes = pl.ds(pl.multiple_of(k * padded + start, _layout.LANES), chunk)
            gram_ref[:, lanes] += product
        return carry

    jax.lax.fori_loop(0, padded // chunk, step, 0)


def _six_term_lhs(dp_t):
    """dp_t (tile, rows) f32 as the bf16 LHS [hi hi hi mid mid lo] (tile, 6 rows) of the product
    with _six_term_rhs: sum of hi W_hi + hi W_mid + hi W_lo + mid W_hi + mid W_mid + lo W_hi, the
    six bf16 products precision=HIGHEST takes (the same accuracy), in one contraction of 6 rows
    (three 128-deep MXU passes at 48 rows, not six)."""
    hi, mid, lo = _bf16_terms(dp_t)
    return jnp.concatenate([hi, hi, hi, mid, mid, lo], axis=1)


def _six_term_rhs(weight):
    """weight (rows, lanes) f32 as the bf16 RHS [W_hi; W_mid; W_lo; W_hi; W_mid; W_hi]."""
    hi, mid, lo = _bf16_terms(weight)
    return jnp.concatenate([hi, mid, lo, hi, mid, hi], axis=0)


def backward_body(
    dli_ref,
    dx_partial_ref,
    dh_ref,
    x_ref,
    weight_ref,
    scale_ref,
    bias_ref,
    table_t_ref,
    dx_ref,
    gram_ref,
    dbias_ref,
    dalpha_ref,
    steps_ref,
    columns_ref,
    *,
    config: Config,
    features: int,
    tokens: int,
    split: _layout.CoreSplit,
    mode: PreApply = PreApply.OWN_GATES,
    carried_ref=None,
    dcarried_ref=None,
    given_dh_pre: bool | None = None,
    partials_ref=None,
    projection_ref=None,
):
    """One grid step (token tile i, feature chunk c: split.position()) of the pre backward, for the
    pre kernel, the head (gates only: dx_partial_ref, dh_ref, table_t_ref and steps_ref None,
    weight_ref with the pre group only) and a fused boundary kernel whose blocks are already in
    VMEM.

    Inputs: dli_ref [tile, Dp], dx_partial_ref [tile, n, chunk], dh_ref ((1 + n) G, tile) (dH_post
    then the rows of dH_res, the tokens in the lanes), x_ref [tile, n, Dp], the transposed weight
    (rows, n Dp) with its alpha and bias columns (rows, 1) (_pre._transposed_weight's layout),
    table_t_ref the transposed permutation table (Rp, n G) or None. Outputs: dx_ref [tile, n, chunk]
    and three accumulators over this core's tiles (split): gram_ref (rows, n Dp) = sum_t dP x (the
    projection gradient before the norm weight), dbias_ref and dalpha_ref (rows, 1) = sum_t da and
    sum_t da Z per logit row. The caller runs it only at steps that hold a tile
    (split.when_holding_a_tile). Scratch: steps_ref (2 iters, n G, tile) (Sinkhorn) and columns_ref
    (tile, rows + G + 8): dP and the per-token scalars with the tokens in the sublanes.
    `tokens`: T, to mask the ragged last tile out of the parameter gradients.

    DeepSeek-V4.1's carried mix (spec: Single-pass schedule): mode CARRIED with carried_ref the mix
    (G, tile) (tokens in the lanes), or ONE_HOT (stream 0), instead of OWN_GATES. Then dh_ref has a
    group more in front, dH_pre (an input: the next sublayer's dcarried), dx's pre-apply term
    takes the carried mix for H_pre, and sum_d x_k dli (V4's dH_pre) goes to dcarried_ref (G, tile)
    if given.

    The split form's finish (pre_backward_finish, D split over devices: spec, Tensor parallelism):
    partials_ref (rows + 8, tile) holds the all-reduced projection P (the logit rows) and, at row
    `rows`, the sum of squares, which replace the recompute from this device's slice of x;
    `features` is then the whole D (the mean of the RMS statistic), and given_dh_pre (default:
    V4.1's) says that dh_ref's first group is the all-reduced dH_pre, for V4 too.

    projection_ref: the forward's streamed projection operand (_pre.stacked_weight_terms of the
    same weight), from which the coefficients are recomputed as the forward computes them
    (_pre.streamed_sums; required unless partials_ref is given). Every pass over x streams it
    through lane chunks (docs/tpu.md, "The backwards streamed through the features"): no
    (tile, Dp) f32 value is live."""
    n, g = config.n, _layout.group_rows(config.n)
    gates_only = dh_ref is None
    own_gates = mode is PreApply.OWN_GATES
    if given_dh_pre is None:
        given_dh_pre = not own_gates
    tile, padded, chunk = x_ref.shape[0], x_ref.shape[2], dx_ref.shape[2]
    rows = weight_ref.shape[0]
    i, c, first_step = split.position()
    valid_tokens = tokens - i * tile

    @pl.when(first_step)
    def _start():
        gram_ref[...] = jnp.zeros_like(gram_ref)
        dbias_ref[...] = jnp.zeros_like(dbias_ref)
        dalpha_ref[...] = jnp.zeros_like(dalpha_ref)

    def _coefficients(logits, r, streams_ref, pairs_ref, sums_ref, terms_ref):
        _stream_major(x_ref, streams_ref, pairs_ref, n)
        z = r * logits
        scale = scale_ref[...]
        a = scale * z + bias_ref[...]
        sublane = jax.lax.broadcasted_iota(jnp.int32, (g, tile), 0)
        dh = None if gates_only else dh_ref[...]
        if given_dh_pre:
            # V4.1 (or a split form's finish): dH_pre is given, the first group of dh.
            dh_pre, dh = dh[0:g], dh[g:]
        if not given_dh_pre or dcarried_ref is not None:
            # sum_d x_k dli: V4's dH_pre, V4.1's dcarried.
            mixed = _streamed_stream_dots(streams_ref, dli_ref, sums_ref, n)
            if not given_dh_pre:
                dh_pre = mixed
            else:
                dcarried_ref[...] = mixed
        # Gates (pre_eps has no gradient).
        s_pre = _pre.sigmoid(a[0:g])
        parts = [dh_pre * s_pre * (1.0 - s_pre)]
        if not gates_only:
            s_post = _pre.sigmoid(a[g : 2 * g])
            parts.append(dh[0:g] * config.post_scale * s_post * (1.0 - s_post))
            if config.mix == "sinkhorn":
                parts.append(_sinkhorn_backward(config, a[2 * g :], dh[g:], g, steps_ref))
            else:
                parts.append(_permutations_backward(config, a[2 * g :], dh[g:], table_t_ref))
        da = jnp.concatenate(parts, axis=0)
        # The ragged last tile's absent tokens (whatever their memory held) add nothing.
        lane_valid = jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1) < valid_tokens
        da = jnp.where(lane_valid, da, 0.0)
        dbias_ref[...] += jnp.sum(da, axis=1, keepdims=True)
        dalpha_ref[...] += jnp.sum(jnp.where(lane_valid, da * z, 0.0), axis=1, keepdims=True)
        dz = scale * da
        dp = jnp.where(lane_valid, r * dz, 0.0)
        dr = jnp.sum(dz * logits, axis=0, keepdims=True)
        _streamed_gram(gram_ref, dp, streams_ref, terms_ref, valid_tokens, n)
        x_coefficient = jnp.broadcast_to(dr * r * r * r / (n * features), (_TOKEN_SCALARS, tile))
        # The pre-apply's weights of dx = ... + H_pre dli: the gates, or V4.1's carried mix.
        if own_gates:
            pre_apply_weights = s_pre + config.pre_eps
        elif mode is PreApply.ONE_HOT:
            pre_apply_weights = jnp.where(sublane == 0, 1.0, 0.0)
        else:
            pre_apply_weights = carried_ref[...]
        columns_ref[...] = jnp.concatenate([dp, pre_apply_weights, x_coefficient], axis=0).T

    @pl.when(c == 0)
    def _coefficient_step():
        # The projection's own scoped buffers first, then this step's in one scope (Pallas's plain
        # interpreter does not discharge a run_scoped nested in another).
        if partials_ref is None:
            logits, squares = _pre.streamed_sums(x_ref, projection_ref, n=n)
            r = _pre.inverse_rms(squares, n * features, config.rms_eps)
        else:
            logits = partials_ref[0:rows, :]
            r = _pre.inverse_rms(partials_ref[rows : rows + 1, :], n * features, config.rms_eps)
        bf16 = x_ref.dtype == jnp.bfloat16
        pl.run_scoped(
            functools.partial(_coefficients, logits, r),
            pltpu.VMEM((n, tile, padded), x_ref.dtype),
            pltpu.VMEM((2 * _PAIRS_TOKENS, _layout.LANES), jnp.uint32),
            pltpu.VMEM((n * tile, _layout.LANES), _F32),
            pltpu.VMEM((_TERMS * rows, tile) if bf16 else (rows, tile), jnp.bfloat16 if bf16 else _F32),
        )

    start = pl.multiple_of(c * chunk, _layout.LANES)
    window = min(_DX_TOKENS, tile)

    def dx_chunk(products_ref):
        # dP W for this chunk of every stream, one MXU product each over the whole tile (the
        # six-term bf16 form of an f32 product), kept in VMEM; then the tokens window by window.
        lhs = _six_term_lhs(columns_ref[:, 0:rows])
        for k in range(n):
            weight = weight_ref[:, pl.ds(pl.multiple_of(k * padded + start, _layout.LANES), chunk)]
            products_ref[k] = jnp.dot(lhs, _six_term_rhs(weight), preferred_element_type=_F32)

        def tokens_window(w, carry):
            tokens = pl.ds(pl.multiple_of(w * window, window), window)
            columns = columns_ref[tokens, :]
            x_coefficient = columns[:, rows + g : rows + g + 1]
            dli = dli_ref[tokens, pl.ds(start, chunk)].astype(_F32)
            for k in range(n):
                dx = columns[:, rows + k : rows + k + 1] * dli
                if not gates_only:
                    dx += dx_partial_ref[tokens, k, :].astype(_F32)
                dx += products_ref[k, tokens, :]
                dx -= x_coefficient * x_ref[tokens, k, pl.ds(start, chunk)].astype(_F32)
                dx_ref[tokens, k, :] = dx.astype(dx_ref.dtype)
            return carry

        jax.lax.fori_loop(0, tile // window, tokens_window, 0)

    pl.run_scoped(dx_chunk, pltpu.VMEM((n, tile, chunk), _F32))


def backward_tile(
    config: Config,
    d: int,
    dtype,
    *,
    rows: int,
    gates_only: bool,
    operation: str,
    capacity: int | None = None,
    carried: bool = False,
    partials: bool = False,
) -> int:
    """The token tile of the pre (or head) backward for x [T, n, d] of dtype on a chip with
    `capacity` bytes of VMEM (default: the chip traced for, _layout.chip_vmem), from the VMEM
    plan: double-buffered x [tile, n, Dp] and dli [tile, Dp] blocks, dx_partial and dx
    [tile, n, chunk] blocks, f32 temporaries (four of a stream at the first chunk, three of a chunk
    after), the Sinkhorn steps, the column pack and the logit-sized temporaries; fixed: the weight
    (rows, n Dp) single-buffered and the gradient accumulator of its shape, double-buffered.
    `carried`: V4.1's (pre_backward_carried): dH_pre's group of dh, the carried mix and dcarried
    (G f32 rows each, double-buffered) more. `partials`: the split form's finish, whose partials
    block (rows + 8 f32 rows, double-buffered) replaces the recompute."""
    padded = _layout.padded_features(d)
    chunk = _layout.feature_chunk(padded)
    size = jnp.dtype(dtype).itemsize
    n, g = config.n, _layout.group_rows(config.n)
    streams = _layout.stream_sublanes(n, size)
    chunk_streams = (1 if gates_only else 2) * 2 * streams * chunk * size
    width = n * (n if gates_only else config.projection_width)
    per_token = 2 * streams * padded * size + 2 * padded * size + chunk_streams + 3 * chunk * 4
    per_token += streamed_bytes_per_token(n, rows, width, chunk, padded, size)
    steps = 2 * config.sinkhorn_iters * n * g if not gates_only and config.mix == "sinkhorn" else 0
    pack = _layout.round_up(rows + g + _TOKEN_SCALARS, _layout.LANES)
    per_token += 4 * (pack + 8 * rows + 2 * (1 + n) * g)
    per_token += 4 * 2 * 3 * g if carried else 0
    per_token += 4 * 2 * (rows + _layout.SUBLANES) if partials else 0
    fixed = 3 * rows * n * padded * 4 + _pre.stacked_bytes(n, width // n, padded, rows)
    budget = _layout.vmem_budget(capacity or _layout.chip_vmem())
    smallest = _layout.TOKEN_TILES[-1]
    if steps and smallest * (per_token + 4 * steps) + fixed > budget >= smallest * per_token + fixed:
        raise ValueError(
            f"mhc.tpu.{operation}: config.sinkhorn_iters = {config.sinkhorn_iters} is too many for the "
            f"VMEM plan: the backward keeps every Sinkhorn step of a token tile in VMEM "
            f"({smallest * 4 * steps / 2**20:.1f} MiB at the smallest tile of {smallest} tokens; the "
            f"budget is {budget / 2**20:.0f} MiB)"
        )
    return _layout.choose_token_tile(operation, per_token + 4 * steps, fixed, budget)


def streamed_bytes_per_token(n: int, rows: int, width: int, chunk: int, padded: int, size: int) -> int:
    """VMEM per token of backward_body's streamed passes (scoped, so the compiler may reuse them,
    counted apart): x with the streams in front (_stream_major: n Dp of x's `size`), the
    projection's accumulators (_pre.streamed_sums: n rows of the n N = `width` products and of 128
    squares), dH_pre's folded sums (n x 128), dP's three bf16 terms and dx's products of a chunk
    (n x chunk f32)."""
    projection = n * (_layout.round_up(width, _layout.LANES) + _layout.LANES) * 4
    return n * padded * size + projection + n * _layout.LANES * 4 + _TERMS * rows * 2 + n * chunk * 4


def _check(operation: str, config: Config, cotangents, x, params: Params, tile):
    """cotangents: (name, value, shape as a function of (T, n, D), dtype or None for x's)."""
    if x.ndim != 3 or x.shape[1] != config.n:
        raise ValueError(f"{operation}: x: expected [T, n = {config.n}, D], got shape {x.shape}")
    _layout.check_activation(operation, "x", x)
    t, n, d = x.shape
    for name, value, shape_of, dtype in cotangents:
        shape, dtype = shape_of(t, n, d), dtype or x.dtype
        if value.shape != shape or value.dtype != dtype:
            raise ValueError(
                f"{operation}: {name}: expected shape {shape} and dtype {jnp.dtype(dtype).name}, "
                f"got {value.shape} {value.dtype}"
            )
    m, width = n * d, config.projection_width
    for name, value, shape in zip(Params._fields, params, ((m,), (m, width), (3,), (width,)), strict=True):
        if np.shape(value) != shape:
            raise ValueError(
                f"{operation}: params.{name}: expected shape {shape} for x {x.shape}, got {np.shape(value)}"
            )
    if tile is not None and tile not in _layout.TOKEN_TILES:
        raise ValueError(f"{operation}: tile: expected one of {_layout.TOKEN_TILES}, got {tile!r}")


def _v4_cotangents(dlayer_in, dx_partial, dh_post, dh_res):
    return (
        ("dlayer_in", dlayer_in, lambda t, n, d: (t, d), None),
        ("dx_partial", dx_partial, lambda t, n, d: (t, n, d), None),
        ("dh_post", dh_post, lambda t, n, d: (t, n), _F32),
        ("dh_res", dh_res, lambda t, n, d: (t, n, n), _F32),
    )


def run(
    config: Config,
    x,
    dlayer_in,
    dx_partial,
    dh,
    weight,
    scale,
    bias,
    table_t,
    *,
    tile: int,
    interpret,
    mode: PreApply = PreApply.OWN_GATES,
    carried=None,
    cores: int | None = None,
    partials=None,
    slices: int = 1,
    projection=None,
):
    """The pallas_call for x [T, n, D] (T > 0), shared by the pre, V4.1's carried pre and head
    backwards: returns dx [T, n, D], dcarried [T, n] (None but for a carried mix) and the
    accumulators (gram (rows, n Dp), dbias (rows), dalpha (rows)), summed over the cores in core
    order (`cores`: the TensorCores to split the token tiles over, _layout.CoreSplit; default the
    traced device's). dx_partial and dh None for the head; dh [token tiles, (1 + n) G, tile]
    (_layout.tokens_in_lanes), with dH_pre's group in front ((2 + n) G rows) for V4.1; table_t
    None but for permutations. mode: the pre-apply's mix, OWN_GATES (V4), V4.1's ONE_HOT on stream
    0, or CARRIED with `carried` the carried mix [token tiles, G, tile]. The split form's finish
    (pre_backward_finish): partials [token tiles, rows + 8, tile] (tokens in the lanes) and
    `slices`, the devices D is split over; dh then has dH_pre's group in front for V4 too, and no
    dcarried comes out. projection: the streamed projection operand of the same weight
    (_pre.stacked_weight_terms), required unless partials are given."""
    t, n, d = x.shape
    padded = _layout.padded_features(d)
    chunk = _layout.feature_chunk(padded)
    rows, g = weight.shape[0], _layout.group_rows(n)
    gates_only = dh is None
    size = x.dtype.itemsize
    # The head's backward has no dh; V4.1's carried pre backward a carried mix.
    operation = (
        "head_backward" if gates_only else ("pre_backward" if mode is PreApply.OWN_GATES else "pre_backward_carried")
    )
    finish = partials is not None
    if finish:
        operation = "pre_backward_finish" + ("" if mode is PreApply.OWN_GATES else "_carried")
    split = _layout.CoreSplit.plan(operation, t, tile, padded // chunk, cores)
    whole = lambda *step: (0, 0)  # noqa: E731
    # The parameters' blocks never change: fetched once, single-buffered.
    once = pl.Buffered(buffer_count=1)
    streams = pl.BlockSpec((tile, n, chunk), lambda *step: _chunk_stream_block(split, *step))
    operands = [_layout.pad_features(dlayer_in, padded)]
    in_specs = [pl.BlockSpec((tile, padded), lambda *step: (split.tile_block(*step), 0))]
    if not gates_only:
        operands += [_layout.pad_features(dx_partial, padded), dh]
        in_specs += [streams, pl.BlockSpec((None, dh.shape[1], tile), lambda *step: (split.tile_block(*step), 0, 0))]
    operands += [_layout.pad_features(x, padded), weight, scale, bias]
    in_specs += [
        pl.BlockSpec((tile, n, padded), lambda *step: (split.tile_block(*step), 0, 0)),
        pl.BlockSpec(weight.shape, whole, pipeline_mode=once),
        pl.BlockSpec((rows, 1), whole, pipeline_mode=once),
        pl.BlockSpec((rows, 1), whole, pipeline_mode=once),
    ]
    if not finish:
        operands.append(projection)
        in_specs.append(pl.BlockSpec(projection.shape, whole, pipeline_mode=once))
    if table_t is not None:
        operands.append(table_t)
        in_specs.append(pl.BlockSpec(table_t.shape, whole, pipeline_mode=once))
    with_carried = mode is PreApply.CARRIED
    per_tile = pl.BlockSpec((None, g, tile), lambda *step: (split.tile_block(*step), 0, 0))
    if with_carried:
        operands.append(carried)
        in_specs.append(per_tile)
    if finish:
        operands.append(partials)
        in_specs.append(
            pl.BlockSpec((None, rows + _layout.SUBLANES, tile), lambda *step: (split.tile_block(*step), 0, 0))
        )
    with_dcarried = with_carried and not finish
    scratch = []
    sinkhorn = not gates_only and config.mix == "sinkhorn"
    if sinkhorn:
        scratch.append(pltpu.VMEM((2 * config.sinkhorn_iters, n * g, tile), _F32))
    scratch.append(pltpu.VMEM((tile, rows + g + _TOKEN_SCALARS), _F32))

    def kernel(*refs):
        refs = list(refs)
        dli_ref = refs.pop(0)
        dx_partial_ref, dh_ref = (None, None) if gates_only else (refs.pop(0), refs.pop(0))
        x_ref, weight_ref, scale_ref, bias_ref = refs[:4]
        refs = refs[4:]
        projection_ref = None if finish else refs.pop(0)
        table_t_ref = refs.pop(0) if table_t is not None else None
        carried_ref = refs.pop(0) if with_carried else None
        partials_ref = refs.pop(0) if finish else None
        dx_ref, gram_ref, dbias_ref, dalpha_ref = refs[:4]
        refs = refs[4:]
        dcarried_ref = refs.pop(0) if with_dcarried else None
        steps_ref = refs.pop(0) if sinkhorn else None
        (columns_ref,) = refs
        split.when_holding_a_tile(
            lambda: backward_body(
                dli_ref,
                dx_partial_ref,
                dh_ref,
                x_ref,
                weight_ref,
                scale_ref,
                bias_ref,
                table_t_ref,
                dx_ref,
                gram_ref,
                dbias_ref,
                dalpha_ref,
                steps_ref,
                columns_ref,
                config=config,
                features=d * slices,
                tokens=t,
                split=split,
                mode=mode,
                carried_ref=carried_ref,
                dcarried_ref=dcarried_ref,
                given_dh_pre=True if finish else None,
                partials_ref=partials_ref,
                projection_ref=projection_ref,
            )
        )

    iterations = 2 * config.sinkhorn_iters if sinkhorn else 1
    # Spec, Minimum memory traffic: backward pre reads x, dx_partial, dli and writes dx, (3n+1) D e
    # per token (the head: (2n+1) D e); plus the coefficient cotangents and the parameters.
    streams_moved = (2 if gates_only else 3) * n + 1
    cost = pl.CostEstimate(
        flops=int(t * (4 * n * padded * (2 * rows + _layout.SUBLANES) + 12 * iterations * n * g)),
        transcendentals=int(t * (2 * rows + 1)),
        bytes_accessed=int(
            t * streams_moved * padded * size
            + (0 if gates_only else t * (n + n * n) * 4)
            + 2 * rows * (n * padded + 2) * 4
        ),
    )
    out_specs = [streams, *accumulator_specs(split, weight.shape, rows)]
    out_shape = [jax.ShapeDtypeStruct((t, n, padded), x.dtype), *accumulator_shapes(split, weight.shape, rows)]
    if with_dcarried:
        out_specs.append(per_tile)
        out_shape.append(jax.ShapeDtypeStruct(carried.shape, _F32))
    dx, gram, dbias, dalpha, *dcarried = pl.pallas_call(
        kernel,
        grid=split.grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        name=_layout.kernel_name(operation, tile),
        # The cores in parallel; each core's tiles and the chunks sequential: the parameter
        # gradients accumulate over a core's tiles in order.
        compiler_params=_layout.compiler_params(*split.dimension_semantics),
        cost_estimate=cost,
        interpret=interpret if interpret is not None else False,
    )(*operands)
    # dcarried: [token tiles, G, tile] -> [T, n].
    dcarried = _layout.tokens_from_lanes(dcarried[0], t, n) if with_dcarried else None
    gram, dbias, dalpha = (_layout.sum_over_cores(partials) for partials in (gram, dbias, dalpha))
    return dx[:, :, :d], dcarried, gram, dbias[:, 0], dalpha[:, 0]


def _chunk_stream_block(split: _layout.CoreSplit, *step):
    """The index map of a [tile, n, chunk] block."""
    token_tile, chunk = split.chunk_block(*step)
    return token_tile, 0, chunk


def accumulator_specs(split: _layout.CoreSplit, weight_shape, rows: int):
    """BlockSpecs of the parameter-gradient accumulators (gram of the weight's shape, dbias and
    dalpha (rows, 1)): one block per core (its first axis squeezed), resident over its steps."""
    return [
        pl.BlockSpec((None, *shape), lambda *step: (split.core_block(*step), 0, 0))
        for shape in (weight_shape, (rows, 1), (rows, 1))
    ]


def accumulator_shapes(split: _layout.CoreSplit, weight_shape, rows: int):
    """The accumulators' f32 outputs: [cores, ...] partial sums (_layout.sum_over_cores)."""
    return [jax.ShapeDtypeStruct((split.cores, *shape), _F32) for shape in (weight_shape, (rows, 1), (rows, 1))]


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret", "cores"))
def pre_backward(
    config: Config,
    dlayer_in,
    dx_partial,
    dh_post,
    dh_res,
    x,
    params: Params,
    *,
    tile: int | None = None,
    interpret=None,
    cores: int | None = None,
):
    """(dx [T, n, D] x's dtype, dnorm_weight [n D], dphi [n D, N], dalpha [3], dbias [N] f32): the
    contract of mhc.jax's pre_backward kernel (operands in its order; dlayer_in [T, D] and
    dx_partial [T, n, D] in x's dtype, dh_post [T, n] and dh_res [T, n, n] f32, Params in the
    kernels' layout). `tile`, `interpret`: as mhc.tpu.pre_forward. `cores`: the TensorCores the
    token tiles are split over (default: the device's, _layout.tensor_cores; docs/tpu.md)."""
    _check("mhc.tpu.pre_backward", config, _v4_cotangents(dlayer_in, dx_partial, dh_post, dh_res), x, params, tile)
    dx, _, *grads = _backward(
        config, dlayer_in, dx_partial, None, dh_post, dh_res, x, PreApply.OWN_GATES, params, tile, interpret, cores
    )
    return (dx, *grads)


@functools.partial(jax.jit, static_argnames=("config", "tile", "interpret", "cores"))
def pre_backward_carried(
    config: Config,
    dlayer_in,
    dx_partial,
    dh_pre,
    dh_post,
    dh_res,
    x,
    carried,
    params: Params,
    *,
    tile: int | None = None,
    interpret=None,
    cores: int | None = None,
):
    """DeepSeek-V4.1's pre backward (spec: Single-pass schedule): (dx [T, n, D] x's dtype, dcarried
    [T, n] or [T, 0], dnorm_weight, dphi, dalpha, dbias f32), the contract of the
    mhc_pre_backward_carried target. As pre_backward, but dh_pre [T, n] f32 (the cotangent of this
    sublayer's own h_pre) enters the gate backward as given, dx's pre-apply term takes the carried
    mix (f32 [T, n], or [T, 0] for the one-hot on stream 0), and dcarried = sum_d x dlayer_in
    ([T, 0] for the one-hot)."""
    operation = "mhc.tpu.pre_backward_carried"
    cotangents = _v4_cotangents(dlayer_in, dx_partial, dh_post, dh_res)
    _check(operation, config, (*cotangents, ("dh_pre", dh_pre, lambda t, n, d: (t, n), _F32)), x, params, tile)
    _pre.check_carried(operation, carried, *x.shape[:2])
    mode = _pre.carried_mode(carried)
    dx, dcarried, *grads = _backward(
        config, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, mode, params, tile, interpret, cores, carried=carried
    )
    # The target's contract: the one-hot's (absent) cotangent in the [T, 0] form of its carried.
    return (dx, jnp.zeros((x.shape[0], 0), _F32) if mode is PreApply.ONE_HOT else dcarried, *grads)


def coefficient_cotangents(config: Config, dh_pre, dh_post, dh_res, tile: int):
    """The kernel's dh operand [token tiles, rows, tile] (_layout.tokens_in_lanes): dH_post at rows
    0..n, row i of dH_res at (1 + i) G: the coefficient rows past h_pre, (1 + n) G rows; with V4.1's
    dH_pre (not None) in a group in front, (2 + n) G rows."""
    t, n, g = dh_post.shape[0], config.n, _layout.group_rows(config.n)
    rows = list(range(n)) + [(1 + i) * g + j for i in range(n) for j in range(n)]
    columns = [dh_post, dh_res.reshape(t, n * n)]
    if dh_pre is not None:
        rows = list(range(n)) + [g + row for row in rows]
        columns = [dh_pre, *columns]
    return _layout.tokens_in_lanes(jnp.concatenate(columns, axis=1), rows, (len(columns) - 1 + n) * g, tile)


def _backward(
    config: Config,
    dlayer_in,
    dx_partial,
    dh_pre,
    dh_post,
    dh_res,
    x,
    mode: PreApply,
    params,
    tile,
    interpret,
    cores,
    *,
    carried=None,
    partials=None,
    slices: int = 1,
):
    """The pre backward for checked operands: (dx, dcarried or None, *parameter grads). mode:
    OWN_GATES (V4: dh_pre None, computed in the kernel), ONE_HOT, or CARRIED with `carried` the
    mix [T, n] f32 (unread in the other modes). partials: None, or the split form's finish (the
    all-reduced partials [T, N + 1] and dh_pre given, D split over `slices` devices; no dcarried)."""
    t, n, d = x.shape
    if t == 0:
        dcarried = jnp.zeros((0, n), _F32) if mode is PreApply.CARRIED else None
        return (jnp.zeros(x.shape, x.dtype), dcarried) + tuple(jnp.zeros(np.shape(p), _F32) for p in params)
    own_gates = mode is PreApply.OWN_GATES
    rows = _layout.logit_rows(n, config.mix)
    if tile is None:
        operation = "pre_backward" if own_gates else "pre_backward_carried"
        tile = backward_tile(
            config,
            d,
            x.dtype,
            rows=rows,
            gates_only=False,
            operation=operation,
            carried=dh_pre is not None,
            partials=partials is not None,
        )
    padded = _layout.padded_features(d)
    weight, scale, bias = _pre._transposed_weight(config, params, d, padded)
    dh = coefficient_cotangents(config, dh_pre, dh_post, dh_res, tile)
    table_t = jnp.asarray(_pre._permutation_table(n).T) if config.mix == "permutations" else None
    if mode is PreApply.CARRIED:
        carried = _pre.carried_lanes(config, carried, tile)
    if partials is not None:
        partials = _pre.partials_lanes(config, partials, tile)
    dx, dcarried, gram, dbias_rows, dalpha_rows = run(
        config,
        x,
        dlayer_in,
        dx_partial,
        dh,
        weight,
        scale,
        bias,
        table_t,
        tile=tile,
        interpret=interpret,
        mode=mode,
        carried=carried,
        cores=cores,
        partials=partials,
        slices=slices,
        projection=None if partials is not None else _pre.stacked_projection(config, params, d, padded),
    )
    return (dx, dcarried, *parameter_grads(config, params, gram, dbias_rows, dalpha_rows, d))


def parameter_grads(config: Config, params: Params, gram, dbias_rows, dalpha_rows, d: int):
    """(dnorm_weight, dphi, dalpha, dbias) from the backward kernel's accumulators, which are kept
    in the transposed weight's rows (spec: Backward, Projection and Scales and biases); shared by
    pre_backward and the fused boundary backward."""
    n, padded = config.n, _layout.padded_features(d)
    row_of_column = _pre._destinations(config)  # the transposed weight's row of each column c
    # gram[row of c, k Dp + d] = sum_t dP[t, c] x[t, k, d]: back to [n D, N] without the padding.
    projection_grad = gram[row_of_column].reshape(-1, n, padded)[:, :, :d].reshape(-1, n * d).T
    norm_weight, phi = jnp.asarray(params.norm_weight, _F32), jnp.asarray(params.phi, _F32)
    dalpha_columns = dalpha_rows[row_of_column]
    dalpha = jnp.stack(
        [jnp.sum(dalpha_columns[:n]), jnp.sum(dalpha_columns[n : 2 * n]), jnp.sum(dalpha_columns[2 * n :])]
    )
    return (
        jnp.sum(phi * projection_grad, axis=1),
        norm_weight[:, None] * projection_grad,
        dalpha,
        dbias_rows[row_of_column],
    )

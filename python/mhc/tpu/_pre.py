"""The pre forward as one Pallas TPU kernel per token tile (unverified on TPU hardware: checked in
TPU interpret mode, by lowering to Mosaic and by compiling for v5e/v6e, never run on a chip).

Per tile, x is read from HBM once: the projection (the MXU, x streamed against the weight's
three bf16 terms: full f32 accuracy) and the sum of squares (the VPU) stream over it chunk by
chunk (streamed_projection), the coefficients follow with the tokens in the lanes (spec: Forward
steps 1-5), and the pre-apply re-reads the tile from VMEM window by window (streamed_pre_apply).
No (tile, Dp) f32 value is live (docs/tpu.md, "The pre forward streamed through the features").
The backwards recompute the coefficients with the same streamed_sums (_pre_backward).

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
from jax.experimental.pallas import tpu as pltpu

from mhc._config import Config, Params, PreApply
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


def _projection_chunk(padded: int) -> int:
    """Lanes of x the streamed projection takes per loop step: 256 (a full contraction depth of
    v6e's 256 x 256 MXU, two of v5e's 128) where Dp allows, else 128."""
    return 2 * _layout.LANES if padded % (2 * _layout.LANES) == 0 else _layout.LANES


def _rows_view(n: int, dtype) -> bool:
    """Whether the projection reads x's block [tile, n, chunk] as one (tile n, chunk) matrix (a row
    per token and stream): for bf16 at n = 4 the block's VMEM tiles hold exactly that matrix, so
    the view costs no relayout, and one MXU product per chunk covers every stream. Otherwise (f32,
    other n) each stream x[:, k, :] is its own product."""
    return jnp.dtype(dtype) == jnp.bfloat16 and n == 4


# Tokens per MXU product of the rows view: their products (4 rows per token, 128 lanes, f32: 32
# vregs) are what the contraction's partial sums pop into (32 and 128 were tried: no better on
# v5e, worse on v6e; docs/tpu.md).
_PROJECTION_TOKENS = 64
# The bf16 terms of the projection weight (hi, mid, lo: together its 24 bits), stacked along the
# contraction of each chunk (stacked_projection).
_WEIGHT_TERMS = 3


def _exact_dot(a, terms):
    """a (rows, K) times the weight chunk (K, cols) -> (rows, cols) f32 at full f32 accuracy (spec:
    Precision policy), from `terms` (3 K, cols) bf16: the weight's hi, mid and lo terms stacked.
    bf16 a: one MXU product of [a a a] with the stacked terms (exact products, f32 accumulation
    over the 3 K), a third of the passes of precision=HIGHEST, which also splits a. f32 a: the
    weight rebuilt in f32 (hi + (mid + lo)), times a at HIGHEST."""
    if a.dtype == jnp.bfloat16:
        return jnp.dot(jnp.concatenate([a] * _WEIGHT_TERMS, axis=1), terms, preferred_element_type=_F32)
    k = a.shape[1]
    hi, mid, lo = (terms[i * k : (i + 1) * k].astype(_F32) for i in range(_WEIGHT_TERMS))
    return jnp.dot(a, hi + (mid + lo), precision=_HIGHEST, preferred_element_type=_F32)


def _lane_folded_squares(values):
    """(rows, k 128) -> (rows, 128) f32: the squares summed over the 128-lane groups (the VPU; the
    sum over the last 128 lanes waits for the end of the stream)."""
    squares = jnp.square(values.astype(_F32))
    groups = [squares[:, i * _layout.LANES : (i + 1) * _layout.LANES] for i in range(values.shape[1] // _layout.LANES)]
    return functools.reduce(jnp.add, groups)


def streamed_projection(x_ref, projection_ref, *, n: int, features: int, rms_eps: float):
    """(P (rows, tile), r (1, tile)) for the token tile x_ref [tile, n, Dp] (spec: Forward steps
    1-2): streamed_sums, then the RMS factor over the true n D = n `features`."""
    logits, squares = streamed_sums(x_ref, projection_ref, n=n)
    return logits, inverse_rms(squares, n * features, rms_eps)


def inverse_rms(squares, elements: int, rms_eps: float):
    """r (1, tile) from the sum of squares (1, tile) over `elements` = n D values per token."""
    return jax.lax.rsqrt(squares / elements + rms_eps)


def streamed_sums(x_ref, projection_ref, *, n: int):
    """(P (rows, tile), sum of squares (1, tile)) for the token tile x_ref [tile, n, Dp] (spec: Forward steps
    1-2) from the stacked projection operand (stacked_weight_terms: the weight [Dp, n N], the
    columns of stream k at k N, as three bf16 terms per chunk, then the selection). A loop over
    chunks of Dp (and, in the rows view, groups of _PROJECTION_TOKENS tokens) streams x through
    the MXU once (x the streamed operand, the weight chunk stationary) and the VPU's sum of
    squares, both accumulated in VMEM, so no (tile, Dp) f32 value is live; after it the
    selection, one f32-exact product with the tokens in the lanes, keeps stream k's block of the
    products, sums over the streams and puts each projection column on its group-aligned row. The
    f32 sums run over the chunks in order, then over the 128 lanes and the streams."""
    tile, padded = x_ref.shape[0], x_ref.shape[2]
    width = projection_ref.shape[1]
    columns = width // n
    chunk = _projection_chunk(padded)
    rows_view = _rows_view(n, x_ref.dtype)
    group = min(_PROJECTION_TOKENS, tile)
    groups = tile // group
    product_shape = (tile * n, width) if rows_view else (n, tile, width)
    square_shape = (tile * n, _layout.LANES) if rows_view else (tile, _layout.LANES)

    def accumulate(products_ref, squares_ref):
        products_ref[...] = jnp.zeros(product_shape, _F32)
        squares_ref[...] = jnp.zeros(square_shape, _F32)

        def step(c, carry):
            lanes = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
            terms = _WEIGHT_TERMS * chunk
            weight = projection_ref[pl.ds(pl.multiple_of(c * terms, terms), terms), :]
            for k in range(n):
                stream = x_ref[:, k, lanes]
                products_ref[k] += _exact_dot(stream, weight)
                squares_ref[...] += _lane_folded_squares(stream)
            return carry

        def rows_step(i, carry):
            # one loop over (chunk, token group) pairs, not two nested (libtpu's schedule of the
            # nested pair hides the outer trip count from the estimate)
            # (shifts and masks: Mosaic lowers integer division only for a known chip; the tiles and
            # the group are powers of 2)
            c = i >> (groups.bit_length() - 1)
            first = pl.multiple_of((i & (groups - 1)) * group, group)
            lanes = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
            terms = _WEIGHT_TERMS * chunk
            weight = projection_ref[pl.ds(pl.multiple_of(c * terms, terms), terms), :]
            block = x_ref[pl.ds(first, group), :, lanes].reshape(group * n, chunk)
            rows = pl.ds(pl.multiple_of(first * n, group * n), group * n)
            products_ref[rows, :] += _exact_dot(block, weight)
            squares_ref[rows, :] += _lane_folded_squares(block)
            return carry

        if rows_view:
            jax.lax.fori_loop(0, padded // chunk * groups, rows_step, 0, unroll=2)
        else:
            jax.lax.fori_loop(0, padded // chunk, step, 0)
        if rows_view:
            parts = [products_ref[pl.ds(k, tile, stride=n), :] for k in range(n)]
            squares = functools.reduce(jnp.add, [squares_ref[pl.ds(k, tile, stride=n), :] for k in range(n)])
        else:
            parts = [products_ref[k] for k in range(n)]
            squares = squares_ref[...]
        lane = jax.lax.broadcasted_iota(jnp.int32, (tile, width), 1)
        own = parts[0]
        for k in range(1, n):
            own = jnp.where(lane >= k * columns, parts[k], own)
        selection = projection_ref[_WEIGHT_TERMS * padded :, :].astype(_F32)
        logits = jax.lax.dot_general(selection, own, _CONTRACT_LANES, precision=_HIGHEST, preferred_element_type=_F32)
        ones = jnp.ones((_layout.SUBLANES, _layout.LANES), _F32)
        sums = jax.lax.dot_general(ones, squares, _CONTRACT_LANES, precision=_HIGHEST, preferred_element_type=_F32)
        return logits, sums[0:1]

    return pl.run_scoped(accumulate, pltpu.VMEM(product_shape, _F32), pltpu.VMEM(square_shape, _F32))


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


def _mix_streams(gates, streams):
    """sum_k gates[k] streams[k] in f32, k in order (the gates broadcast over the lanes)."""
    layer_in = gates[0] * streams[0]
    for k in range(1, len(streams)):
        layer_in += gates[k] * streams[k]
    return layer_in


def _mix_window(gates, x_ref, n: int, tokens, lanes):
    """sum_k gates[:, k] x_k over the tokens and lanes of x_ref [tile, n, Dp], in f32, k in order."""
    columns = [gates[:, k : k + 1] for k in range(n)]
    return _mix_streams(columns, [x_ref[tokens, k, lanes].astype(_F32) for k in range(n)])


def pre_apply(h_pre, x_ref, n: int):
    """layer_in (tile, Dp) f32 = sum_k H_pre[k] x_k (spec: Forward step 6) from the pre-apply
    weights (G, tile) (the gates, or V4.1's carried mix), brought back to the tokens-in-sublanes
    layout by one transpose, and the tile in VMEM. h_pre None: V4.1's one-hot on stream 0, x_0
    itself."""
    if h_pre is None:
        return x_ref[:, 0, :].astype(_F32)
    return _mix_window(h_pre.T, x_ref, n, slice(None), slice(None))


# streamed_pre_apply's window: tokens (sublanes) by lanes, a few vregs per stream.
_APPLY_TOKENS = 32
_APPLY_LANES = 256
# The bf16 n = 4 window: 16 tokens (one packed bf16 vreg of layer_in) by 128 lanes.
_PAIRS_TOKENS = 16
_HIGH_HALF = 0xFFFF0000


def _pairs_streams(x_ref, pairs_ref, tokens, lanes, rows: int):
    """The 4 streams (rows, 128) f32, tokens in the sublanes, of a bf16 x block at n = 4 without a
    relayout: `rows` tokens by 128 lanes of the block are, as 32-bit words, a dense (2 rows, 128)
    value (_post's _bf16_pairs_forward_kernel): word row 2 t holds streams 0 (low half) and 1
    (high half) of token t, row 2 t + 1 streams 2 and 3. Stored once to pairs_ref, they come back
    by two sublane-strided loads with the tokens in order; a shift or a mask makes each half an f32
    (exact)."""
    pairs_ref[...] = pltpu.bitcast(x_ref[tokens, :, lanes].reshape(4 * rows, _layout.LANES), jnp.uint32)
    streams = []
    for first in (0, 1):
        words = pairs_ref[pl.ds(first, rows, stride=2), :]
        streams += [pltpu.bitcast(words << 16, _F32), pltpu.bitcast(words & jnp.uint32(_HIGH_HALF), _F32)]
    return streams


def streamed_pre_apply(layer_in_ref, h_pre, x_ref, n: int):
    """layer_in_ref [tile, Dp] = pre_apply(h_pre, x_ref, n) in x's dtype, the same products and
    sums (the same bits), window by window (a loop over the tokens, the lanes unrolled) so that no
    (tile, Dp) f32 value is live; the gates, transposed once, wait in VMEM. bf16 at n = 4 reads
    the streams by _pairs_streams (no relayout per stream)."""
    tile, padded = x_ref.shape[0], x_ref.shape[2]
    pairs = _rows_view(n, x_ref.dtype)
    rows = min(_PAIRS_TOKENS if pairs else _APPLY_TOKENS, tile)
    width = _APPLY_LANES if padded % _APPLY_LANES == 0 and not pairs else _layout.LANES

    def windows(gates_ref, pairs_ref):
        def window(i, carry):
            tokens = pl.ds(pl.multiple_of(i * rows, rows), rows)
            gates = None if gates_ref is None else gates_ref[tokens, :]
            if pairs and gates is not None:
                columns = [jnp.broadcast_to(gates[:, k : k + 1], (rows, width)) for k in range(n)]
            for c in range(padded // width):
                lanes = pl.ds(c * width, width)
                if gates is None:
                    value = x_ref[tokens, 0, lanes]
                elif pairs:
                    value = _mix_streams(columns, _pairs_streams(x_ref, pairs_ref, tokens, lanes, rows))
                else:
                    value = _mix_window(gates, x_ref, n, tokens, lanes)
                layer_in_ref[tokens, lanes] = value.astype(layer_in_ref.dtype)
            return carry

        jax.lax.fori_loop(0, tile // rows, window, 0)

    if h_pre is None:
        windows(None, None)
        return

    def with_gates(gates_ref, pairs_ref):
        gates_ref[...] = h_pre.T
        windows(gates_ref, pairs_ref)

    pl.run_scoped(
        with_gates, pltpu.VMEM((tile, h_pre.shape[0]), _F32), pltpu.VMEM((2 * rows, _layout.LANES), jnp.uint32)
    )


def carried_mode(carried) -> PreApply:
    """The mode of a checked carried operand of the *_carried kernels, whose contract (the FFI
    targets') marks the one-hot on stream 0 by a [T, 0] carried: the one place this backend reads
    that form; everything below the entry points takes the PreApply."""
    return PreApply.ONE_HOT if carried.shape[1] == 0 else PreApply.CARRIED


def pop_carried_ref(mode: PreApply, refs: list):
    """In a kernel: the carried mix's (G, tile) block, which follows x among its refs for
    PreApply.CARRIED (popped from refs); None for the other modes."""
    return refs.pop(0) if mode is PreApply.CARRIED else None


def empty_forward(x):
    """pre_forward's outputs (layer_in, h_pre, h_post, h_res) for x [0, n, D]: no grid to run."""
    _, n, d = x.shape
    return (jnp.zeros((0, d), x.dtype), jnp.zeros((0, n), _F32), jnp.zeros((0, n), _F32), jnp.zeros((0, n, n), _F32))


def pre_body(
    x_ref,
    parameter_refs,
    layer_in_ref,
    coefficients_ref,
    *,
    config,
    features,
    mode: PreApply = PreApply.OWN_GATES,
    carried_ref=None,
):
    """Spec: Forward steps 1-6 for one token tile of x_ref [tile, n, Dp] (an input block, or the
    boundary kernel's x_next output block, already in VMEM): layer_in_ref [tile, Dp] and
    coefficients_ref [coefficient rows, tile] (tokens in the lanes). parameter_refs: the weight,
    scale and bias refs, then the permutation table's (none for Sinkhorn). mode: the pre-apply's
    mix, OWN_GATES (V4: this tile's h_pre), or V4.1's (spec: Single-pass schedule) CARRIED mix,
    carried_ref, a (G, tile) ref with the tokens in the lanes, or its ONE_HOT on stream 0."""
    weight_ref, *finish_refs = parameter_refs
    # Steps 1-2.
    logits, r = streamed_projection(x_ref, weight_ref, n=config.n, features=features, rms_eps=config.rms_eps)
    finish_body(
        logits, r, x_ref, finish_refs, layer_in_ref, coefficients_ref, config=config, mode=mode, carried_ref=carried_ref
    )


def finish_body(
    logits,
    r,
    x_ref,
    finish_refs,
    layer_in_ref,
    coefficients_ref,
    *,
    config,
    mode: PreApply = PreApply.OWN_GATES,
    carried_ref=None,
):
    """Spec: Forward steps 3-6 for one token tile from its projection P (rows, tile) and RMS factor
    r (1, tile): pre_body after the projection, and the split form's finish (pre_forward_finish,
    where P and the sum of squares behind r are the all-reduced partials). finish_refs: the scale
    and bias refs, then the permutation table's (none for Sinkhorn); the rest as pre_body."""
    scale_ref, bias_ref, table_ref = (*finish_refs, None)[:3]
    n, g = config.n, _layout.group_rows(config.n)
    tile = x_ref.shape[0]
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
    mix = {
        PreApply.OWN_GATES: lambda: h_pre,
        PreApply.ONE_HOT: lambda: None,
        PreApply.CARRIED: lambda: carried_ref[...],
    }
    streamed_pre_apply(layer_in_ref, mix[mode](), x_ref, n)


def _kernel(*refs, config: Config, features: int, mode: PreApply):
    x_ref, *parameter_refs, layer_in_ref, coefficients_ref = refs
    carried_ref = pop_carried_ref(mode, parameter_refs)
    pre_body(
        x_ref,
        parameter_refs,
        layer_in_ref,
        coefficients_ref,
        config=config,
        features=features,
        mode=mode,
        carried_ref=carried_ref,
    )


def _transposed_weight(config: Config, params: Params, features: int, padded: int):
    """(norm_weight * phi)^T as [rows, n Dp]: each coefficient group on its own multiple of 8
    rows, the padded features zero. Also the per-row alpha and bias columns [rows, 1]."""
    n, width = config.n, config.projection_width
    folded = (params.norm_weight[:, None] * params.phi).reshape(n, features, width)
    folded = jnp.pad(folded, ((0, 0), (0, padded - features), (0, 0))).reshape(n * padded, width)
    rows = _layout.logit_rows(n, config.mix)
    weight = jnp.zeros((rows, n * padded), _F32).at[_destinations(config)].set(folded.T)
    return (weight, *scale_bias_columns(config, params.alpha, params.bias))


def scale_bias_columns(config: Config, alpha, bias):
    """The per-row alpha and bias columns [rows, 1] of the group-aligned logits (_destinations)."""
    n, width = config.n, config.projection_width
    rows = _layout.logit_rows(n, config.mix)
    destination = _destinations(config)
    group_alpha = jnp.concatenate(
        [jnp.full((n,), alpha[0]), jnp.full((n,), alpha[1]), jnp.full((width - 2 * n,), alpha[2])]
    )
    scale = jnp.zeros((rows, 1), _F32).at[destination, 0].set(group_alpha)
    return scale, jnp.zeros((rows, 1), _F32).at[destination, 0].set(bias)


def _destinations(config: Config) -> np.ndarray:
    """The group-aligned row of each projection column: pre k -> k, post k -> G + k, residual
    (i, j) -> (2 + i) G + j (Sinkhorn) or p -> 2 G + p (permutations)."""
    n, g = config.n, _layout.group_rows(config.n)
    if config.mix == "sinkhorn":
        residual = [(2 + i) * g + j for i in range(n) for j in range(n)]
    else:
        residual = [2 * g + p for p in range(config.residual_logits)]
    return np.asarray(list(range(n)) + [g + k for k in range(n)] + residual)


def stacked_projection(config: Config, params: Params, features: int, padded: int):
    """streamed_projection's operand for the pre forward (stacked_weight_terms): the folded weight
    norm_weight * phi, its columns on their coefficient rows (_destinations)."""
    n, width = config.n, config.projection_width
    folded = (params.norm_weight[:, None] * params.phi).reshape(n, features, width)
    return stacked_weight_terms(folded, padded, _destinations(config), _layout.logit_rows(n, config.mix))


def stacked_weight_terms(folded, padded: int, destinations, rows: int):
    """streamed_projection's operand [3 Dp + rows, n N] bf16 from a weight folded [n, D, N] (stream
    k's feature d, column c). The weight as [Dp, n N] (stream k's N columns at lanes k N, the
    padded features zero) split into three bf16 terms (hi, mid, lo: hi + mid + lo carries its 24
    bits, spec: Precision policy), stacked per chunk of the projection's loop: rows 3 c C ..
    3 (c + 1) C hold chunk c's hi, mid, lo (C = _projection_chunk). Then the selection (rows,
    n N): 1 at (destinations[c], k N + c) for every k."""
    n, features, width = folded.shape
    chunk = _projection_chunk(padded)
    folded = jnp.pad(jnp.asarray(folded, _F32), ((0, 0), (0, padded - features), (0, 0)))
    weight = jnp.transpose(folded, (1, 0, 2)).reshape(padded, n * width)
    hi = weight.astype(jnp.bfloat16)
    rest = weight - hi.astype(_F32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(_F32)).astype(jnp.bfloat16)
    terms = jnp.stack([t.reshape(padded // chunk, chunk, n * width) for t in (hi, mid, lo)], axis=1)
    selection = np.zeros((rows, n * width), np.float32)
    for k in range(n):
        selection[np.asarray(destinations), k * width + np.arange(width)] = 1.0
    return jnp.concatenate([terms.reshape(3 * padded, n * width), jnp.asarray(selection, jnp.bfloat16)], axis=0)


def stacked_bytes(n: int, width: int, padded: int, rows: int) -> int:
    """VMEM bytes of stacked_weight_terms' operand (bf16, lanes padded to 128)."""
    return (3 * padded + rows) * _layout.round_up(n * width, _layout.LANES) * 2


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
    """VMEM of the projection weight (the transposed (rows, n Dp) f32 or the stacked [3 Dp + rows,
    n N] bf16, whichever is larger), the alpha/bias columns, the permutation table and the sum-of-squares
    ones, each single-buffered (their block never changes)."""
    n, rows = config.n, _layout.logit_rows(config.n, config.mix)
    table = n * _layout.group_rows(n) * rows if config.mix == "permutations" else 0
    weight = max(rows * n * padded, stacked_bytes(n, config.projection_width, padded, rows) // 4)
    return (weight + 2 * rows * _layout.LANES + table + _layout.SUBLANES * padded) * 4


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
    """(operands, block specs) of the projection for a grid over token tiles: the stacked
    projection operand (stacked_projection), the alpha and bias columns and (permutations) the
    table, each one whole block fetched once (single-buffered: its index never changes)."""
    padded = _layout.padded_features(d)
    _, scale, bias = _transposed_weight(config, params, d, padded)
    operands = [stacked_projection(config, params, d, padded), scale, bias]
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
    return run(config, x, params, PreApply.OWN_GATES, tile=tile, interpret=interpret)


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
    return run(config, x, params, carried_mode(carried), carried, tile=tile, interpret=interpret)


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


def run(config: Config, x, params: Params, mode: PreApply, carried=None, *, tile: int | None, interpret):
    """pre_forward for checked operands; `carried`: with mode CARRIED, V4.1's carried mix [T, n]
    f32, which the pre-apply reads instead of h_pre (unread otherwise)."""
    t, n, d = x.shape
    tile = tile or token_tile(config, d, x.dtype, carried=mode is PreApply.CARRIED)
    if t == 0:
        return empty_forward(x)
    padded = _layout.padded_features(d)
    parameters, parameter_specs = parameter_operands(config, params, d)
    coefficient_spec, coefficient_shape = coefficient_output(config, t, tile)
    flops, transcendentals, coefficient_bytes = coefficient_cost(config, t, padded)
    operands = [_layout.pad_features(x, padded)]
    in_specs = [pl.BlockSpec((tile, n, padded), lambda i: (i, 0, 0))]
    if mode is PreApply.CARRIED:
        operands.append(carried_lanes(config, carried, tile))
        in_specs.append(pl.BlockSpec((None, _layout.group_rows(n), tile), lambda i: (i, 0, 0)))
    layer_in, coefficients = pl.pallas_call(
        functools.partial(_kernel, config=config, features=d, mode=mode),
        grid=(pl.cdiv(t, tile),),
        in_specs=[*in_specs, *parameter_specs],
        out_specs=[pl.BlockSpec((tile, padded), lambda i: (i, 0)), coefficient_spec],
        out_shape=[jax.ShapeDtypeStruct((t, padded), x.dtype), coefficient_shape],
        name=_layout.kernel_name("pre_forward" if mode is PreApply.OWN_GATES else "pre_forward_carried", tile),
        compiler_params=_layout.compiler_params("parallel"),
        # Spec: Minimum memory traffic, (n + 1) D e per token, plus the coefficients (and V4.1's
        # carried mix, 4 n bytes).
        cost_estimate=pl.CostEstimate(
            flops=int(flops),
            transcendentals=int(transcendentals),
            bytes_accessed=int(
                t * (n + 1) * padded * x.dtype.itemsize
                + coefficient_bytes
                + (t * n * 4 if mode is PreApply.CARRIED else 0)
            ),
        ),
        interpret=interpret if interpret is not None else False,
    )(*operands, *parameters)
    return (layer_in[:, :d], *split_coefficients(config, coefficients, t))


def partials_lanes(config: Config, partials, tile: int):
    """The split form's partials [T, N + 1] f32 (projection column c, then the sum of squares) as
    [token tiles, rows + 8, tile]: column c on its group-aligned logit row (_destinations), the sum
    of squares on row `rows` (rows = _layout.logit_rows), the tokens in the lanes."""
    rows = _layout.logit_rows(config.n, config.mix)
    row_of_column = [*_destinations(config), rows]
    return _layout.tokens_in_lanes(partials, row_of_column, rows + _layout.SUBLANES, tile)


def partials_from_lanes(config: Config, packed, t: int):
    """partials_lanes' inverse: [token tiles, rows + 8, tile] -> [T, N + 1]."""
    rows = _layout.logit_rows(config.n, config.mix)
    flat = jnp.transpose(packed, (0, 2, 1)).reshape(-1, packed.shape[1])[:t]
    return flat[:, np.asarray([*_destinations(config), rows])]

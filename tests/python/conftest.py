"""Shared helpers: random problems with non-trivial coefficients and the spec's error metric."""

import contextlib
import functools
import io
import os
import secrets
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
import numpy_reference
from mhc.jax import _kernels


@pytest.fixture
def seed(request):
    """A fresh seed per test (replay with MHC_TEST_SEED), printed when the test fails."""
    value = int(os.environ.get("MHC_TEST_SEED", secrets.randbits(31)))
    request.node.user_properties.append(("seed", value))
    print(f"seed {value}")
    return value


def random_params(key, config: mj.Config, d: int) -> mj.Params:
    """alpha of order 1 with mixed signs and a random bias, so the coefficients are not trivial."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    m = config.n * d
    sign = jnp.where(jax.random.uniform(k3, (3,)) < 0.3, -1.0, 1.0)
    return mj.Params(
        norm_weight=1.0 + 0.2 * jax.random.normal(k1, (m,), jnp.float32),
        phi=jax.random.normal(k2, (m, config.projection_width), jnp.float32) / np.sqrt(m),
        alpha=sign * jax.random.uniform(k3, (3,), jnp.float32, 0.5, 1.5),
        bias=jax.random.normal(k4, (config.projection_width,), jnp.float32),
    )


def random_numpy_params(rng: np.random.Generator, config: mj.Config, d: int) -> mj.Params:
    """random_params drawn with NumPy (f32 arrays): no JAX compilation for a new shape."""
    m, width = config.n * d, config.projection_width
    sign = np.where(rng.uniform(size=3) < 0.3, -1.0, 1.0)
    return mj.Params(
        norm_weight=(1.0 + 0.2 * rng.standard_normal(m)).astype(np.float32),
        phi=(rng.standard_normal((m, width)) / np.sqrt(m)).astype(np.float32),
        alpha=(sign * rng.uniform(0.5, 1.5, size=3)).astype(np.float32),
        bias=rng.standard_normal(width).astype(np.float32),
    )


def relative_error(got, want) -> float:
    """||got - want|| / ||want|| in float64; NaN if anything is NaN (so it never passes)."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    norm = np.linalg.norm(want)
    diff = np.linalg.norm(got - want)
    if not np.isfinite(diff) or not np.isfinite(np.linalg.norm(got)):
        return float("nan")
    return float(diff / norm) if norm > 0 else float(np.linalg.norm(got))


@functools.partial(jax.jit, static_argnames=("config", "use_kernel"))
def _sublayer_values(x, layer_out, params, cotangents, config: mj.Config, use_kernel: bool):
    def f(x, layer_out, params):
        layer_in, ctx = mj.pre(x, params, config, use_kernel=use_kernel)
        return layer_in, mj.post(layer_out, ctx)

    outputs, vjp = jax.vjp(f, x, layer_out, params)
    return outputs, vjp(cotangents)


def sublayer_values(x, layer_out, params, config: mj.Config, cotangents, use_kernel: bool = True) -> dict:
    """pre -> post under jit on the kernel (or plain) path: layer_in, out and the VJP at
    cotangents = (dlayer_in, dout) with respect to x, layer_out and every parameter, as one dict
    named like numpy_reference.values. One compiled function per config, path and shape."""
    (layer_in, out), (dx, dlayer_out, dparams) = _sublayer_values(
        x, layer_out, params, cotangents, config=config, use_kernel=use_kernel
    )
    return dict(zip(numpy_reference.NAMES, (layer_in, out, dx, dlayer_out, *dparams), strict=True))


def tanh_sublayer_values(x, params, config: mj.Config, shift, dout, dlayer_in, noise=None, rounding=None) -> dict:
    """pre -> post with the branch layer_out = tanh(layer_in) + shift in float64 (numpy_reference;
    bf16 inputs upcast exactly) and its VJP at the cotangents dout of out and dlayer_in of
    layer_in beside the branch's (arrays, or callables of out and of layer_in, for a loss such as
    sum(exp(layer_in / 4))): "out", "layer_in", "dx", "dparams", "dshift". noise: numpy_reference's.
    rounding: see bf16_rounding (a bf16 program that does its own math in f32)."""
    rounded = rounding or (lambda v: v)
    shift = np.asarray(shift, np.float64)
    zeros = np.zeros(np.shape(x)[:-2] + np.shape(x)[-1:])
    layer_in, _ = numpy_reference.forward(x, zeros, params, config, noise)
    seen = rounded(layer_in)
    layer_out = rounded(np.tanh(seen) + shift)
    _, out = numpy_reference.forward(x, layer_out, params, config, noise)
    g = rounded(dout(out) if callable(dout) else _f64(dout))
    direct = dlayer_in(seen) if callable(dlayer_in) else _f64(dlayer_in)
    _, dlayer_out, _ = numpy_reference.backward(x, layer_out, params, config, zeros, g)  # h_post g
    dlayer_out = rounded(dlayer_out)
    total = rounded(dlayer_out * (1.0 - np.tanh(seen) ** 2) + direct)
    dx, _, dparams = numpy_reference.backward(x, layer_out, params, config, total, g, noise)
    return dict(out=out, layer_in=layer_in, dx=dx, dparams=dparams, dshift=dlayer_out)


def bf16_rounding(value):
    """value in float64 rounded to bf16 (through f32, as a program's casts round it): the
    ``rounding=`` of the oracles (tanh_sublayer_values, chain_values) for a bf16 program whose own
    math between the mHC operations runs in f32, so that the program rounds only the tensors it
    passes between operations (layer_in as its branch reads it, the branch's output, the streams
    between sublayers, the cotangents reaching each operation). The oracle rounds the same ones and
    so holds each operation to the reference on the inputs it was given. Without it a parameter
    gradient over a few dozen tokens, a sum that cancels, moved by 1-4% on a few seeds in 100 through
    those roundings alone, which the spread rule (inputs moved by one f32 unit) does not see."""
    return np.asarray(jnp.asarray(np.asarray(value, np.float32), jnp.bfloat16).astype(jnp.float32), np.float64)


def head_loss_values(x, head, config: mj.Config, target, noise=None, output=None) -> dict:
    """DeepSeek-V4's head and the loss sum((head(x) - target)^2) in float64
    (numpy_reference.head_values): "out", "loss", "dx", "dhead" (HeadParams). noise: its noise=.
    output: the rounding of head(x) the loss sees (a bf16 head's output), none if None."""
    target = np.broadcast_to(np.asarray(target, np.float64), np.shape(x)[:-2] + np.shape(x)[-1:])
    y = numpy_reference.head_values(x, head, config, np.zeros(target.shape), noise)[0]
    y = y if output is None else output(y)
    _, dx, *dhead = numpy_reference.head_values(x, head, config, 2.0 * (y - target), noise)
    return dict(out=y, loss=np.sum(np.square(y - target)), dx=dx, dhead=mj.HeadParams(*dhead))


def saved_residuals(f, *args) -> list[str]:
    """What ``jax.grad`` of f keeps for its backward, one line per residual
    (``jax.ad_checkpoint.print_saved_residuals``, the public way to list them): its shape, its
    checkpoint name (``named 'mhc_x'``) or where it comes from (``from the argument x``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    return out.getvalue().splitlines()


# The one rule of every accuracy comparison, as in tests/cpp/test_util.h (expect_matches, where
# the multiple is justified): allowed relative error = max(the spec's bound, SPREAD_MULTIPLE x the
# reference's relative spread), the spread being the root mean square, over spread_draws(size)
# draws, of the distance by which the float64 oracle moves when its inputs, and the intermediates
# the kernels round to f32 and reuse (numpy_reference's noise=), move by one f32 unit at random.
SPREAD_MULTIPLE = 64
SPREAD_VALUES = 32


def spread_draws(elements: int) -> int:
    """At least two draws, and enough for SPREAD_VALUES values in all (test_util.h, spread_draws)."""
    return min(max(-(-SPREAD_VALUES // max(elements, 1)), 2), SPREAD_VALUES)


def assert_gradients_match_central_differences(loss, inputs, names, gradients, seed, unchecked=()):
    """Each analytic gradient (of loss(inputs) wrt inputs[i], float64) against central differences;
    the inputs named in ``unchecked`` (which loss does not read) are passed over."""
    for index, (name, analytic) in enumerate(zip(names, gradients, strict=True)):
        if name in unchecked:
            continue
        numeric = np.zeros_like(inputs[index])
        for k in np.ndindex(inputs[index].shape):
            saved = inputs[index][k]
            h = 1e-6 * max(1.0, abs(saved))
            inputs[index][k] = saved + h
            up = loss(inputs)
            inputs[index][k] = saved - h
            down = loss(inputs)
            inputs[index][k] = saved
            numeric[k] = (up - down) / (2 * h)
        error = np.linalg.norm(analytic - numeric) / np.linalg.norm(numeric)
        assert error <= 1e-6, f"d{name}: backward vs finite differences {error:.3g} (seed {seed})"


def assert_matches(name, got, want, tolerance, perturbed, context=""):
    """relative_error(got, want) within the rule above. `tolerance`: the spec's bound for got's
    dtype; perturbed(rng) returns the oracle's value of this tensor on inputs moved by
    round_by_one_unit(rng, ...) and with noise=rng. It runs only when the spec's bound fails (the
    rule's outcome is the same either way). NaN never passes."""
    error = relative_error(got, want)
    if error <= tolerance:
        return
    assert not np.isnan(error), f"{name}: NaN {context}"
    want64 = np.asarray(want, np.float64)
    norm = float(np.linalg.norm(want64))
    # Seeded by the name and context (which carries the test's seed), so MHC_TEST_SEED replays it.
    rng = np.random.default_rng(zlib.crc32(f"{name} {context}".encode()))
    draws = spread_draws(want64.size)
    squares = sum(float(np.sum((np.asarray(perturbed(rng), np.float64) - want64) ** 2)) for _ in range(draws))
    spread = np.sqrt(squares / draws)
    relative_spread = spread / norm if norm > 0 else spread
    allowed = max(tolerance, SPREAD_MULTIPLE * relative_spread)
    if os.environ.get("MHC_LOG_SPREAD"):
        print(
            f"spread {name} error={error:.3g} relative_spread={relative_spread:.3g} passed={error <= allowed} {context}"
        )
    assert error <= allowed, (
        f"{name}: relative error {error:.3g} > allowed {allowed:.3g} = max({tolerance}, "
        f"{SPREAD_MULTIPLE} x reference spread {relative_spread:.3g}) {context}"
    )


def _f64(value):
    return np.asarray(jnp.asarray(value, jnp.float32), np.float64)


def assert_mixed_in_f32_and_rounded_once(name, got, weights, streams, context=""):
    """The precision policy for a bf16 mix (spec: Accuracy), element by element: got [..., D]
    (bf16) = sum_k weights[..., k] streams[..., k, D], summed in f32 and rounded to bf16 once, is
    within half a bf16 ulp of got plus the f32 rounding of the sum, K 2^-24 sum_k |w_k s_k|
    (K terms), of the exact mix (float64, from the same inputs: pass the kernel's own f32
    coefficients where they are an input of the mix). Leading dims of weights and streams
    broadcast (the post's out: weights [T, n, n + 1] of the streams [T, 1, n + 1, D]). A norm at
    1e-2 cannot see a running sum kept in bf16; this can. NaN never passes."""
    assert got.dtype == jnp.bfloat16, f"{name}: the element-wise bf16 bound holds a bf16 output, got {got.dtype}"
    terms = _f64(weights)[..., None] * _f64(streams)
    exact = terms.sum(axis=-2)
    got64 = _f64(got)
    assert got64.shape == exact.shape, f"{name}: shape {got64.shape}, the mix's {exact.shape}"
    # bf16 keeps 8 significant bits: |v| in [2^(e-1), 2^e) has ulp 2^(e-8); the smallest
    # subnormal step is 2^-133 (got = 0 included).
    _, exponent = np.frexp(got64)
    half_ulp = 0.5 * np.exp2(np.maximum(np.where(got64 == 0, -np.inf, exponent - 8.0), -133.0))
    allowed = half_ulp + terms.shape[-2] * 2.0**-24 * np.abs(terms).sum(axis=-2)
    error = np.abs(got64 - exact)
    failing = ~(error <= allowed)  # NaN fails
    if failing.any():
        worst = np.unravel_index(np.argmax(np.where(failing, error / allowed, -1.0)), error.shape)
        raise AssertionError(
            f"{name}: {int(failing.sum())} of {failing.size} bf16 elements not mixed in f32 and rounded once: "
            f"at {tuple(int(i) for i in worst)} got {got64[worst]!r}, exact {exact[worst]!r}, "
            f"|error| {error[worst]:.3g} > allowed {allowed[worst]:.3g} {context}"
        )


def assert_post_mixed_in_f32_and_rounded_once(out, x, layer_out, h_post, h_res, context=""):
    """out_j = sum_i H_res[i, j] x_i + H_post[j] layer_out (spec: Forward step 8): n + 1 terms per
    output stream, held to the precision policy element by element."""
    h_post, h_res, x, layer_out = (_f64(a) for a in (h_post, h_res, x, layer_out))
    weights = np.concatenate([np.swapaxes(h_res, -1, -2), h_post[..., None]], axis=-1)  # [..., n (j), n + 1]
    streams = np.concatenate([x, layer_out[..., None, :]], axis=-2)[..., None, :, :]  # [..., 1, n + 1, D]
    assert_mixed_in_f32_and_rounded_once("out", out, weights, streams, context)


def assert_sublayer_matches_reference(got: dict, x, layer_out, params, config: mj.Config, cotangents, context=""):
    """Any of sublayer_values' tensors (a dict by numpy_reference.NAMES) against the float64
    oracle with the one rule: the spec's bound by the tensor's dtype (bf16 1e-2, f32 1e-5, every
    parameter gradient f32), or SPREAD_MULTIPLE x the oracle's spread."""
    want = numpy_reference.values(x, layer_out, params, config, *cotangents)

    def perturbed(name, rng):
        x_, lo_, params_, w_in, w_out = (round_by_one_unit(rng, v) for v in (x, layer_out, params, *cotangents))
        return numpy_reference.values(x_, lo_, params_, config, w_in, w_out, noise=rng)[name]

    for name, value in got.items():
        tolerance = 1e-2 if value.dtype == jnp.bfloat16 else 1e-5
        assert_matches(name, value, want[name], tolerance, lambda rng, name=name: perturbed(name, rng), context)


def assert_kernel_sublayer_mixes_rounded_once(x, layer_out, params, config: mj.Config, values: dict, context=""):
    """layer_in and out of a bf16 pre -> post on the CPU kernel path (values: sublayer_values')
    held to the precision policy element by element, with the kernels' own f32 coefficients (the
    mhc_pre_forward target on the same x: bitwise those the jitted sublayer used)."""
    n, d = x.shape[-2:]
    lead = x.shape[:-2]
    _, h_pre, h_post, h_res = _kernels.pre_forward(config, jnp.reshape(x, (-1, n, d)), params)
    assert_mixed_in_f32_and_rounded_once("layer_in", values["layer_in"], h_pre.reshape(*lead, n), x, context)
    h_post, h_res = h_post.reshape(*lead, n), h_res.reshape(*lead, n, n)
    assert_post_mixed_in_f32_and_rounded_once(values["out"], x, layer_out, h_post, h_res, context)


def chain_values(x, sublayers, dout, noise=None, updates=None, rounding=None):
    """A DeepSeek-V4 chain of sublayers in float64, the oracle of a JAX chain's f32 evaluations
    (each path against it with assert_matches, never two paths with each other): sublayers =
    [(params, config, branch)] or [(params, config, branch, branch_args)], branch(layer_in,
    *branch_args) -> layer_out a jnp function of the test's own, run in float64 (jax's x64 mode)
    with its VJP; pre and post from numpy_reference (noise: its noise=). Returns (out, dx, [dparams
    per sublayer], [the gradients of branch_args per sublayer]) for the cotangent dout of out (or
    dout(out) for a callable: a loss such as sum(sin(out)) has the cotangent cos(out)). updates:
    {sublayer index: an array added to the streams before that sublayer}, an Engram seam
    Streams(x + update, ...): the gradient passes it unchanged. rounding: see bf16_rounding."""
    rounded = rounding or (lambda v: v)
    streams = _f64(x)
    saved = []
    for index, (params, config, branch, *rest) in enumerate(sublayers):
        if index > 0:  # the previous sublayer's output streams, as this one reads them
            streams = rounded(streams)
        if updates and index in updates:
            streams = rounded(_add_update(streams, updates, index))
        branch_args = tuple(rest[0]) if rest else ()
        no_layer_out = np.zeros(streams.shape[:-2] + streams.shape[-1:])  # layer_in does not read it
        layer_in, _ = numpy_reference.forward(streams, no_layer_out, params, config, noise)
        with jax.enable_x64(True):
            branch_inputs = (jnp.asarray(_f64(a)) for a in (rounded(layer_in), *branch_args))
            layer_out, branch_vjp = jax.vjp(branch, *branch_inputs)
        layer_out = rounded(np.asarray(layer_out, np.float64))
        saved.append((streams, layer_out, branch_vjp, params, config))
        streams = numpy_reference.forward(streams, layer_out, params, config, noise)[1]
    g = dout(streams) if callable(dout) else _f64(dout)
    grads, branch_grads = [], []
    for before, layer_out, branch_vjp, params, config in reversed(saved):
        g = rounded(g)  # the streams' cotangent, as this sublayer's backward reads it
        # dlayer_out = sum_j h_post[j] g_j does not depend on dlayer_in: one backward for it, one
        # with dlayer_in from the branch's VJP.
        zero = np.zeros(layer_out.shape)
        _, dlayer_out, _ = numpy_reference.backward(before, layer_out, params, config, zero, g)
        with jax.enable_x64(True):
            dlayer_in, *dbranch_args = (np.asarray(a) for a in branch_vjp(jnp.asarray(rounded(dlayer_out))))
        g, _, dparams = numpy_reference.backward(before, layer_out, params, config, rounded(dlayer_in), g, noise)
        grads.append(dparams)
        branch_grads.append(dbranch_args)
    return streams, g, grads[::-1], branch_grads[::-1]


def _add_update(streams, updates, index):
    return streams + _f64(updates[index]) if updates and index in updates else streams


def carried_chain_values(x, sublayers, dout, noise=None, updates=None):
    """chain_values for DeepSeek-V4.1 (spec: Single-pass schedule): each pre-apply mixes with the
    previous sublayer's h_pre (the first with the one-hot on stream 0), and the chain ends in the
    collapse by the last h_pre; dout is the collapse's cotangent [..., D] (or a callable of out, as in
    chain_values). numpy_reference's
    carried_values and collapse_values, the branches and updates as in chain_values (the carried
    mix passes a seam unchanged)."""
    streams, carried, saved = _f64(x), None, []
    for index, (params, config, branch, *rest) in enumerate(sublayers):
        streams = _add_update(streams, updates, index)
        branch_args = tuple(rest[0]) if rest else ()
        zeros = np.zeros(streams.shape[:-2] + streams.shape[-1:])
        no_cotangents = (zeros, np.zeros(streams.shape[:-1]), np.zeros(streams.shape))
        values = numpy_reference.carried_values(streams, zeros, params, config, carried, *no_cotangents, noise)
        with jax.enable_x64(True):
            branch_inputs = (jnp.asarray(_f64(a)) for a in (values["layer_in"], *branch_args))
            layer_out, branch_vjp = jax.vjp(branch, *branch_inputs)
        layer_out = np.asarray(layer_out, np.float64)
        values = numpy_reference.carried_values(streams, layer_out, params, config, carried, *no_cotangents, noise)
        saved.append((streams, carried, layer_out, branch_vjp, params, config))
        streams, carried = values["out"], values["h_pre"]
    out = numpy_reference.collapse_values(streams, carried, np.zeros(streams.shape[:-2] + streams.shape[-1:]))[0]
    out, g, dh_pre = numpy_reference.collapse_values(streams, carried, dout(out) if callable(dout) else _f64(dout))
    grads, branch_grads = [], []
    for before, carried, layer_out, branch_vjp, params, config in reversed(saved):
        zero = np.zeros(layer_out.shape)  # dlayer_out does not depend on dlayer_in
        dlayer_out = numpy_reference.carried_values(before, layer_out, params, config, carried, zero, dh_pre, g)
        with jax.enable_x64(True):
            dlayer_in, *dbranch_args = (np.asarray(a) for a in branch_vjp(jnp.asarray(dlayer_out["dlayer_out"])))
        values = numpy_reference.carried_values(before, layer_out, params, config, carried, dlayer_in, dh_pre, g, noise)
        g, dh_pre = values["dx"], values["dcarried"]
        grads.append(tuple(values[name] for name in ("dnorm_weight", "dphi", "dalpha", "dbias")))
        branch_grads.append(dbranch_args)
    return out, g, grads[::-1], branch_grads[::-1]


def perturbed_chain_values(rng, x, sublayers, dout, updates=None, rounding=None):
    """chain_values on inputs, parameters, branch arguments and updates moved by
    round_by_one_unit(rng, ...) and with noise=rng: the spread that assert_matches' rule measures."""
    moved = [
        (round_by_one_unit(rng, params), config, branch, *([tuple(round_by_one_unit(rng, a) for a in r) for r in rest]))
        for params, config, branch, *rest in sublayers
    ]
    dout = dout if callable(dout) else round_by_one_unit(rng, dout)
    values = carried_chain_values if sublayers[0][1].pre_from_previous else chain_values
    moved_updates = {index: round_by_one_unit(rng, update) for index, update in (updates or {}).items()}
    rounded = {} if rounding is None else {"rounding": rounding}  # carried_chain_values takes none
    return values(round_by_one_unit(rng, x), moved, dout, noise=rng, updates=moved_updates, **rounded)


def assert_chain_matches(got, x, sublayers, dout, context="", updates=None):
    """A chain's f32 results against chain_values (V4) or carried_chain_values (V4.1, ending in the
    collapse) with the one accuracy rule (f32 bound 1e-5):
    got is a dict with any of "out", "dx", "dparams" (one Params per sublayer, any shapes that
    reshape to the flat layout), "dbranch" (one tuple per sublayer, as branch_args). updates: as
    in chain_values."""
    keys = ("out", "dx", "dparams", "dbranch")
    values = carried_chain_values if sublayers[0][1].pre_from_previous else chain_values
    want = dict(zip(keys, values(x, sublayers, dout, updates=updates), strict=True))

    def perturbed(rng, key, *index):
        value = perturbed_chain_values(rng, x, sublayers, dout, updates)[keys.index(key)]
        for i in index:
            value = value[i]
        return value

    for key, value in got.items():
        if key in ("out", "dx"):
            assert_matches(key, value, want[key], 1e-5, lambda rng, k=key: perturbed(rng, k), context)
            continue
        for layer, tensors in enumerate(value):
            for index, tensor in enumerate(tensors):
                expected = want[key][layer][index]
                name = f"{key}[{layer}][{index}]"
                tensor = jnp.reshape(tensor, np.shape(expected))
                resample = lambda rng, k=key, s=layer, i=index: perturbed(rng, k, s, i)  # noqa: E731
                assert_matches(name, tensor, expected, 1e-5, resample, context)


def round_by_one_unit(rng: np.random.Generator, value):
    """value (an array or a tuple of arrays, e.g. Params) in float64, each element scaled by
    1 + u with |u| <= 2^-24: a rounding of the inputs by up to one f32 unit."""
    if isinstance(value, tuple):
        return type(value)(*(round_by_one_unit(rng, v) for v in value))
    array = np.asarray(jnp.asarray(value, jnp.float32), np.float64)
    return array * (1.0 + rng.uniform(-(2.0**-24), 2.0**-24, array.shape))


def assert_recompute_keeps_the_mhc_bits(got_grads, want_grads, seed):
    """Recompute reruns mhc's kernels on the same inputs, so the gradients of every mHC parameter
    (the ``*_hc`` modules: sums the kernels take over all tokens, downstream of every recomputed
    stream) are the same bits. The model's own layers are XLA's, which may fuse and order its sums
    over tokens differently in the rematerialized program (seen on an AVX2-only EPYC: the MLP's
    bias gradient one ulp apart): the caller holds those, like every leaf, to the float64 model
    (model_reference.assert_model_gradients_match)."""
    assert [path for path, _ in got_grads] == [path for path, _ in want_grads]
    hc_leaves = [
        (path, got, want)
        for (path, got), (_, want) in zip(got_grads, want_grads, strict=True)
        if any(str(part).endswith("_hc") for part in path)
    ]
    assert hc_leaves, "no mHC parameter among the gradients"
    for path, got, want in hc_leaves:
        name = "/".join(map(str, path))
        assert np.array_equal(np.asarray(got[...]), np.asarray(want[...])), f"{name}: seed {seed}"

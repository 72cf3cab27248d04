"""DeepSeek-V4.1's single-pass schedule in JAX (spec: Single-pass schedule): pre with the carried
mix, collapse, the chain (sublayer/stack/streams/collapse) and its fused V4.1 boundary. Values and
gradients against the float64 NumPy oracle (itself pinned to central differences), the kernels
against the plain path, the fused boundary against the separate calls (same bits), the Engram
seam, recompute, T = 0, vmap, checkpoint names and the named errors. Tokens sharded over two
devices: carried_sharding_cases.py in a subprocess."""

import contextlib
import io
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
import numpy_reference
from conftest import (
    assert_chain_matches,
    assert_gradients_match_central_differences,
    assert_matches,
    random_params,
    relative_error,
    round_by_one_unit,
)
from mhc.jax import _kernels

F32, BF16 = jnp.float32, jnp.bfloat16
TOLERANCE = {F32: 1e-5, BF16: 1e-2}
PATHS = [pytest.param(True, id="kernel"), pytest.param(False, id="plain")]


def _config(n=4, mix="sinkhorn", sinkhorn_iters=4, **extra):
    """V4.1's config; 4 Sinkhorn iterations unless asked (the plain path's compile time grows with
    them; the kernels' 20 are checked against the oracle in test_pre_and_post_match...)."""
    return mj.Config(n=n, mix=mix, pre_from_previous=True, sinkhorn_iters=sinkhorn_iters, **extra)


def _random_carried(key, shape):
    """A carried mix as V4.1 makes one: sigmoid gates plus pre_eps, in (0, 1)."""
    return jax.nn.sigmoid(2.0 * jax.random.normal(key, shape, F32)) + 1e-6


def _sublayer_problem(seed, config, dtype, d, lead=(2, 3)):
    keys = jax.random.split(jax.random.key(seed), 7)
    n = config.n
    x = jax.random.normal(keys[0], (*lead, n, d), F32).astype(dtype)
    layer_out = jax.random.normal(keys[1], (*lead, d), F32).astype(dtype)
    params = random_params(keys[2], config, d)
    carried = _random_carried(keys[3], (*lead, n))
    dlayer_in = jax.random.normal(keys[4], (*lead, d), F32).astype(dtype)
    dh_pre = jax.random.normal(keys[5], (*lead, n), F32)
    dout = jax.random.normal(keys[6], (*lead, n, d), F32).astype(dtype)
    return x, layer_out, params, carried, (dlayer_in, dh_pre, dout)


def _sublayer_vjp(x, layer_out, params, carried, cotangents, config, use_kernel):
    """pre (carried) -> post under jit: (layer_in, ctx.h_pre, out) and the VJP wrt x, carried,
    layer_out and the parameters, as one dict by numpy_reference.CARRIED_NAMES."""

    def f(x, carried, layer_out, params):
        layer_in, ctx = mj.pre(x, params, config, carried=carried, use_kernel=use_kernel)
        return layer_in, ctx.h_pre, mj.post(layer_out, ctx)

    if carried is None:
        run = jax.jit(lambda x, lo, p, ct: jax.vjp(lambda x, lo, p: f(x, None, lo, p), x, lo, p)[1](ct))
        outputs = jax.jit(lambda x, lo, p: f(x, None, lo, p))(x, layer_out, params)
        dx, dlayer_out, dparams = run(x, layer_out, params, cotangents)
        dcarried = None
    else:
        outputs = jax.jit(f)(x, carried, layer_out, params)
        run = jax.jit(lambda x, c, lo, p, ct: jax.vjp(f, x, c, lo, p)[1](ct))
        dx, dcarried, dlayer_out, dparams = run(x, carried, layer_out, params, cotangents)
    values = (*outputs, dx, dcarried, dlayer_out, *dparams)
    return dict(zip(numpy_reference.CARRIED_NAMES, values, strict=True))


def _oracle(x, layer_out, params, carried, cotangents, config, noise=None):
    dlayer_in, dh_pre, dout = cotangents
    return numpy_reference.carried_values(x, layer_out, params, config, carried, dlayer_in, dh_pre, dout, noise)


# The oracle: V4.1's VJP against central differences of its own forward (float64, small).


@pytest.mark.parametrize("mix,one_hot", [("sinkhorn", False), ("permutations", False), ("sinkhorn", True)])
def test_numpy_carried_backward_matches_finite_differences(seed, mix, one_hot):
    config = _config(n=3, mix=mix, sinkhorn_iters=3)
    x, layer_out, params, carried, cotangents = _sublayer_problem(seed, config, F32, d=2, lead=(3,))
    inputs = [np.asarray(v, np.float64) for v in (x, layer_out, carried, *params)]
    weights = [np.asarray(c, np.float64) for c in cotangents]

    def loss(values):
        got = numpy_reference.carried_values(
            values[0], values[1], mj.Params(*values[3:]), config, None if one_hot else values[2], *weights
        )
        return sum(np.sum(got[name] * w) for name, w in zip(("layer_in", "h_pre", "out"), weights, strict=True))

    want = numpy_reference.carried_values(
        inputs[0], inputs[1], mj.Params(*inputs[3:]), config, None if one_hot else inputs[2], *weights
    )
    names = ["x", "layer_out", "carried", *mj.Params._fields]
    assert (want["dcarried"] is None) == one_hot  # the one-hot's loss does not read carried
    gradients = [want[f"d{name}"] for name in names]
    assert_gradients_match_central_differences(
        loss, inputs, names, gradients, seed, unchecked=("carried",) if one_hot else ()
    )


def test_numpy_collapse_matches_finite_differences(seed):
    rng = np.random.default_rng(seed)
    x, carried, dout = rng.standard_normal((3, 4, 5)), rng.uniform(size=(3, 4)), rng.standard_normal((3, 5))
    out, dx, dcarried = numpy_reference.collapse_values(x, carried, dout)
    assert np.allclose(out, sum(carried[:, k, None] * x[:, k] for k in range(4)), rtol=1e-14)
    h = 1e-6
    for value, analytic in ((x, dx), (carried, dcarried)):
        numeric = np.zeros_like(value)
        for k in np.ndindex(value.shape):
            saved = value[k]
            value[k] = saved + h
            up = np.sum(numpy_reference.collapse_values(x, carried, dout)[0] * dout)
            value[k] = saved - h
            down = np.sum(numpy_reference.collapse_values(x, carried, dout)[0] * dout)
            value[k] = saved
            numeric[k] = (up - down) / (2 * h)
        assert np.linalg.norm(analytic - numeric) <= 1e-8 * np.linalg.norm(numeric)


# pre with the carried mix, then post: both paths against the oracle.


ORACLE_CASES = {
    "n4-f32-it20": (4, 33, "sinkhorn", F32, False, 20),
    "n4-f32-one-hot": (4, 33, "sinkhorn", F32, True, 4),
    "n3-d130-perm": (3, 130, "permutations", F32, False, 20),
    "n1-d1": (1, 1, "sinkhorn", F32, False, 4),
    "n4-bf16": (4, 16, "sinkhorn", BF16, False, 4),
}


@pytest.mark.parametrize(
    "use_kernel,n,d,mix,dtype,one_hot,iters",
    [
        pytest.param(
            path.values[0],
            *case,
            id=f"{name}-{path.id}",
            # slow: the plain path's 20 Sinkhorn iterations at n = 4, 9.4 s of CPU at -n 0
            # (pyproject.toml's markers, docs/testing.md's "Fast tier"); the other cases are under 5 s.
            marks=pytest.mark.slow if (name, path.id) == ("n4-f32-it20", "plain") else (),
        )
        for name, case in ORACLE_CASES.items()
        for path in PATHS
    ],
)
def test_pre_and_post_match_the_float64_oracle(seed, use_kernel, n, d, mix, dtype, one_hot, iters):
    config = _config(n=n, mix=mix, sinkhorn_iters=iters)
    x, layer_out, params, carried, cotangents = _sublayer_problem(seed, config, dtype, d)
    carried = None if one_hot else carried
    got = _sublayer_vjp(x, layer_out, params, carried, cotangents, config, use_kernel)
    want = _oracle(x, layer_out, params, carried, cotangents, config)
    for name in numpy_reference.CARRIED_NAMES:
        if want[name] is None:
            assert got[name] is None, name
            continue
        expected_shape = np.shape(want[name])
        assert tuple(got[name].shape) == expected_shape, f"{name}: shape {got[name].shape}"

        def perturbed(rng, name=name):
            moved = [round_by_one_unit(rng, v) for v in (x, layer_out, params)]
            moved_carried = None if carried is None else round_by_one_unit(rng, carried)
            return _oracle(*moved[:2], moved[2], moved_carried, cotangents, config, noise=rng)[name]

        tolerance = TOLERANCE[dtype] if name not in ("h_pre",) else 1e-5
        assert_matches(name, got[name], want[name], tolerance, perturbed, f"(seed {seed})")


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_collapse_matches_the_float64_oracle(seed, use_kernel, dtype):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (2, 5, 4, 130), F32).astype(dtype)
    carried = _random_carried(keys[1], (2, 5, 4))
    dout = jax.random.normal(keys[2], (2, 5, 130), F32).astype(dtype)

    def f(x, carried):
        return mj.collapse(mj.Streams(x, carried), use_kernel=use_kernel)

    out, vjp = jax.vjp(jax.jit(f), x, carried)
    dx, dcarried = jax.jit(vjp)(dout)
    want = numpy_reference.collapse_values(*(np.asarray(v.astype(F32), np.float64) for v in (x, carried, dout)))
    for name, got, expected in zip(("out", "dx", "dcarried"), (out, dx, dcarried), want, strict=True):
        assert got.dtype == (F32 if name == "dcarried" else dtype), name
        bound = 1e-5 if name == "dcarried" or dtype == F32 else 1e-2
        assert relative_error(got, expected) <= bound, f"{name} (seed {seed})"


# The chain: sublayer/stack/streams/collapse.


def _chain_problem(seed, config, dtype, d=24, layers=3, lead=(2, 5)):
    keys = jax.random.split(jax.random.key(seed), 2 * layers + 1)
    x = jax.random.normal(keys[0], (*lead, config.n, d), F32).astype(dtype)
    params = [random_params(k, config, d) for k in keys[1 : layers + 1]]
    weights = [jax.random.normal(k, (d, d), F32) / np.sqrt(d) for k in keys[layers + 1 :]]
    return x, params, weights


def _branch(weight):
    # One dot: XLA rounds it the same way across a jax.checkpoint barrier (recompute's same bits).
    return lambda h: (h @ weight.astype(h.dtype)).astype(h.dtype)


def _chain(x, params, weights, config, *, mode="fused", use_kernel=True, recompute=None, update=None):
    """The V4.1 chain ending in collapse. mode "fused": sublayer on each Pending (V4.1's boundary);
    "separate": pre/post by hand with carried = ctx.h_pre; "seam": streams() then Streams(x +
    update, carried) at the seam before the last sublayer (V4.1's Engram)."""
    if mode == "separate":
        carried = None
        for p, w in zip(params, weights, strict=True):
            layer_in, ctx = mj.pre(x, p, config, carried=carried, use_kernel=use_kernel)
            x, carried = mj.post(_branch(w)(layer_in), ctx), ctx.h_pre
        return mj.collapse(mj.Streams(x, carried), use_kernel=use_kernel)
    sublayers = [(p, config, _branch(w)) for p, w in zip(params, weights, strict=True)]
    if mode == "seam":
        state = mj.stack(x, sublayers[:-1], use_kernel=use_kernel)
        streams = mj.streams(state)
        state = mj.Streams(streams.x + update.astype(streams.x.dtype), streams.carried)
        state = mj.sublayer(state, *sublayers[-1][:2], sublayers[-1][2], use_kernel=use_kernel)
    else:
        state = mj.stack(x, sublayers, use_kernel=use_kernel, recompute=recompute)
    return mj.collapse(state)


def _value_and_grads(x, params, weights, config, **kwargs):
    def loss(x, params, weights):
        h = _chain(x, params, weights, config, **kwargs).astype(F32)
        # Linear in h: the streams grow to O(100) over the sublayers, where a sin would amplify
        # the last bits of f32 into the loss.
        return jnp.sum(h * jnp.cos(jnp.arange(h.size, dtype=F32).reshape(h.shape)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, params, weights)


def _chain_oracle_inputs(x, params, weights, config):
    """For conftest.assert_chain_matches: the chain's sublayers (each branch's weight its branch
    argument, so its gradient is checked too) and _value_and_grads' cotangent, the cos weighting."""
    sublayers = [(p, config, lambda h, w: _branch(w)(h), (w,)) for p, w in zip(params, weights, strict=True)]
    shape = x.shape[:-2] + x.shape[-1:]
    return sublayers, jnp.cos(jnp.arange(np.prod(shape), dtype=F32)).reshape(shape)


def _assert_same_bits(got, want, label):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(jnp.asarray(a, F32)), np.asarray(jnp.asarray(b, F32))
        assert np.all(np.isfinite(a)), f"{label}: {jax.tree_util.keystr(path)} not finite"
        assert np.array_equal(a, b), f"{label}: {jax.tree_util.keystr(path)} differs"


@pytest.mark.parametrize(
    "n,mix,dtype", [(4, "sinkhorn", F32), (3, "permutations", BF16), (1, "sinkhorn", F32)], ids=["n4", "n3-bf16", "n1"]
)
def test_fused_boundary_equals_separate_calls_bit_for_bit(seed, n, mix, dtype):
    config = _config(n=n, mix=mix)
    x, params, weights = _chain_problem(seed, config, dtype)
    fused = _value_and_grads(x, params, weights, config, mode="fused")
    separate = _value_and_grads(x, params, weights, config, mode="separate")
    _assert_same_bits(fused, separate, f"fused vs separate (seed {seed})")


def test_kernel_path_agrees_with_the_plain_path(seed):
    config = _config(n=4)
    x, params, weights = _chain_problem(seed, config, F32)
    # Each path against the float64 V4.1 chain with the one accuracy rule, not against the other;
    # the cotangent is _value_and_grads' cos weighting.
    sublayers, cotangent = _chain_oracle_inputs(x, params, weights, config)
    for use_kernel in (True, False):
        _, (dx, dparams, dweights) = _value_and_grads(x, params, weights, config, use_kernel=use_kernel)
        out = jax.jit(lambda x: _chain(x, params, weights, config, use_kernel=use_kernel))(x)  # noqa: B023
        got = {"out": out, "dx": dx, "dparams": dparams, "dbranch": [[w] for w in dweights]}
        assert_chain_matches(got, x, sublayers, cotangent, f"(use_kernel={use_kernel}, seed {seed})")


def test_the_kernel_path_runs_the_v41_kernels_and_fuses_each_boundary():
    config = _config(n=4)
    x, params, weights = _chain_problem(0, config, F32)

    def hlo(mode, use_kernel=True):
        update = jnp.zeros_like(x)

        def loss(x, params):
            return jnp.sum(_chain(x, params, weights, config, mode=mode, use_kernel=use_kernel, update=update))

        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, params).compile().as_text()

    def count(text, target):
        return text.count(f'custom_call_target="{target}"')

    fused = hlo("fused")
    # Three sublayers: the first pre, two fused boundaries, the last post and the collapse.
    expected = {
        "mhc_pre_forward_carried": 1,
        "mhc_pre_backward_carried": 1,
        "mhc_boundary_forward_carried": 2,
        "mhc_boundary_backward_carried": 2,
        "mhc_post_forward": 1,
        "mhc_post_backward": 1,
        "mhc_collapse_backward": 1,
        "mhc_pre_forward": 0,
        "mhc_boundary_forward": 0,
    }
    for target, times in expected.items():
        assert count(fused, target) == times, target
    # The seam before the last sublayer: its post and pre run separately, the first boundary fused.
    seam = hlo("seam")
    assert count(seam, "mhc_boundary_forward_carried") == 1
    assert count(seam, "mhc_pre_forward_carried") == 2
    assert count(seam, "mhc_post_forward") == 2
    assert "mhc_" not in hlo("fused", use_kernel=False)


# slow: the plain path, 7.1 s of CPU at -n 0 (pyproject.toml's markers, docs/testing.md's "Fast tier").
@pytest.mark.parametrize(
    "use_kernel", [pytest.param(True, id="kernel"), pytest.param(False, id="plain", marks=pytest.mark.slow)]
)
def test_the_engram_seam_equals_the_fused_sweep_where_the_update_is_zero(seed, use_kernel):
    config = _config(n=4)
    x, params, weights = _chain_problem(seed, config, F32)
    fused = _value_and_grads(x, params, weights, config, use_kernel=use_kernel)
    zero = jnp.zeros_like(x)
    seam = _value_and_grads(x, params, weights, config, use_kernel=use_kernel, mode="seam", update=zero)
    _assert_same_bits(seam, fused, f"seam with a zero update vs fused (seed {seed})")
    # A nonzero update changes the result.
    update = 0.3 * jax.random.normal(jax.random.key(seed + 1), x.shape, F32)
    moved = _value_and_grads(x, params, weights, config, use_kernel=use_kernel, mode="seam", update=update)
    assert not np.array_equal(np.asarray(moved[0]), np.asarray(fused[0]))
    # The seam's result against the float64 V4.1 chain with the update added before the last
    # sublayer (the one accuracy rule; the cotangent is _value_and_grads' cos weighting).
    sublayers, cotangent = _chain_oracle_inputs(x, params, weights, config)
    out = jax.jit(lambda x: _chain(x, params, weights, config, use_kernel=use_kernel, mode="seam", update=update))(x)
    _, (dx, dparams, dweights) = moved
    got = {"out": out, "dx": dx, "dparams": dparams, "dbranch": [[w] for w in dweights]}
    updates = {len(params) - 1: update}
    assert_chain_matches(got, x, sublayers, cotangent, f"(use_kernel={use_kernel}, seed {seed})", updates=updates)


@pytest.fixture
def _quiet_cpu_scheduler_warning(monkeypatch):
    monkeypatch.setattr(mj, "_cpu_scheduler_warned", True)


@pytest.mark.usefixtures("_quiet_cpu_scheduler_warning")
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_recompute_keeps_the_bits(seed, dtype):
    config = _config(n=4)
    x, params, weights = _chain_problem(seed, config, dtype, layers=4)
    want = _value_and_grads(x, params, weights, config)
    for k in (1, 2, 3):
        got = _value_and_grads(x, params, weights, config, recompute=k)
        _assert_same_bits(got, want, f"recompute={k} (seed {seed})")


@pytest.mark.usefixtures("_quiet_cpu_scheduler_warning")
def test_scan_over_sublayers_keeps_the_bits(seed):
    """A V4.1 Pending (streams, layer_out and the carried mix in its context) as a jax.lax.scan
    carry over stacked parameters, the body under recompute_streams: the unrolled chain's bits."""
    config = _config(n=4)
    x, params, weights = _chain_problem(seed, config, F32, layers=4)

    def scanned(x, params, weights):
        first = mj.sublayer(x, params[0], config, _branch(weights[0]))
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *params[1:])

        def body(state, layer):
            p, w = layer
            return mj.sublayer(state, p, config, _branch(w)), None

        state, _ = jax.lax.scan(mj.recompute_streams(body), first, (stacked, jnp.stack(weights[1:])))
        return mj.collapse(state)

    def loss(chain):
        return lambda *a: jnp.sum(chain(*a) * jnp.cos(jnp.arange(x.shape[-1], dtype=F32)))

    unrolled = lambda *a: _chain(*a, config)  # noqa: E731
    want = jax.jit(jax.value_and_grad(loss(unrolled), argnums=(0, 1, 2)))(x, params, weights)
    got = jax.jit(jax.value_and_grad(loss(scanned), argnums=(0, 1, 2)))(x, params, weights)
    _assert_same_bits(got, want, f"scan (seed {seed})")


@pytest.mark.parametrize("use_kernel", PATHS)
def test_no_tokens(use_kernel):
    config = _config(n=4)
    x, params, weights = _chain_problem(0, config, F32, d=8, lead=(0,))
    value, (dx, dparams, _) = _value_and_grads(x, params, weights, config, use_kernel=use_kernel)
    assert float(value) == 0.0 and dx.shape == x.shape
    for g in jax.tree.leaves(dparams):
        assert not np.any(np.asarray(g)), "a parameter gradient over no tokens is zero"


def test_vmap_and_checkpoint_names(seed):
    config = _config(n=3)
    x, params, weights = _chain_problem(seed, config, F32, layers=2)
    one = jax.jit(lambda x: _chain(x, params, weights, config))
    batched = jax.jit(jax.vmap(lambda x: _chain(x, params, weights, config)))(x)
    assert np.array_equal(np.asarray(batched), np.asarray(one(x)))
    # vmap of the gradient: the parameter gradients stay one sum per batch element.
    grads = jax.jit(jax.vmap(jax.grad(lambda x, p: jnp.sum(_chain(x, p, weights, config)), argnums=1), (0, None)))
    per_element = grads(x, params)
    first = jax.grad(lambda x, p: jnp.sum(_chain(x, p, weights, config)), argnums=1)(x[0], params)
    # Element 0's parameter gradients under vmap and alone, each against the float64 chain.
    sublayers = [(p, config, _branch(w)) for p, w in zip(params, weights, strict=True)]
    ones = np.ones(x.shape[1:-2] + x.shape[-1:])  # the cotangent of jnp.sum
    for label, grads in (("vmap", [jax.tree.map(lambda a: a[0], p) for p in per_element]), ("alone", first)):
        assert_chain_matches({"dparams": grads}, x[0], sublayers, ones, f"({label}, seed {seed})")
    # Every residual of the V4.1 custom VJPs is named (the carried mix as a coefficient): a policy
    # saving only the mhc names keeps them all, and the gradients are the same bits.

    def loss(x, params):
        return jnp.sum(_chain(x, params, weights, config) * jnp.cos(jnp.arange(x.shape[-1], dtype=F32)))

    policy = jax.checkpoint_policies.save_only_these_names(*mj.RESIDUAL_NAMES)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # print_saved_residuals: the public way to list them
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=policy), x, params)
    saved = out.getvalue().splitlines()
    names = {m.group(1) for line in saved if (m := re.search(r"named '([^']*)'", line))}
    assert names == set(mj.RESIDUAL_NAMES), saved
    # Besides: the arguments and the branches' closed-over weights.
    others = [line for line in saved if "named '" not in line and "from the argument" not in line]
    assert all("from a constant" in line for line in others), others
    # The carried mix of each pre-apply and of the collapse (the one-hot's is empty) beside each
    # post's h_post and h_res: 2 + 2 per boundary, 2 in the last post, 1 in the collapse.
    assert sum("named 'mhc_coefficients'" in line for line in saved) == 4 * (len(params) - 1) + 3, saved
    plain = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, params)
    checkpointed = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1)))(x, params)
    # This policy recomputes the branch's dot, which XLA may round differently (V4 alike;
    # recompute's policy keeps it, test_recompute_keeps_the_bits: same bits): each against the
    # float64 chain with the one accuracy rule.
    weight = np.broadcast_to(jnp.cos(jnp.arange(x.shape[-1], dtype=F32)), x.shape[:-2] + x.shape[-1:])  # loss's
    for label, (dx, dparams) in (("checkpoint policy", checkpointed), ("no checkpoint", plain)):
        assert_chain_matches({"dx": dx, "dparams": dparams}, x, sublayers, weight, f"({label}, seed {seed})")


def test_bad_arguments_are_named():
    v4, v41 = mj.Config(n=4), _config(n=4)
    x, params, weights = _chain_problem(0, v41, F32, d=8, layers=2)
    carried = jnp.full(x.shape[:-1], 0.5, F32)
    with pytest.raises(ValueError, match=r"Config.pre_from_previous: expected a bool"):
        mj.Config(n=4, pre_from_previous="yes")
    for use_kernel in (True, False):
        with pytest.raises(ValueError, match=r"carried: .*pre_from_previous=True"):
            mj.pre(x, params[0], v4, carried=carried, use_kernel=use_kernel)
        with pytest.raises(ValueError, match=r"carried: expected shape \(2, 5, 4\)"):
            mj.pre(x, params[0], v41, carried=carried[..., :3], use_kernel=use_kernel)
        with pytest.raises(TypeError, match=r"carried: expected dtype float32"):
            mj.pre(x, params[0], v41, carried=carried.astype(BF16), use_kernel=use_kernel)
    branch = _branch(weights[0])
    v41_state, v4_state = mj.sublayer(x, params[0], v41, branch), mj.sublayer(x, params[0], v4, branch)
    with pytest.raises(ValueError, match=r"config: the next sublayer's pre_from_previous \(False\)"):
        mj.sublayer(v41_state, params[1], v4, branch)
    with pytest.raises(ValueError, match=r"config: the next sublayer's pre_from_previous \(True\)"):
        mj.sublayer(v4_state, params[1], v41, branch)
    with pytest.raises(ValueError, match=r"carried: .*pre_from_previous=True"):
        mj.sublayer(mj.streams(v41_state), params[1], v4, branch)
    with pytest.raises(ValueError, match=r"state: collapse is DeepSeek-V4.1's end"):
        mj.collapse(v4_state)
    with pytest.raises(ValueError, match=r"state: Streams without a carried mix"):
        mj.collapse(mj.streams(v4_state))
    with pytest.raises(TypeError, match=r"state: expected the Pending of a V4.1 chain or mhc.jax.Streams"):
        mj.collapse(x)
    with pytest.raises(ValueError, match=r"carried: expected shape \(2, 5, 4\)"):
        mj.collapse(mj.Streams(x, carried[..., :3]))
    with pytest.raises(TypeError, match=r"carried: expected dtype float32"):
        mj.collapse(mj.Streams(x, carried.astype(BF16)))
    # V4 streams pass through as before: no carried mix.
    assert mj.streams(v4_state).carried is None and mj.Streams(x).carried is None
    streams = mj.streams(v41_state)
    assert mj.finish(streams) is streams.x


V41_TARGETS = {"mhc_pre_forward_carried", "mhc_pre_backward_carried", "mhc_collapse_forward", "mhc_collapse_backward"}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_a_platform_without_the_v41_kernels_raises_naming_the_way_out(platform):
    """Where a platform lacks the V4.1 kernels (CUDA and TPU this round), use_kernel=True raises
    the mhc error when the program is lowered for it (jax.export, no device needed); where it has
    them, the program calls them. use_kernel=False lowers anywhere."""
    config = _config(n=4)
    x, params, weights = _chain_problem(0, config, F32, d=8, layers=2)

    def export(use_kernel):
        def loss(x, params):
            return jnp.sum(_chain(x, params, weights, config, use_kernel=use_kernel))

        return jax.export.export(jax.jit(jax.grad(loss)), platforms=[platform])(x, params)

    if _kernels.registered_targets(platform) >= V41_TARGETS:
        export(True)  # its kernels (a TPU's Pallas kernels lower to tpu_custom_call, not mhc_*)
    else:
        with pytest.raises(NotImplementedError, match=rf"mhc\.jax\.\w+: .*'{platform}'.*use_kernel=False"):
            export(True)
    assert "mhc_" not in export(False).mlir_module()


@pytest.mark.slow  # a fresh JAX process on forced devices: 17 s of CPU (pyproject.toml, markers)
def test_tokens_sharded_over_two_devices(seed):
    script = os.path.join(os.path.dirname(__file__), "carried_sharding_cases.py")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, script, str(seed)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"seed {seed}\n{result.stdout}\n{result.stderr[-4000:]}"
    assert result.stdout.count("ok:") == 5, result.stdout

"""The independent float64 NumPy oracle (numpy_reference.py): its backward against central
differences of its forward, and mhc.jax.reference (the plain path) pinned to it, forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
import numpy_reference
from conftest import assert_gradients_match_central_differences, random_params, relative_error, sublayer_values

CUSTOM = dict(pre_eps=0.1, sinkhorn_eps=0.05, rms_eps=0.5, post_scale=1.3)


def _case(n, d, mix, iters, extra, marks=()):
    return pytest.param(
        n, d, mix, iters, extra, id=f"{mix}-n{n}-d{d}-it{iters}{'-custom' if extra else ''}", marks=marks
    )


# slow: over 5 s of CPU at -n 0 (11.7, 9.2 and 5.7 s; pyproject.toml's markers, docs/testing.md's
# "Fast tier"), where the first case (6.4 s, the file's first compilations) is not.
CASES = [
    _case(3, 7, "sinkhorn", 1, {}),
    _case(4, 16, "sinkhorn", 20, {}, marks=pytest.mark.slow),
    _case(4, 9, "permutations", 20, {}, marks=pytest.mark.slow),
    _case(3, 6, "sinkhorn", 2, CUSTOM, marks=pytest.mark.slow),
    _case(3, 4, "permutations", 1, CUSTOM),
]


def problem(seed, n, d, mix, iters, extra, lead=(2, 3)):
    config = mj.Config(n=n, mix=mix, sinkhorn_iters=iters, **extra)
    kx, klo, kp, ki, ko = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(kx, (*lead, n, d), jnp.float32) * (0.7 if extra else 1.0)
    layer_out = jax.random.normal(klo, (*lead, d), jnp.float32)
    params = random_params(kp, config, d)
    dlayer_in = jax.random.normal(ki, (*lead, d), jnp.float32)
    dout = jax.random.normal(ko, (*lead, n, d), jnp.float32)
    return config, x, layer_out, params, dlayer_in, dout


# Small shapes: central differences cost two forwards per input element.
FD_CASES = [(2, 3, "sinkhorn", 1, {}), (3, 2, "sinkhorn", 3, CUSTOM), (3, 2, "permutations", 20, {})]


@pytest.mark.parametrize("n,d,mix,iters,extra", FD_CASES, ids=[f"{c[2]}-n{c[0]}-it{c[3]}" for c in FD_CASES])
def test_numpy_backward_matches_finite_differences(seed, n, d, mix, iters, extra):
    config, x, layer_out, params, dlayer_in, dout = problem(seed, n, d, mix, iters, extra, lead=(3,))
    inputs = [np.asarray(v, np.float64) for v in (x, layer_out, *params)]
    w_in, w_out = np.asarray(dlayer_in, np.float64), np.asarray(dout, np.float64)

    def loss(values):
        layer_in, out = numpy_reference.forward(values[0], values[1], mj.Params(*values[2:]), config)
        return np.sum(layer_in * w_in) + np.sum(out * w_out)

    dx, dlo, dparams = numpy_reference.backward(inputs[0], inputs[1], mj.Params(*inputs[2:]), config, w_in, w_out)
    names = ["x", "layer_out", *mj.Params._fields]
    assert_gradients_match_central_differences(loss, inputs, names, [dx, dlo, *dparams], seed)


@pytest.mark.parametrize("v41", [False, True], ids=["v4", "v41-carried"])
def test_numpy_pre_and_post_alone_match_finite_differences(seed, v41):
    """pre_values (every output with a cotangent; V4.1 mixing by a carried mix) and post_values
    from given coefficients: the oracles of the bench's operations."""
    config, x, layer_out, params, dlayer_in, dout = problem(seed, 3, 2, "sinkhorn", 3, {}, lead=(3,))
    rng = np.random.default_rng(seed)
    carried = rng.uniform(size=(3, 3)) if v41 else None
    weights = [np.asarray(dlayer_in, np.float64), *(rng.standard_normal(s) for s in ((3, 3), (3, 3), (3, 3, 3)))]
    inputs = [np.asarray(v, np.float64) for v in (x, *params)] + ([carried] if v41 else [])

    def pre_loss(values):
        outputs, _ = numpy_reference.pre_values(
            values[0], mj.Params(*values[1:5]), config, *weights, values[5] if v41 else None
        )
        return sum(np.sum(o * w) for o, w in zip(outputs, weights, strict=True))

    _, (dx, dparams, dcarried) = numpy_reference.pre_values(
        inputs[0], mj.Params(*inputs[1:5]), config, *weights, carried
    )
    assert (dcarried is None) == (not v41)
    names = ["x", *mj.Params._fields] + (["carried"] if v41 else [])
    assert_gradients_match_central_differences(pre_loss, inputs, names, [dx, *dparams, dcarried][: len(names)], seed)

    g = np.asarray(dout, np.float64)
    post_inputs = [np.asarray(x, np.float64), np.asarray(layer_out, np.float64), weights[1], weights[3]]
    _, *gradients = numpy_reference.post_values(*post_inputs, g)
    post_loss = lambda values: np.sum(numpy_reference.post_values(*values, g)[0] * g)  # noqa: E731
    assert_gradients_match_central_differences(
        post_loss, post_inputs, ["x", "layer_out", "h_post", "h_res"], gradients, seed
    )


@pytest.mark.parametrize("n,d,mix,iters,extra", CASES)
def test_plain_path_matches_numpy(seed, n, d, mix, iters, extra):
    config, x, layer_out, params, dlayer_in, dout = problem(seed, n, d, mix, iters, extra)

    got_values = sublayer_values(x, layer_out, params, config, (dlayer_in, dout), use_kernel=False)
    want_values = numpy_reference.values(x, layer_out, params, config, dlayer_in, dout)
    for name, got in got_values.items():
        assert relative_error(got, want_values[name]) <= 1e-5, f"{name} (seed {seed})"


def test_permutation_matrices_are_lexicographic():
    mats = mj.reference.permutation_matrices(3)
    assert mats.shape == (6, 3, 3)
    np.testing.assert_array_equal(mats[0], np.eye(3))
    np.testing.assert_array_equal(np.argmax(mats[1], axis=1), [0, 2, 1])
    np.testing.assert_array_equal(np.argmax(mats[5], axis=1), [2, 1, 0])

"""Shared helpers: random problems with non-trivial coefficients and the spec's error metric."""

import os
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
import numpy_reference


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


def sublayer_values(x, layer_out, params, config: mj.Config, cotangents, use_kernel: bool = True) -> dict:
    """pre -> post under jit on the kernel (or plain) path: layer_in, out and the VJP at
    cotangents = (dlayer_in, dout) with respect to x, layer_out and every parameter, as one dict
    named like numpy_reference.values."""

    @jax.jit
    def run(x, layer_out, params, cotangents):
        def f(x, layer_out, params):
            layer_in, ctx = mj.pre(x, params, config, use_kernel=use_kernel)
            return layer_in, mj.post(layer_out, ctx)

        outputs, vjp = jax.vjp(f, x, layer_out, params)
        return outputs, vjp(cotangents)

    (layer_in, out), (dx, dlayer_out, dparams) = run(x, layer_out, params, cotangents)
    return dict(zip(numpy_reference.NAMES, (layer_in, out, dx, dlayer_out, *dparams), strict=True))


def assert_matches(name, got, want, tolerance, perturbed=None, context=""):
    """The spec's bound, relative_error(got, want) <= tolerance; where that fails and `perturbed` is
    given (a cancelling sum: dalpha), the absolute error may instead be up to 32x the distance the
    reference moves when every input is rounded by up to one f32 unit (perturbed() returns such a
    reference; up to 4 draws). The rule of expect_matches in tests/cpp/test_util.cc."""
    error = relative_error(got, want)
    if error <= tolerance:
        return
    assert perturbed is not None and not np.isnan(error), f"{name}: relative error {error:.3g} > {tolerance} {context}"
    got64 = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want64 = np.asarray(want, np.float64)
    absolute = np.linalg.norm(got64 - want64)
    spread = 0.0
    for _ in range(4):
        spread = max(spread, float(np.linalg.norm(np.asarray(perturbed(), np.float64) - want64)))
        if absolute <= 32 * spread:
            return
    raise AssertionError(
        f"{name}: relative error {error:.3g} > {tolerance}, and absolute error {absolute:.3g} > 32 x "
        f"rounding spread {spread:.3g} {context}"
    )


def round_by_one_unit(rng: np.random.Generator, value):
    """value (an array or a tuple of arrays, e.g. Params) in float64, each element scaled by
    1 + u with |u| <= 2^-24: a rounding of the inputs by up to one f32 unit."""
    if isinstance(value, tuple):
        return type(value)(*(round_by_one_unit(rng, v) for v in value))
    array = np.asarray(jnp.asarray(value, jnp.float32), np.float64)
    return array * (1.0 + rng.uniform(-(2.0**-24), 2.0**-24, array.shape))

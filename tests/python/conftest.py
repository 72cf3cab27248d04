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

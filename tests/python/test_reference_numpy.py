"""mhc.jax.reference pinned by an independent float64 NumPy evaluation of the spec's forward."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
from conftest import random_params, relative_error


def numpy_forward(x, layer_out, params, config):
    """Spec steps 1-8 per token in float64, written from the spec, not from the JAX code."""
    x = np.asarray(x, np.float64)
    layer_out = np.asarray(layer_out, np.float64)
    nw, phi, alpha, bias = (np.asarray(p, np.float64) for p in params)
    n, d = x.shape[-2:]
    flat_x = x.reshape(-1, n, d)
    flat_lo = layer_out.reshape(-1, d)
    layer_in = np.zeros_like(flat_lo)
    out = np.zeros_like(flat_x)
    perms = list(itertools.permutations(range(n)))
    sig = lambda v: 1.0 / (1.0 + math.exp(-v))  # noqa: E731
    for t in range(flat_x.shape[0]):
        xt = flat_x[t].reshape(-1)
        r = 1.0 / math.sqrt(np.mean(xt * xt) + config.rms_eps)
        a = np.empty(phi.shape[1])
        for c in range(phi.shape[1]):
            group = 0 if c < n else (1 if c < 2 * n else 2)
            a[c] = alpha[group] * r * np.sum(xt * nw * phi[:, c]) + bias[c]
        h_pre = np.array([sig(a[k]) + config.pre_eps for k in range(n)])
        h_post = np.array([config.post_scale * sig(a[n + k]) for k in range(n)])
        res = a[2 * n :]
        if config.mix == "sinkhorn":
            logits = res.reshape(n, n)
            s = np.exp(logits - logits.max(axis=1, keepdims=True))
            s = s / s.sum(axis=1, keepdims=True) + config.sinkhorn_eps
            s = s / (s.sum(axis=0, keepdims=True) + config.sinkhorn_eps)
            for _ in range(config.sinkhorn_iters - 1):
                s = s / (s.sum(axis=1, keepdims=True) + config.sinkhorn_eps)
                s = s / (s.sum(axis=0, keepdims=True) + config.sinkhorn_eps)
            h_res = s
        else:
            w = np.exp(res - res.max())
            w = w / w.sum()
            h_res = np.zeros((n, n))
            for p, perm in enumerate(perms):
                for i in range(n):
                    h_res[i, perm[i]] += w[p]
        layer_in[t] = h_pre @ flat_x[t]
        out[t] = h_res.T @ flat_x[t] + h_post[:, None] * flat_lo[t][None, :]
    return layer_in.reshape(layer_out.shape), out.reshape(x.shape)


@pytest.mark.parametrize(
    "n,d,mix,iters",
    [
        (1, 5, "sinkhorn", 20),
        (3, 7, "sinkhorn", 1),
        (4, 16, "sinkhorn", 20),
        (3, 4, "permutations", 20),
        (4, 9, "permutations", 20),
    ],
)
def test_reference_forward_matches_numpy(seed, n, d, mix, iters):
    config = mj.Config(n=n, mix=mix, sinkhorn_iters=iters)
    kx, klo, kp = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (2, 3, n, d), jnp.float32)
    layer_out = jax.random.normal(klo, (2, 3, d), jnp.float32)
    params = random_params(kp, config, d)
    layer_in, ctx = mj.reference.pre(x, params, config)
    out = mj.reference.post(layer_out, ctx)
    want_in, want_out = numpy_forward(x, layer_out, params, config)
    assert relative_error(layer_in, want_in) <= 1e-5, f"layer_in (seed {seed})"
    assert relative_error(out, want_out) <= 1e-5, f"out (seed {seed})"


def test_permutation_matrices_are_lexicographic():
    mats = mj.reference.permutation_matrices(3)
    assert mats.shape == (6, 3, 3)
    np.testing.assert_array_equal(mats[0], np.eye(3))
    np.testing.assert_array_equal(np.argmax(mats[1], axis=1), [0, 2, 1])
    np.testing.assert_array_equal(np.argmax(mats[5], axis=1), [2, 1, 0])

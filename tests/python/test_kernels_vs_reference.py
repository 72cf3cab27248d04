"""The kernel path (custom VJP over the C++ operations) against mhc.jax.reference under jit:
outputs and the gradients with respect to x, layer_out and every parameter, random cotangents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
from conftest import random_params, relative_error

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# Every config scalar away from its default (and from the others), so that an FFI layer that drops
# one fails: the kernels would then run with the default.
CUSTOM = dict(pre_eps=0.1, sinkhorn_eps=0.05, rms_eps=0.5, post_scale=1.3)


def sublayer(x, layer_out, params, config, use_kernel):
    """(layer_in, out) with layer_out an independent input, as the caller's F returns it."""
    layer_in, ctx = mj.pre(x, params, config, use_kernel=use_kernel)
    return layer_in, mj.post(layer_out, ctx)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mix", ["sinkhorn", "permutations"])
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("d", [1, 130, 512])
def test_outputs_and_gradients(seed, dtype, mix, n, d):
    check_outputs_and_gradients(seed, dtype, mj.Config(n=n, mix=mix), d)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "mix,n,iters", [("sinkhorn", 3, 1), ("sinkhorn", 4, 2), ("sinkhorn", 4, 3), ("permutations", 3, 1)]
)
def test_non_default_config(seed, dtype, mix, n, iters):
    """The config's scalars reach the kernels through the FFI attributes (x with mean square near
    rms_eps, so that it matters)."""
    check_outputs_and_gradients(seed, dtype, mj.Config(n=n, mix=mix, sinkhorn_iters=iters, **CUSTOM), 130, 0.7)


def check_outputs_and_gradients(seed, dtype, config, d, x_scale=1.0):
    n = config.n
    lead = (2, 7)
    kx, klo, kp, kin, kout = jax.random.split(jax.random.key(seed), 5)
    x = (x_scale * jax.random.normal(kx, (*lead, n, d), jnp.float32)).astype(dtype)
    layer_out = jax.random.normal(klo, (*lead, d), jnp.float32).astype(dtype)
    params = random_params(kp, config, d)
    w_in = jax.random.normal(kin, (*lead, d), jnp.float32).astype(dtype)
    w_out = jax.random.normal(kout, (*lead, n, d), jnp.float32).astype(dtype)

    def run(use_kernel):
        def f(x, layer_out, params):
            return sublayer(x, layer_out, params, config, use_kernel)

        outputs, vjp = jax.vjp(f, x, layer_out, params)
        return outputs, vjp((w_in, w_out))

    (li_k, out_k), grads_k = jax.jit(lambda: run(True))()
    (li_r, out_r), grads_r = jax.jit(lambda: run(False))()
    tol = TOLERANCE[dtype]
    named = {
        "layer_in": (li_k, li_r),
        "out": (out_k, out_r),
        "dx": (grads_k[0], grads_r[0]),
        "dlayer_out": (grads_k[1], grads_r[1]),
    }
    for field in mj.Params._fields:
        named["d" + field] = (getattr(grads_k[2], field), getattr(grads_r[2], field))
    assert grads_k[0].dtype == x.dtype and grads_k[1].dtype == layer_out.dtype
    for name, (got, want) in named.items():
        error = relative_error(got, want)
        # The reference is itself f32 here, so a tiny tensor that is a cancelling sum (dalpha:
        # three sums over all tokens) carries its rounding too; an absolute floor of 5e-6 per
        # element covers that and is far below the bound for every other tensor.
        want64 = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
        floor = 5e-6 * np.sqrt(want64.size) / max(np.linalg.norm(want64), 1e-30) if dtype == jnp.float32 else 0.0
        assert error <= tol + floor, f"{name}: relative error {error:.3g} > {tol} (seed {seed})"

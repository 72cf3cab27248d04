"""The kernel path (custom VJP over the C++ operations) under jit against the float64 NumPy oracle
(numpy_reference.py): outputs and the gradients with respect to x, layer_out and every parameter,
random cotangents. Bounds: f32 tensors (every parameter gradient, whatever the activation dtype)
1e-5, bf16 tensors 1e-2, or SPREAD_MULTIPLE x the oracle's own spread under one-f32-unit
perturbations where that is larger (conftest.assert_matches, the rule of the C++ tests: a cancelling
sum such as dalpha)."""

import jax
import jax.numpy as jnp
import pytest

import mhc.jax as mj
from conftest import (
    assert_kernel_sublayer_mixes_rounded_once,
    assert_sublayer_matches_reference,
    random_params,
    sublayer_values,
)

# Every config scalar away from its default (and from the others), so that an FFI layer that drops
# one fails: the kernels would then run with the default.
CUSTOM = dict(pre_eps=0.1, sinkhorn_eps=0.05, rms_eps=0.5, post_scale=1.3)


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
    x = x.at[1, 3].set(0)  # an all-zero token: r = 1/sqrt(rms_eps), finite outputs
    layer_out = jax.random.normal(klo, (*lead, d), jnp.float32).astype(dtype)
    params = random_params(kp, config, d)
    w_in = jax.random.normal(kin, (*lead, d), jnp.float32).astype(dtype)
    w_out = jax.random.normal(kout, (*lead, n, d), jnp.float32).astype(dtype)

    got_values = sublayer_values(x, layer_out, params, config, (w_in, w_out))
    assert got_values["dx"].dtype == x.dtype and got_values["dlayer_out"].dtype == layer_out.dtype
    assert_sublayer_matches_reference(got_values, x, layer_out, params, config, (w_in, w_out), f"(seed {seed})")
    if dtype == jnp.bfloat16:
        assert_kernel_sublayer_mixes_rounded_once(x, layer_out, params, config, got_values, f"(seed {seed})")

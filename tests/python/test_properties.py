"""Property-based tests (hypothesis): for arbitrary shapes, dtypes and configs the kernel path
matches the reference path, and invalid input raises a Python exception, never a crash."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import mhc.jax as mj
from conftest import random_params

# Relative bound of the spec plus an absolute floor per element: with tiny random shapes
# (T = 1, D = 1) a tensor can be a cancelling sum whose norm is far below its terms, where only an
# absolute bound is meaningful. The fixed-shape tests hold the spec's bounds without a floor.
BOUNDS = {jnp.float32: (1e-5, 1e-4), jnp.bfloat16: (1e-2, 2e-2)}


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 5),
    d=st.integers(1, 40),
    lead=st.lists(st.integers(0, 3), min_size=1, max_size=2),
    mix=st.sampled_from(["sinkhorn", "permutations"]),
    iters=st.integers(1, 25),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_path_matches_reference(n, d, lead, mix, iters, dtype, seed):
    config = mj.Config(n=n, mix=mix, sinkhorn_iters=iters)
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (*lead, n, d)).astype(dtype)
    layer_out = jax.random.normal(keys[1], (*lead, d)).astype(dtype)
    params = random_params(keys[2], config, d)
    w_in = jax.random.normal(keys[3], (*lead, d)).astype(dtype)
    w_out = jax.random.normal(keys[4], (*lead, n, d)).astype(dtype)

    def run(use_kernel):
        def f(x, layer_out, params):
            layer_in, ctx = mj.pre(x, params, config, use_kernel=use_kernel)
            return layer_in, mj.post(layer_out, ctx)

        outputs, vjp = jax.vjp(f, x, layer_out, params)
        return jax.tree.leaves((outputs, vjp((w_in, w_out))))

    relative, absolute = BOUNDS[dtype]
    for got, want in zip(run(True), run(False), strict=True):
        got = np.asarray(got, np.float64)
        want = np.asarray(want, np.float64)
        assert np.isfinite(got).all(), "kernel produced a non-finite value from finite inputs"
        error = np.linalg.norm(got - want)
        bound = relative * np.linalg.norm(want) + absolute * np.sqrt(max(got.size, 1))
        assert error <= bound, f"error {error:.3g} > {bound:.3g} for shape {got.shape}"


def test_invalid_input_raises_and_never_kills_the_interpreter():
    """Bad calls through the public API and straight into the FFI handlers (skipping the Python
    checks), in a subprocess: each must raise, and the process must exit normally."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        import mhc.jax as mj
        from mhc.jax import _kernels

        config = mj.Config(n=4)
        params = mj.init_params(jax.random.key(0), config, 8)
        x = jnp.ones((3, 4, 8))
        layer_out, h_post, h_res = jnp.ones((3, 8)), jnp.ones((3, 4)), jnp.ones((3, 4, 4))
        bf16_bias = params._replace(bias=params.bias.astype(jnp.bfloat16))
        bad_calls = {
            "rank": lambda: mj.pre(jnp.ones(8), params, config),
            "streams": lambda: mj.pre(jnp.ones((3, 5, 8)), params, config),
            "dtype": lambda: mj.pre(jnp.ones((3, 4, 8), jnp.int8), params, config),
            "param shape": lambda: mj.pre(x, params._replace(phi=jnp.ones((32, 23))), config),
            "ffi param shape": lambda: _kernels.pre_forward(config, x, params._replace(phi=jnp.ones((32, 23)))),
            "ffi param dtype": lambda: _kernels.pre_forward(config, x, bf16_bias),
            "ffi streams": lambda: _kernels.pre_forward(mj.Config(n=2), jnp.ones((3, 4, 8)), params),
            "ffi layer_out": lambda: _kernels.post_forward(config, x, jnp.ones((3, 9)), h_post, h_res),
            "ffi slices": lambda: _kernels.pre_forward_partials(config, 0, x, params.norm_weight, params.phi),
            "ffi slice rows": lambda: _kernels.pre_forward_partials(config, 2, x, jnp.ones(64), jnp.ones((64, 24))),
            "ffi dh_pre shape": lambda: _kernels.pre_backward_partials(config, 1, jnp.ones((3, 9)), x),
            "ffi x dtype": lambda: _kernels.post_forward(config, x.astype(jnp.float16), layer_out, h_post, h_res),
        }
        for name, call in bad_calls.items():
            try:
                jax.block_until_ready(call())
            except Exception as error:  # ValueError, TypeError or XlaRuntimeError
                assert str(error), name
                print("raised", name, "|", type(error).__name__, str(error).splitlines()[0][:120])
            else:
                raise SystemExit(f"no error for {name}")
        print("done")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    assert result.stdout.count("raised") == 12 and "done" in result.stdout, result.stdout
    assert "mhc::pre_forward: params.phi: expected shape [32, 24], got [32, 23]" in result.stdout, result.stdout
    assert "tensor_parallel: expected 1 <= tensor_parallel" in result.stdout, result.stdout

"""Property-based tests (hypothesis): for arbitrary shapes, dtypes and configs (every scalar at its
default or away from it) the kernel path, through the FFI, matches the float64 NumPy oracle, and
invalid input raises a Python exception, never a crash."""

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhc.jax as mj
import numpy_reference
from conftest import assert_matches, random_numpy_params, round_by_one_unit, sublayer_values

# The spec's bounds against the float64 oracle: f32 tensors (every parameter gradient, whatever the
# activation dtype) 1e-5, bf16 tensors 1e-2, or SPREAD_MULTIPLE x the oracle's own spread where that
# is larger (conftest.assert_matches, the rule of the C++ tests).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@pytest.mark.slow  # 100 examples: over 10 s of CPU (pyproject.toml, markers)
@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 5),
    d=st.integers(1, 40),
    lead=st.lists(st.integers(1, 4), min_size=1, max_size=2),
    mix=st.sampled_from(["sinkhorn", "permutations"]),
    iters=st.integers(1, 25),
    pre_eps=st.sampled_from([1e-6, 0.1]),
    sinkhorn_eps=st.sampled_from([1e-6, 0.05]),
    rms_eps=st.sampled_from([1e-6, 0.5]),
    post_scale=st.sampled_from([2.0, 1.3]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_path_matches_float64_reference(
    n, d, lead, mix, iters, pre_eps, sinkhorn_eps, rms_eps, post_scale, dtype, seed
):
    config = mj.Config(
        n=n,
        mix=mix,
        sinkhorn_iters=iters,
        pre_eps=pre_eps,
        sinkhorn_eps=sinkhorn_eps,
        rms_eps=rms_eps,
        post_scale=post_scale,
    )
    # NumPy draws (no JAX compilation per shape); bf16 values are exact in the float64 oracle.
    rng = np.random.default_rng(seed)
    x, layer_out, w_in, w_out = (
        rng.standard_normal(shape).astype(dtype) for shape in [(*lead, n, d), (*lead, d), (*lead, d), (*lead, n, d)]
    )
    params = random_numpy_params(rng, config, d)
    if x.size > n * d:
        x.reshape(-1, n, d)[-1] = 0  # an all-zero token: r = 1/sqrt(rms_eps), finite outputs

    got_values = sublayer_values(x, layer_out, params, config, (w_in, w_out))
    want_values = numpy_reference.values(x, layer_out, params, config, w_in, w_out)

    def perturbed(name, noise):
        inputs = (x, layer_out, params, w_in, w_out)
        x_, lo_, params_, w_in_, w_out_ = (round_by_one_unit(noise, v) for v in inputs)
        return numpy_reference.values(x_, lo_, params_, config, w_in_, w_out_, noise=noise)[name]

    for name, got in got_values.items():
        tolerance = TOLERANCE[jnp.bfloat16 if got.dtype == jnp.bfloat16 else jnp.float32]
        assert np.isfinite(np.asarray(jnp.asarray(got, jnp.float32))).all(), (
            f"{name}: non-finite value from finite inputs"
        )
        resample = lambda noise, name=name: perturbed(name, noise)  # noqa: E731
        assert_matches(name, got, want_values[name], tolerance, resample, f"(seed {seed})")


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

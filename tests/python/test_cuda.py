"""The CUDA custom calls: registered wherever the _mhc_cuda module was built, and on a GPU the
kernel path runs there and matches the plain path. (On a GPU machine scripts/gpu_check.sh also
runs test_kernels_vs_reference.py, which then checks every output and gradient on the GPU.)"""

import jax
import jax.numpy as jnp
import pytest

import mhc.jax as mj
from conftest import random_params, relative_error
from mhc import _ffi

needs_cuda_module = pytest.mark.skipif(_ffi._mhc_cuda is None, reason="built without CUDA")


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@needs_cuda_module
def test_cuda_targets_registered():
    assert _ffi.CUDA_TARGETS == _ffi.TARGET_NAMES  # every CPU target has its CUDA twin
    assert isinstance(_ffi._mhc_cuda.device_available(), bool)


@needs_cuda_module
@pytest.mark.skipif(not _gpus(), reason="no GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_path_runs_on_the_gpu(seed, dtype):
    gpu = _gpus()[0]
    config = mj.Config(n=4)
    t, d = 37, 136
    kx, kp, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.device_put(jax.random.normal(kx, (t, 4, d), jnp.float32).astype(dtype), gpu)
    params = jax.device_put(random_params(kp, config, d), gpu)
    g = jax.device_put(jax.random.normal(kg, (t, 4, d), jnp.float32).astype(dtype), gpu)

    def loss(x, params, use_kernel):
        layer_in, ctx = mj.pre(x, params, config, use_kernel=use_kernel)
        out = mj.post(jnp.tanh(layer_in), ctx)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

    kernel = jax.jit(jax.grad(lambda x, p: loss(x, p, True), argnums=(0, 1)))
    assert "mhc_pre_backward" in kernel.lower(x, params).as_text()
    with jax.default_matmul_precision("highest"):
        dx_k, dp_k = kernel(x, params)
        dx_r, dp_r = jax.jit(jax.grad(lambda x, p: loss(x, p, False), argnums=(0, 1)))(x, params)
    assert dx_k.devices() == {gpu}
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert relative_error(dx_k, dx_r) <= tol
    for field in mj.Params._fields:
        if field == "alpha":  # three cancelling sums over all tokens: an absolute floor applies
            continue
        assert relative_error(getattr(dp_k, field), getattr(dp_r, field)) <= tol, field

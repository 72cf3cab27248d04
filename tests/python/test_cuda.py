"""The CUDA custom calls: registered wherever the _mhc_cuda module was built, and on a GPU the
kernel path runs there; its results and the CPU's each match the float64 oracle. (On a GPU
machine scripts/gpu_check.sh also runs a subset of test_kernels_vs_reference.py, which then
checks the outputs and gradients on the GPU.)

Without the CUDA module or a GPU these tests skip, except under MHC_REQUIRE_CUDA=1 (set by
scripts/gpu_check.sh): then each of those conditions fails the test that needs it, so a GPU run
cannot pass by skipping.

STATUS: the GPU tests have not run yet (no GPU where they were written).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
from conftest import (
    assert_chain_matches,
    assert_matches,
    assert_sublayer_matches_reference,
    chain_values,
    head_loss_values,
    perturbed_chain_values,
    random_params,
    round_by_one_unit,
    sublayer_values,
)
from mhc import _ffi

REQUIRED = os.environ.get("MHC_REQUIRE_CUDA") == "1"


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def _need(condition: bool, reason: str):
    """Skips without `condition`, or fails under MHC_REQUIRE_CUDA=1."""
    if condition:
        return
    if REQUIRED:
        pytest.fail(f"MHC_REQUIRE_CUDA=1: {reason}")
    pytest.skip(reason)


def test_cuda_targets_registered():
    _need(_ffi._mhc_cuda is not None, "built without CUDA (no _mhc_cuda module)")
    # Every CPU target has its CUDA twin but the fused boundary, which on a GPU runs as the
    # separate operations (test_boundary_falls_back_to_separate_calls_on_the_gpu), and the head,
    # which raises there with use_kernel=True (test_head_on_the_gpu_raises_unless_asked_for_plain).
    cpu_only = {"mhc_boundary_forward", "mhc_boundary_backward", "mhc_head_forward", "mhc_head_backward"}
    # DeepSeek-V4.1's carried-mix operations: CPU only this round.
    cpu_only |= {name for name in _ffi.TARGET_NAMES if "carried" in name or name.startswith("mhc_collapse_")}
    assert set(_ffi.CUDA_TARGETS) == set(_ffi.TARGET_NAMES) - cpu_only
    assert isinstance(_ffi._mhc_cuda.device_available(), bool)


def test_boundary_falls_back_to_separate_calls_on_the_gpu(seed):
    """mhc.jax.sublayer on a GPU: the compiled program holds the separate pre/post custom calls
    (no CUDA boundary kernel yet; fallback="allow" runs them without the warning, which
    test_dispatch.py checks) and the values match the CPU's fused boundary."""
    _need(_ffi._mhc_cuda is not None, "built without CUDA (no _mhc_cuda module)")
    _need(bool(_gpus()), "no GPU")
    config = mj.Config(n=4)
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (64, 4, 256), jnp.float32)
    layers = [random_params(k, config, 256) for k in keys[1:]]

    def loss(x, layers):
        state = x
        for params in layers:
            state = mj.sublayer(state, params, config, jnp.tanh, fallback="allow")
        return jnp.sum(mj.finish(state) ** 2)

    program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    gpu, cpu = _gpus()[0], jax.devices("cpu")[0]
    on_gpu = [jax.device_put(a, gpu) for a in (x, layers)]
    hlo = program.lower(*on_gpu).compile().as_text()
    assert "mhc_boundary" not in hlo and "mhc_pre_backward" in hlo
    # The GPU's separate calls and the CPU's fused boundary, each against the float64 chain with
    # the one accuracy rule, never with each other.
    sublayers = [(params, config, jnp.tanh) for params in layers]

    def dout(out):
        return 2.0 * out

    def square_loss(rng=None):
        values = chain_values(x, sublayers, dout) if rng is None else perturbed_chain_values(rng, x, sublayers, dout)
        return np.sum(np.square(values[0]))

    with jax.default_matmul_precision("highest"):
        for device in (gpu, cpu):
            loss_value, (dx, dlayers) = program(*(jax.device_put(a, device) for a in (x, layers)))
            context = f"{device.platform} (seed {seed})"
            assert_matches("loss", loss_value, square_loss(), 1e-5, square_loss, context)
            assert_chain_matches({"dx": dx, "dparams": dlayers}, x, sublayers, dout, context)


def test_head_on_the_gpu_raises_unless_asked_for_plain(seed):
    """mhc.jax.head on a GPU (no CUDA head kernel; unverified: no GPU has run it): use_kernel=True
    raises the mhc error; use_kernel=False runs the plain formulas there, whose values and
    gradients match the CPU's head kernel."""
    _need(bool(_gpus()), "no GPU")
    config = mj.Config(n=4)
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (64, 4, 256), jnp.float32)
    head = mj.init_head_params(keys[1], config, 256)._replace(scale=jnp.array([0.9], jnp.float32))

    def program(use_kernel):
        loss = lambda x, head: jnp.sum(mj.head(x, head, config, use_kernel=use_kernel) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    gpu, cpu = _gpus()[0], jax.devices("cpu")[0]
    on_gpu = [jax.device_put(a, gpu) for a in (x, head)]
    with pytest.raises(NotImplementedError, match=r"mhc\.jax\.head: .*'cuda'.*use_kernel=False"):
        program(True).lower(*on_gpu)
    assert "mhc_head" not in program(False).lower(*on_gpu).compile().as_text()

    # The GPU's plain formulas and the CPU's head kernel, each against the float64 head with the
    # one accuracy rule, never with each other.
    def oracle(rng=None):
        moved = (x, head) if rng is None else (round_by_one_unit(rng, v) for v in (x, head))
        values = head_loss_values(*moved, config, 0.0, rng)
        return values["loss"], (values["dx"], values["dhead"])

    with jax.default_matmul_precision("highest"):
        results = {
            "gpu plain": program(False)(*on_gpu),
            "cpu kernel": program(True)(*(jax.device_put(a, cpu) for a in (x, head))),
        }
    wanted = jax.tree.leaves(oracle())
    for label, got in results.items():
        for index, (value, want) in enumerate(zip(jax.tree.leaves(got), wanted, strict=True)):

            def perturbed(rng, index=index):
                return jax.tree.leaves(oracle(rng))[index]

            assert_matches(f"leaf {index}", value, want, 1e-5, perturbed, f"{label} (seed {seed})")


def test_default_device_is_the_gpu():
    """The GPU run's other tests use jax's default device: it must be the GPU, with the module's
    device check agreeing."""
    _need(jax.devices()[0].platform == "gpu", f"jax's default device is {jax.devices()[0]}, not a GPU")
    _need(_ffi._mhc_cuda is not None, "built without CUDA (no _mhc_cuda module)")
    assert _ffi._mhc_cuda.device_available()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_path_runs_on_the_gpu(seed, dtype):
    _need(_ffi._mhc_cuda is not None, "built without CUDA (no _mhc_cuda module)")
    _need(bool(_gpus()), "no GPU")
    gpu = _gpus()[0]
    config = mj.Config(n=4)
    t, d = 37, 136
    kx, klo, kp, kin, kout = jax.random.split(jax.random.key(seed), 5)
    put = lambda a: jax.device_put(a, gpu)  # noqa: E731
    x = put(jax.random.normal(kx, (t, 4, d), jnp.float32).astype(dtype))
    # layer_out is an input of its own (not computed from layer_in): the oracle's inputs are the
    # paths' own.
    layer_out = put(jax.random.normal(klo, (t, d), jnp.float32).astype(dtype))
    params = put(random_params(kp, config, d))
    w_in = put(jax.random.normal(kin, (t, d), jnp.float32).astype(dtype))
    w_out = put(jax.random.normal(kout, (t, 4, d), jnp.float32).astype(dtype))

    def run(use_kernel):
        def f(x, layer_out, params):
            layer_in, ctx = mj.pre(x, params, config, use_kernel=use_kernel)
            return layer_in, mj.post(layer_out, ctx)

        outputs, vjp = jax.vjp(f, x, layer_out, params)
        return outputs, vjp((w_in, w_out))

    hlo = jax.jit(lambda: run(True)).lower().as_text()
    for target in ("mhc_pre_forward", "mhc_post_forward", "mhc_post_backward", "mhc_pre_backward"):
        assert target in hlo, target
    # Each path against the float64 oracle with the one accuracy rule (the spec's bound by each
    # tensor's dtype), never with each other.
    cotangents = (w_in, w_out)
    for use_kernel in (True, False):
        with jax.default_matmul_precision("highest"):
            values = sublayer_values(x, layer_out, params, config, cotangents, use_kernel=use_kernel)
        assert values["out"].devices() == {gpu} and values["dx"].devices() == {gpu}
        context = f"use_kernel={use_kernel} (seed {seed})"
        assert_sublayer_matches_reference(values, x, layer_out, params, config, cotangents, context)

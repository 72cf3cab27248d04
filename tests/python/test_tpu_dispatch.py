"""mhc.jax, mhc.flax and mhc.models on the TPU path, without a TPU: under the test switch
mhc.tpu.testing.interpret_on_cpu the CPU lowering dispatches as a TPU would (mhc.tpu.KERNELS in
Pallas's interpreter, the TPU's error for what has no kernel), through the same custom VJPs and
partitioning rules. Each result must equal the CPU kernels' within the spec's bounds.

What the TPU backend has is read from its table (mhc.tpu.KERNELS), never listed here: a test of
an operation whose TPU kernel does not exist yet asserts the mhc NotImplementedError instead, and
checks the values the day the kernel lands.
"""

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mhc.jax as mj
import mhc.tpu
import numpy_reference
from conftest import (
    assert_chain_matches,
    assert_matches,
    assert_sublayer_matches_reference,
    random_params,
    round_by_one_unit,
    sublayer_values,
)
from mhc.flax import ManifoldConstrainedHyperConnections
from mhc.jax import _kernels
from mhc.models import ModelConfig, Transformer
from mhc.tpu import testing as tpu_testing
from mhc.tpu.testing import interpret_on_cpu
from model_reference import assert_logits_match

# The TPU kernels in Pallas's interpreter: slow (pyproject.toml, markers); make check skips this file.
pytestmark = pytest.mark.slow

# (n, D, T, mix, dtype): D = 130 pads to 256 lanes, T = 37 is one ragged token tile.
CASES = [(4, 130, 37, "sinkhorn", jnp.float32), (3, 1, 5, "permutations", jnp.bfloat16)]


def _tpu_has(*targets) -> bool:
    """Whether the TPU backend's table has these kernels (read directly, not through the dispatch)."""
    return set(targets) <= set(mhc.tpu.KERNELS)


def _no_tpu_kernel(operation: str):
    return pytest.raises(NotImplementedError, match=rf"mhc\.jax\.{operation}: mhc has no kernel for platform 'tpu'")


def _case_id(case):
    return "-".join(str(getattr(v, "__name__", v)) for v in case)


def _inputs(seed, case):
    n, d, t, mix, dtype = case
    config = mj.Config(n=n, mix=mix, sinkhorn_iters=7, pre_eps=0.1, post_scale=1.3)
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (t, n, d)).astype(dtype)
    layer_out = jax.random.normal(keys[1], (t, d)).astype(dtype)
    cotangents = (jax.random.normal(keys[2], (t, d)).astype(dtype), jax.random.normal(keys[3], (t, n, d)).astype(dtype))
    return config, x, layer_out, random_params(keys[4], config, d), cotangents


def test_the_switch_is_off_unless_entered():
    assert tpu_testing.interpret_params is None
    with interpret_on_cpu():
        assert tpu_testing.interpret_params is not None
        with pytest.raises(RuntimeError, match="does not nest"), interpret_on_cpu():
            pass
    assert tpu_testing.interpret_params is None
    with pytest.raises(KeyError), interpret_on_cpu():
        raise KeyError("an error inside")
    assert tpu_testing.interpret_params is None


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_pre_and_post_match_the_cpu_kernels(seed, case):
    config, x, layer_out, params, cotangents = _inputs(seed, case)
    context = f"(seed {seed}, {_case_id(case)})"

    def forward(x, layer_out, params):
        layer_in, ctx = mj.pre(x, params, config)
        return layer_in, mj.post(layer_out, ctx)

    def post_only(layer_out):  # gradient wrt layer_out: post's backward alone
        return jax.vjp(lambda lo: forward(x, lo, params)[1], layer_out)[1](cotangents[1])[0]

    # Each path against the float64 oracle (spec: Accuracy), never the two f32 paths at a bound.
    def check(got):
        assert_sublayer_matches_reference(got, x, layer_out, params, config, cotangents, context)

    check(dict(zip(("layer_in", "out"), jax.jit(forward)(x, layer_out, params), strict=True)))
    check({"dlayer_out": jax.jit(post_only)(layer_out)})
    if _tpu_has("mhc_pre_backward"):
        check(sublayer_values(x, layer_out, params, config, cotangents))
    assert "@mhc_pre_forward" in jax.jit(forward).lower(x, layer_out, params).as_text()
    with interpret_on_cpu():
        # Everything on the TPU path: not one custom call of the CPU kernels.
        assert "@mhc_" not in jax.jit(forward).lower(x, layer_out, params).as_text()
        check(dict(zip(("layer_in", "out"), jax.jit(forward)(x, layer_out, params), strict=True)))
        check({"dlayer_out": jax.jit(post_only)(layer_out)})
        if not _tpu_has("mhc_pre_backward"):
            with _no_tpu_kernel("pre"):
                sublayer_values(x, layer_out, params, config, cotangents)
        else:
            check(sublayer_values(x, layer_out, params, config, cotangents))


def test_a_function_compiled_outside_runs_the_tpu_kernels_inside(monkeypatch):
    """The switch is in JAX's cache keys: a jitted function compiled before it is traced again, and
    reaches the TPU kernel (here one that writes 7 everywhere, a value the CPU kernel does not
    give, to tell which ran); after it, the CPU's again, bit for bit."""
    _, x, layer_out, params, _ = _inputs(0, CASES[0])
    h_post, h_res = jnp.ones(x.shape[:2]), jnp.ones(x.shape[:2] + x.shape[1:2])
    post = jax.jit(lambda x, lo: mj.post(lo, mj.Context(x, h_post, h_res, mj.Config(n=x.shape[1]), True)))
    before = post(x, layer_out)
    kernel = mhc.tpu.KERNELS["mhc_post_forward"]
    monkeypatch.setitem(mhc.tpu.KERNELS, "mhc_post_forward", lambda *a, **k: jnp.full_like(kernel(*a, **k), 7.0))
    with interpret_on_cpu():
        inside = post(x, layer_out)
    assert not np.any(np.asarray(before) == 7.0)
    np.testing.assert_array_equal(inside, np.full(before.shape, 7.0, np.float32))
    np.testing.assert_array_equal(post(x, layer_out), before)


def test_an_operation_the_table_lacks_raises_the_tpu_error(monkeypatch):
    """Without its KERNELS entry (as before a kernel lands), an operation raises the mhc error on
    the TPU path, at lowering, whatever else runs; it never runs the CPU kernel instead."""
    config, x, _, params, _ = _inputs(0, CASES[0])
    monkeypatch.delitem(mhc.tpu.KERNELS, "mhc_pre_backward", raising=False)
    gradient = jax.jit(jax.grad(lambda x, params: jnp.sum(mj.pre(x, params, config)[0])))
    with interpret_on_cpu():
        jax.jit(lambda x, params: mj.pre(x, params, config)[0])(x, params)  # the forward has its kernel
        with _no_tpu_kernel("pre"):
            gradient(x, params)
    with _no_tpu_kernel("pre"):
        jax.export.export(gradient, platforms=["tpu"])(x, params)


def _chain(config, sublayers: int, fallback: str):
    def run(x, layers):
        state = x
        for params in layers:
            state = mj.sublayer(state, params, config, jnp.tanh, fallback=fallback)
        return mj.finish(state)

    return run


def _chain_problem(seed, sublayers=3):
    config, x, _, _, _ = _inputs(seed, CASES[0])
    keys = jax.random.split(jax.random.key(seed + 1), sublayers + 1)
    layers = [random_params(k, config, x.shape[-1]) for k in keys[:-1]]
    w = jax.random.normal(keys[-1], x.shape)
    return config, x, layers, w


def test_the_chain_matches_the_cpu_kernels(seed):
    """sublayer/finish over three sublayers (two boundaries): the streams, and the gradients wrt x
    and every layer's parameters (the sublayers' outputs, layer_out, carry them)."""
    config, x, layers, w = _chain_problem(seed)
    fused = _tpu_has("mhc_boundary_forward", "mhc_boundary_backward")
    run = _chain(config, len(layers), "error" if fused else "allow")

    def gradient(x, layers):
        return jax.grad(lambda x, layers: jnp.sum(run(x, layers) * w), argnums=(0, 1))(x, layers)

    sublayers = [(p, config, jnp.tanh) for p in layers]

    def check(got, path):  # each path against the float64 chain, never the two at a bound
        assert_chain_matches(got, x, sublayers, w, f"({path}, seed {seed})")

    dx, dlayers = jax.jit(gradient)(x, layers)
    check({"out": jax.jit(run)(x, layers), "dx": dx, "dparams": dlayers}, "CPU kernels")
    with interpret_on_cpu():
        check({"out": jax.jit(run)(x, layers)}, "TPU path")
        backward = ("mhc_boundary_backward",) if fused else ("mhc_pre_backward", "mhc_post_backward")
        if not _tpu_has("mhc_pre_backward", *backward):
            with pytest.raises(NotImplementedError, match=r"mhc\.jax\.(pre|boundary): .*'tpu'"):
                jax.jit(gradient)(x, layers)
            return
        dx, dlayers = jax.jit(gradient)(x, layers)
    check({"dx": dx, "dparams": dlayers}, "TPU path")


@pytest.mark.usefixtures("fresh_warnings")
def test_the_boundary_on_the_tpu_path():
    """As on a GPU: fused where KERNELS has the boundary, else the post and pre kernels (warned
    once), or the error that fallback='error' asks for."""
    config, x, layers, w = _chain_problem(0, sublayers=2)
    with interpret_on_cpu(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if _tpu_has("mhc_boundary_forward"):
            got = jax.jit(_chain(config, 2, "error"))(x, layers)
            assert not [w for w in caught if "mhc" in str(w.message)]
        else:
            with pytest.raises(NotImplementedError, match=r"mhc\.jax\.boundary: no fused kernel for platform 'tpu'"):
                jax.jit(_chain(config, 2, "error"))(x, layers)
            got = jax.jit(_chain(config, 2, "warn"))(x, layers)
            messages = [str(w.message) for w in caught if "mhc" in str(w.message)]
            assert len(messages) == 1 and "separate post and pre kernels" in messages[0], messages
    assert_chain_matches({"out": got}, x, [(p, config, jnp.tanh) for p in layers], w, "(TPU path)")


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_kernels.dispatch, "_warned", set())


def test_the_flax_layer_matches_the_cpu_kernels(seed):
    config, d = mj.Config(n=4, sinkhorn_iters=5, pre_eps=0.1, post_scale=1.3), 24
    layer = ManifoldConstrainedHyperConnections(config, d, rngs=nnx.Rngs(seed))
    layer.alpha[...] = jnp.array([0.9, -1.1, 1.3])  # non-trivial coefficients
    layer.bias[...] = jax.random.normal(jax.random.key(seed + 7), layer.bias[...].shape)
    x = jax.random.normal(jax.random.key(seed + 1), (2, 5, 4, d))
    w = jax.random.normal(jax.random.key(seed + 2), x.shape)

    def forward(layer, x):
        return layer(lambda h: h, jnp.tanh, x)

    def grads(layer, x):
        return nnx.grad(lambda layer, x: jnp.sum(forward(layer, x) * w), argnums=(0, 1))(layer, x)

    def gradients(grads):
        return {"dx": grads[1], "dparams": [[grads[0][name][...] for name in mj.Params._fields]]}

    # Each path against the float64 chain with the one accuracy rule, never the two at a bound.
    sublayer = [(layer.params(), config, jnp.tanh)]

    def check(got, path):
        assert_chain_matches(got, x, sublayer, w, f"({path}, seed {seed})")

    check({"out": nnx.jit(forward)(layer, x), **gradients(nnx.jit(grads)(layer, x))}, "CPU kernels")
    with interpret_on_cpu():
        check({"out": nnx.jit(forward)(layer, x)}, "TPU path")
        if not _tpu_has("mhc_pre_backward"):
            with _no_tpu_kernel("pre"):
                nnx.jit(grads)(layer, x)
            return
        got = gradients(nnx.jit(grads)(layer, x))
    check(got, "TPU path")


def test_the_head_matches_the_cpu_kernels(seed):
    """V4's head: the value and the gradients wrt x and its parameters."""
    config = mj.Config(n=4, pre_eps=0.1)
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (2, 5, 4, 24))
    head = mj.init_head_params(keys[1], config, 24)
    head = jax.tree.map(
        lambda p, k: p + 0.5 * jax.random.normal(k, p.shape), head, mj.HeadParams(*jax.random.split(keys[2], 3))
    )
    w = jax.random.normal(keys[2], (2, 5, 24))

    def value_and_grads(x, head):
        return jax.value_and_grad(lambda x, head: jnp.sum(mj.head(x, head, config) * w), argnums=(0, 1))(x, head)

    # Each path against numpy_reference.head_values with the one accuracy rule (the loss, a
    # random-weighted sum that cancels, is not compared).
    want = numpy_reference.head_values(x, head, config, w)

    def check(path):
        out = jax.jit(lambda x, head: mj.head(x, head, config))(x, head)
        _, (dx, dhead) = jax.jit(value_and_grads)(x, head)
        for index, (name, value) in enumerate(
            zip(("out", "dx", "dfn", "dbase", "dscale"), (out, dx, *dhead), strict=True)
        ):
            moved = lambda rng, i=index: numpy_reference.head_values(  # noqa: E731
                *(round_by_one_unit(rng, a) for a in (x, head)), config, round_by_one_unit(rng, w), rng
            )[i]
            assert_matches(name, value, want[index], 1e-5, moved, f"({path}, seed {seed})")

    check("CPU kernels")
    with interpret_on_cpu():
        if not _tpu_has("mhc_head_forward", "mhc_head_backward"):
            with _no_tpu_kernel("head"):
                jax.jit(value_and_grads)(x, head)
            return
        check("TPU path")


def test_a_tiny_transformer_forward_matches_the_cpu_kernels(seed):
    """mhc.models: fused boundaries (or their fallback) and V4's head where the TPU has it; the
    summed streams otherwise, the head then raising the mhc error."""
    has_head = _tpu_has("mhc_head_forward")
    config = ModelConfig(vocab=32, width=16, layers=1, heads=2, n=4, collapse="head" if has_head else "sum")
    model = Transformer(config, rngs=nnx.Rngs(seed))
    tokens = jax.random.randint(jax.random.key(seed), (2, 7), 0, config.vocab)
    on_cpu = nnx.jit(lambda m, t: m(t))(model, tokens)
    with interpret_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the boundary's fallback warning, tested above
        got = nnx.jit(lambda m, t: m(t))(model, tokens)
        if not has_head:
            head = mj.init_head_params(jax.random.key(seed), config.mhc_config(), config.width)
            with _no_tpu_kernel("head"):
                jax.jit(lambda x, p: mj.head(x, p, config.mhc_config()))(jnp.ones((2, 7, 4, 16)), head)
    assert_logits_match({"CPU kernels": on_cpu, "TPU path": got}, model, tokens, f"(seed {seed})")


def test_tokens_sharded_over_two_devices(seed):
    """Plain jax.jit on arrays sharded over two CPU devices, on the TPU path (tpu_dispatch_cases.py,
    in a subprocess: the device count is fixed when JAX starts)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    script = os.path.join(os.path.dirname(__file__), "tpu_dispatch_cases.py")
    result = subprocess.run([sys.executable, script, str(seed)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"seed {seed}\n{result.stdout}\n{result.stderr[-4000:]}"
    assert result.stdout.count("ok:") == 3, result.stdout


def test_d_split_over_two_and_four_devices(seed):
    """D split over 2 and 4 devices on the TPU path (the split forms' kernels), under plain jax.jit
    and inside jax.shard_map with tensor_axis, V4 and V4.1, values and VJP against one device; a
    chain of two sublayers on 2 (tpu_dispatch_cases.check_d_split, in a subprocess)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    script = os.path.join(os.path.dirname(__file__), "tpu_dispatch_cases.py")
    command = [sys.executable, script, str(seed), "split"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"seed {seed}\n{result.stdout}\n{result.stderr[-4000:]}"
    assert result.stdout.count("ok:") == 12, result.stdout

"""The functional API around the kernels: helpers, T = 0, bad input, jit/vmap, and a short
training run of a whole sublayer with and without the kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
from conftest import assert_chain_matches, assert_matches, chain_values, random_params, round_by_one_unit


def test_expand_and_reduce():
    h = jnp.arange(6.0).reshape(2, 3)
    x = mj.expand(h, 4)
    assert x.shape == (2, 4, 3)
    np.testing.assert_array_equal(mj.reduce(x), 4 * h)


def test_init_params_layout():
    config = mj.Config(n=4)
    params = mj.init_params(jax.random.key(0), config, 8)
    assert params.norm_weight.shape == (32,) and params.phi.shape == (32, 24)
    assert params.bias.shape == (24,) and params.alpha.shape == (3,)
    np.testing.assert_allclose(params.alpha, 0.01)
    np.testing.assert_array_equal(params.bias, 0.0)
    np.testing.assert_array_equal(params.norm_weight, 1.0)
    assert 0.5 < float(jnp.std(params.phi)) * np.sqrt(32) < 1.5


@pytest.mark.parametrize("use_kernel", [True, False])
def test_zero_tokens(use_kernel):
    config = mj.Config(n=3)
    params = random_params(jax.random.key(1), config, 5)
    x = jnp.zeros((0, 3, 5), jnp.float32)

    def loss(x, params):
        layer_in, ctx = mj.pre(x, params, config, use_kernel=use_kernel)
        return mj.post(layer_in, ctx).sum()

    value, (dx, dparams) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, params)
    assert float(value) == 0.0 and dx.shape == x.shape
    for grad in dparams:
        np.testing.assert_array_equal(grad, 0.0)


def test_bad_input_raises_before_any_call():
    config = mj.Config(n=4)
    params = random_params(jax.random.key(0), config, 8)
    x = jnp.ones((3, 4, 8))
    with pytest.raises(ValueError, match="x: expected 4 streams"):
        mj.pre(jnp.ones((3, 3, 8)), params, config)
    with pytest.raises(ValueError, match="rank >= 2"):
        mj.pre(jnp.ones((8,)), params, config)
    with pytest.raises(TypeError, match="x: expected dtype float32 or bfloat16, got int32"):
        mj.pre(jnp.ones((3, 4, 8), jnp.int32), params, config)
    with pytest.raises(TypeError, match="float32 or bfloat16, got float16"):
        mj.pre(jnp.ones((3, 4, 8), jnp.float16), params, config)
    with pytest.raises(ValueError, match=r"params.norm_weight: expected shape \(36,\)"):
        mj.pre(jnp.ones((3, 4, 9)), params, config)  # D mismatch between x and params
    with pytest.raises(ValueError, match="params.bias"):
        mj.pre(x, params._replace(bias=jnp.zeros(23)), config)
    with pytest.raises(TypeError, match="params.alpha: expected dtype float32"):
        mj.pre(x, params._replace(alpha=params.alpha.astype(jnp.bfloat16)), config)
    with pytest.raises(ValueError, match=r"Config.n: expected an int in 1..6 for mix='permutations'"):
        mj.Config(n=7, mix="permutations")
    with pytest.raises(ValueError, match="Config.mix"):
        mj.Config(n=4, mix="dense")
    with pytest.raises(ValueError, match="Config.sinkhorn_iters"):
        mj.Config(n=4, sinkhorn_iters=0)
    with pytest.raises(ValueError, match="Config.rms_eps"):
        mj.Config(n=4, rms_eps=0.0)
    _, ctx = mj.pre(x, params, config)
    with pytest.raises(ValueError, match=r"layer_out: expected shape \(3, 8\)"):
        mj.post(jnp.ones((3, 7)), ctx)
    with pytest.raises(TypeError, match="ctx: expected the Context"):
        mj.post(jnp.ones((3, 8)), (x, None, None))


@pytest.mark.slow  # over 5 s of CPU at -n 0 (pyproject.toml, markers; docs/testing.md, Fast tier)
def test_vmap_over_a_batch_axis(seed):
    config = mj.Config(n=3, sinkhorn_iters=3, pre_eps=0.1, sinkhorn_eps=0.05, rms_eps=0.5, post_scale=1.3)
    params = random_params(jax.random.key(seed), config, 6)
    x = jax.random.normal(jax.random.key(seed + 1), (3, 5, 3, 6))

    def one(xb):
        layer_in, ctx = mj.pre(xb, params, config)
        return mj.post(jnp.tanh(layer_in), ctx)

    def one_reference(xb):
        layer_in, ctx = mj.pre(xb, params, config, use_kernel=False)
        return mj.post(jnp.tanh(layer_in), ctx)

    # Each path against the float64 sublayer with the one accuracy rule, not against each other.
    for label, path in (("kernel", one), ("plain", one_reference)):
        out = jax.vmap(path)(x)
        assert_chain_matches(
            {"out": out}, x, [(params, config, jnp.tanh)], np.zeros(x.shape), f"({label}, seed {seed})"
        )


def _normed_mlp(layer_in, w1, w2):
    """The sublayer's branch: RMSNorm, then a 2-layer GELU MLP (jnp: f32 here, float64 in the oracle)."""
    normed = layer_in * jax.lax.rsqrt(jnp.mean(layer_in**2, -1, keepdims=True) + 1e-6)
    return jax.nn.gelu(normed @ w1) @ w2


def _train_float64(state, x, target, config, steps, noise=None):
    """The SGD run of test_training_a_sublayer_matches_the_reference in float64 (conftest.chain_values
    for pre -> branch -> post and its gradients): the loss before each step."""
    target = np.asarray(target, np.float64)
    params, w1, w2 = state["mhc"], np.asarray(state["w1"], np.float64), np.asarray(state["w2"], np.float64)
    losses = []
    for _ in range(steps):
        sublayers = [(params, config, _normed_mlp, (w1, w2))]
        out, _, (dparams,), ((dw1, dw2),) = chain_values(
            x, sublayers, lambda out: 2.0 * (out - target) / out.size, noise
        )
        losses.append(np.mean((out - target) ** 2))
        params = mj.Params(*(np.asarray(p, np.float64) - 0.1 * g for p, g in zip(params, dparams, strict=True)))
        w1, w2 = w1 - 0.1 * dw1, w2 - 0.1 * dw2
    return np.array(losses)


@pytest.mark.slow  # over 5 s of CPU at -n 0 (pyproject.toml, markers; docs/testing.md, Fast tier)
def test_training_a_sublayer_matches_the_reference(seed):
    """pre -> RMSNorm -> 2-layer MLP -> post, SGD for a few steps, kernel and plain JAX each
    against the same run in float64 (the one accuracy rule on the loss history)."""
    n, d, hidden = 4, 32, 64
    config = mj.Config(n=n, sinkhorn_iters=5, pre_eps=0.1, sinkhorn_eps=0.05, post_scale=1.3)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    state = {
        "mhc": random_params(k1, config, d),
        "w1": jax.random.normal(k2, (d, hidden)) / np.sqrt(d),
        "w2": jax.random.normal(k3, (hidden, d)) / np.sqrt(hidden),
    }
    x = jax.random.normal(k4, (4, 16, n, d))
    target = jnp.roll(x, 1, axis=-2)

    def loss(state, use_kernel):
        layer_in, ctx = mj.pre(x, state["mhc"], config, use_kernel=use_kernel)
        out = mj.post(_normed_mlp(layer_in, state["w1"], state["w2"]), ctx)
        return jnp.mean((out - target) ** 2)

    step = jax.jit(lambda s, k: _sgd(loss, s, k), static_argnums=1)
    want = _train_float64(state, x, target, config, steps=8)

    def perturbed(rng):
        moved = {"mhc": round_by_one_unit(rng, state["mhc"])}
        moved.update({name: round_by_one_unit(rng, state[name]) for name in ("w1", "w2")})
        return _train_float64(moved, round_by_one_unit(rng, x), target, config, steps=8, noise=rng)

    for use_kernel in (True, False):
        s, history = state, []
        for _ in range(8):
            value, s = step(s, use_kernel)
            history.append(float(value))
        assert history[-1] < history[0], "training did not reduce the loss"
        assert_matches("losses", np.array(history), want, 1e-5, perturbed, f"(use_kernel={use_kernel}, seed {seed})")


def _sgd(loss, state, use_kernel):
    value, grads = jax.value_and_grad(loss)(state, use_kernel)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)


def test_thread_count_knob():
    import mhc

    default = mhc.num_threads()
    assert default >= 1
    try:
        mhc.set_num_threads(1)
        assert mhc.num_threads() == 1
        x = jnp.ones((3, 2, 8))
        params = mj.init_params(jax.random.key(0), mj.Config(n=2), 8)
        layer_in, _ = mj.pre(x, params, mj.Config(n=2))
        assert np.isfinite(np.asarray(layer_in)).all()
    finally:
        mhc.set_num_threads(0)
    assert mhc.num_threads() == default

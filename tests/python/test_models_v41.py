"""DeepSeek-V4.1's structure in mhc.flax and mhc.models (spec: Single-pass schedule): the Flax
layer carries the pre mix, the Flax stack fused and whole give the same bits, the layer's kernel
path matches its plain path, ModelConfig's "mhc-v4.1" residual (no head, the carried collapse)
and what it refuses, and the model's gradients on the kernels against the plain path and with
recompute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mhc.jax as mj
from conftest import assert_chain_matches, assert_recompute_keeps_the_mhc_bits
from mhc.flax import ManifoldConstrainedHyperConnections, stack
from mhc.models import ModelConfig, Transformer, loss_fn
from model_reference import assert_model_gradients_match

TINY = dict(width=16, layers=2, heads=2, n=4)


def rms_norm(h):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def v41_layers(seed, d, count, use_kernel, n=4):
    """``count`` V4.1 layers with non-trivial coefficients (alpha of order 1, random bias)."""
    config = mj.Config(n=n, pre_from_previous=True)
    layers = []
    for k in range(count):
        layer = ManifoldConstrainedHyperConnections(config, d, use_kernel=use_kernel, rngs=nnx.Rngs(seed + k))
        layer.alpha[...] = jnp.array([0.9, -1.1, 1.3])
        layer.bias[...] = jax.random.normal(jax.random.key(seed + 100 + k), layer.bias[...].shape)
        layers.append(layer)
    return nnx.List(layers)


def collapsed(layers, x, fused):
    """The layers as one mhc.flax.stack (each post fused with the next pre, or each layer whole),
    ended by V4.1's collapse."""
    state = stack(x, [(layer, rms_norm, jnp.tanh) for layer in layers], fuse_boundaries=fused)
    return mj.collapse(state, use_kernel=layers[0].use_kernel)


@pytest.mark.slow  # 17 s of CPU (pyproject.toml, markers)
def test_the_flax_layer_carries_the_mix(seed):
    """Whole layers hand on Streams(out, h_pre); the layer equals mhc.jax's pre (with the carried
    mix) and post on the same parameters, and the fused stack equals the whole layers bit for bit,
    values and gradients (the kernel path; the plain path agrees to f32 rounding)."""
    d = 8
    x = jax.random.normal(jax.random.key(seed + 1), (2, 3, 4, d))
    layers = v41_layers(seed, d, 3, use_kernel=True)

    state = x
    want, carried = x, None
    for layer in layers:
        state = layer(rms_norm, jnp.tanh, state)
        assert isinstance(state, mj.Streams) and state.carried.shape == (2, 3, 4)
        layer_in, ctx = mj.pre(want, layer.params(), layer.config, carried=carried)
        want, carried = mj.post(jnp.tanh(rms_norm(layer_in)), ctx), ctx.h_pre
        assert jnp.array_equal(state.x, want) and jnp.array_equal(state.carried, carried)
    assert jnp.array_equal(mj.collapse(state), mj.collapse(mj.Streams(want, carried)))

    fused, whole = collapsed(layers, x, True), collapsed(layers, x, False)
    assert fused.shape == (2, 3, d) and jnp.array_equal(fused, whole), f"seed {seed}"

    def loss(layers, x, fused):
        return jnp.sum(collapsed(layers, x, fused) ** 2)

    grads = {f: nnx.jit(nnx.grad(loss, argnums=(0, 1)), static_argnums=2)(layers, x, f) for f in (True, False)}
    for a, b in zip(jax.tree.leaves(nnx.state(grads[True])), jax.tree.leaves(nnx.state(grads[False])), strict=True):
        assert jnp.array_equal(a, b), f"seed {seed}"

    # The kernel and plain paths each against the float64 V4.1 chain (the one accuracy rule), never
    # the two f32 evaluations with each other.
    plain = v41_layers(seed, d, 3, use_kernel=False)
    sublayers = [(layer.params(), layer.config, lambda h: jnp.tanh(rms_norm(h))) for layer in layers]
    plain_grads = nnx.grad(loss, argnums=(0, 1))(plain, x, True)
    for label, model, (dlayers, dx) in (("kernels", layers, grads[True]), ("plain", plain, plain_grads)):
        dparams = [[dlayers[i][name][...] for name in mj.Params._fields] for i in range(len(model))]
        got = {"out": collapsed(model, x, True), "dx": dx, "dparams": dparams}
        assert_chain_matches(got, x, sublayers, lambda out: 2.0 * out, f"({label}, seed {seed})")


def test_the_flax_layer_and_stack_refuse_a_mixed_schedule(seed):
    d = 8
    v4 = ManifoldConstrainedHyperConnections(mj.Config(n=4), d, rngs=nnx.Rngs(seed))
    (v41,) = v41_layers(seed, d, 1, use_kernel=True)
    x = jnp.ones((3, 4, d), jnp.float32)
    with pytest.raises(TypeError, match=r"x: an mhc\.jax\.Streams carries V4\.1's mix"):
        v4(rms_norm, jnp.tanh, mj.Streams(x, jnp.ones((3, 4), jnp.float32)))
    with pytest.raises(ValueError, match=r"sublayers\[1\]: config\.pre_from_previous=False, but sublayers\[0\]"):
        stack(x, [(v41, rms_norm, jnp.tanh), (v4, rms_norm, jnp.tanh)])


def test_model_config_picks_v41_structure(seed):
    config = ModelConfig(**TINY, residual="mhc-v4.1")
    assert config.final_collapse == "carried" and config.mhc_config().pre_from_previous
    assert ModelConfig(**TINY).final_collapse == "head" and not ModelConfig(**TINY).mhc_config().pre_from_previous
    assert ModelConfig(**TINY, residual="plain").final_collapse is None
    assert ModelConfig(**TINY, residual="mhc-v4.1", collapse="carried").final_collapse == "carried"
    assert ModelConfig(**TINY, residual="mhc-v4.1", recompute=2).recompute == 2
    for collapse in ("head", "sum"):
        with pytest.raises(ValueError, match=r"collapse: residual 'mhc-v4\.1' ends with the sum by the last"):
            ModelConfig(residual="mhc-v4.1", collapse=collapse)
    for residual in ("plain", "hc", "mhc", "mhc-lite"):
        with pytest.raises(ValueError, match=r"collapse: 'carried' .* is DeepSeek-V4\.1's"):
            ModelConfig(residual=residual, collapse="carried")
    with pytest.raises(ValueError, match="recompute: rebuilds mHC's streams with its kernels"):
        ModelConfig(residual="mhc-v4.1", use_kernel=False, recompute=2)

    model = Transformer(config, rngs=nnx.Rngs(seed))
    assert model.collapse is None  # no head parameters
    names = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    v4_names = {
        "/".join(map(str, path))
        for path, _ in nnx.to_flat_state(nnx.state(Transformer(ModelConfig(**TINY), rngs=nnx.Rngs(seed)), nnx.Param))
    }
    assert v4_names - names == {"collapse/fn", "collapse/base", "collapse/scale"}
    assert names <= v4_names


def _randomize(module: nnx.Module, rng: np.random.Generator, scale: float):
    for _path, variable in nnx.iter_graph(module):
        if isinstance(variable, nnx.Param):
            value = np.asarray(variable[...])
            variable[...] = jnp.asarray(value + scale * rng.standard_normal(value.shape), jnp.float32)


@pytest.mark.slow  # three model gradients: 23 s of CPU (pyproject.toml, markers)
def test_v41_model_gradients_on_the_kernels(seed, monkeypatch):
    """The V4.1 model's loss gradients on the kernels (fused boundaries; the flax test above has
    the whole sublayers give the same bits), the plain path's and with recompute (groups of 3
    over 4 sublayers) each against the float64 model (model_reference), recompute's mHC
    parameter gradients the kernels' bits; its mixes doubly stochastic."""
    monkeypatch.setattr(mj, "_cpu_scheduler_warned", True)  # the scheduler is not what this checks
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 256, (2, 8)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 256, (2, 8)), jnp.int32)

    def gradients(**options):
        config = ModelConfig(**TINY, residual="mhc-v4.1", **options)
        model = Transformer(config, rngs=nnx.Rngs(seed))
        _randomize(model, np.random.default_rng(seed), scale=0.1)
        grads = nnx.jit(nnx.grad(loss_fn))(model, tokens, targets)
        return nnx.to_flat_state(nnx.state(grads)), model

    kernel, model = gradients()
    plain, _ = gradients(use_kernel=False)
    recomputed, _ = gradients(recompute=3)
    assert_recompute_keeps_the_mhc_bits(recomputed, kernel, seed)
    evaluations = {"kernels": kernel, "plain": plain, "recompute": recomputed}
    assert_model_gradients_match(evaluations, model, tokens, targets, f"(seed {seed})")
    mixes = model.residual_mixes(tokens)
    assert mixes.shape == (4, 16, 4, 4) and np.abs(mixes.sum(axis=-2) - 1.0).max() < 1e-4

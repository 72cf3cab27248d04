"""The Flax NNX layer: the kernel switch gives the same function and gradients."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import mhc.jax as mj
from conftest import relative_error
from mhc.flax import ManifoldConstrainedHyperConnections


def rms_norm(h):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def make_layers(seed, config, d):
    layers = {}
    for use_kernel in (True, False):
        layer = ManifoldConstrainedHyperConnections(config, d, use_kernel=use_kernel, rngs=nnx.Rngs(seed))
        layer.alpha[...] = jnp.array([0.9, -1.1, 1.3])  # non-trivial coefficients
        layer.bias[...] = jax.random.normal(jax.random.key(seed + 7), layer.bias[...].shape)
        layers[use_kernel] = layer
    return layers


@pytest.mark.parametrize("mix", ["sinkhorn", "permutations"])
def test_kernel_switch_same_outputs_and_grads(seed, mix):
    config, d = mj.Config(n=4, mix=mix, sinkhorn_iters=3, pre_eps=0.1, sinkhorn_eps=0.05, post_scale=1.3), 24
    layers = make_layers(seed, config, d)
    x = jax.random.normal(jax.random.key(seed + 1), (2, 5, 4, d))
    w = jax.random.normal(jax.random.key(seed + 2), (2, 5, 4, d))

    def loss(layer, x):
        return jnp.sum(layer(rms_norm, jnp.tanh, x) * w)

    # Compare the streams, not the scalar loss: a random-weighted sum cancels, and its relative
    # error says nothing about the layer.
    outputs = {k: layer(rms_norm, jnp.tanh, x) for k, layer in layers.items()}
    error = relative_error(outputs[True], outputs[False])
    assert error <= 1e-5, f"outputs: {error:.3g} (seed {seed})"
    grads_k = nnx.grad(loss)(layers[True], x)
    grads_r = nnx.grad(loss)(layers[False], x)
    for name in ("norm_weight", "phi", "alpha", "bias"):
        error = relative_error(getattr(grads_k, name)[...], getattr(grads_r, name)[...])
        assert error <= 1e-5, f"d{name}: {error:.3g} (seed {seed})"


def test_layer_validates_its_arguments():
    with pytest.raises(ValueError, match="pass mesh too"):
        ManifoldConstrainedHyperConnections(mj.Config(n=2), 8, tensor_axis="tensor", rngs=nnx.Rngs(0))


class Stack(nnx.Module):
    """Sublayers chained by ``chain`` (each post fused into the next pre), or called whole."""

    def __init__(self, config, d, layers, seed):
        self.layers = nnx.List(
            [ManifoldConstrainedHyperConnections(config, d, rngs=nnx.Rngs(seed + k)) for k in range(layers)]
        )
        for k, layer in enumerate(self.layers):
            layer.alpha[...] = jnp.array([0.9, -1.1, 1.3])
            layer.bias[...] = jax.random.normal(jax.random.key(seed + 100 + k), layer.bias[...].shape)

    def __call__(self, x, fused):
        if not fused:
            for layer in self.layers:
                x = layer(rms_norm, jnp.tanh, x)
            return x
        state = x
        for layer in self.layers:
            state = layer.chain(rms_norm, jnp.tanh, state)
        return mj.finish(state)


def test_chain_equals_whole_layers_and_scans(seed):
    """chain over 4 layers: the same bits as calling each layer whole (values and gradients), and
    the same values under nnx.scan over stacked layers with nnx.remat."""
    config, d = mj.Config(n=4), 16
    stack = Stack(config, d, 4, seed)
    x = jax.random.normal(jax.random.key(seed + 1), (2, 3, 4, d))

    def loss(stack, x, fused):
        return jnp.sum(stack(x, fused) ** 2)

    assert jnp.array_equal(stack(x, True), stack(x, False)), f"seed {seed}"
    grads = {fused: nnx.jit(nnx.grad(loss), static_argnums=2)(stack, x, fused) for fused in (True, False)}
    for a, b in zip(jax.tree.leaves(nnx.state(grads[True])), jax.tree.leaves(nnx.state(grads[False])), strict=True):
        assert jnp.array_equal(a, b), f"seed {seed}"

    # The same layers scanned: state carried as a Pending through nnx.scan with remat.
    first = stack.layers[0]
    graphdef, _ = nnx.split(first)
    stacked = jax.tree.map(lambda *v: jnp.stack(v), *(nnx.state(layer) for layer in stack.layers[1:]))

    @nnx.remat
    def step(state, layer_state):
        layer = nnx.merge(graphdef, layer_state)
        return layer.chain(rms_norm, jnp.tanh, state), None

    def scanned(x):
        state, _ = jax.lax.scan(step, first.chain(rms_norm, jnp.tanh, x), stacked)
        return mj.finish(state)

    assert relative_error(jax.jit(scanned)(x), stack(x, True)) <= 1e-6, f"seed {seed}"

"""The Flax NNX layer: the kernel switch gives the same function and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mhc.jax as mj
import numpy_reference
from conftest import assert_chain_matches, assert_matches, round_by_one_unit
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

    # Each path against the float64 chain (spec: Accuracy; never the two f32 paths with each other),
    # the streams and every parameter gradient, not the scalar loss (a random-weighted sum cancels).
    params = layers[True].params()
    assert all(np.array_equal(a, b) for a, b in zip(params, layers[False].params(), strict=True))
    sublayer = [(params, config, lambda h: jnp.tanh(rms_norm(h)))]
    for use_kernel, layer in layers.items():
        grads = nnx.grad(loss)(layer, x)
        got = {"out": layer(rms_norm, jnp.tanh, x), "dparams": [[grads[name][...] for name in mj.Params._fields]]}
        assert_chain_matches(got, x, sublayer, w, f"(use_kernel={use_kernel}, seed {seed})")


def test_parameters_hold_one_shape_and_params_is_flat(seed):
    config, d = mj.Config(n=3, mix="permutations"), 5
    layer = ManifoldConstrainedHyperConnections(config, d, rngs=nnx.Rngs(seed))
    width = config.projection_width
    assert layer.norm_weight[...].shape == (3, d) and layer.phi[...].shape == (3, d, width)
    # Row k*D + d of the flat layout is [k, d]: params() reshapes, in the spec's order.
    want = mj.init_params(nnx.Rngs(seed).params(), config, d)
    for got, expected in zip(layer.params(), want, strict=True):
        assert got.shape == expected.shape and jnp.array_equal(got, expected)


def test_weights_from_v4_load_in_one_call(seed):
    """A round trip through the DeepSeek-V4 converters: V4 tensors -> Params -> the layer -> the
    same V4 tensors, and the layer computes with exactly the loaded values (head alike)."""
    import numpy as np

    from mhc import interop
    from mhc.flax import Head

    rng = np.random.default_rng(seed)
    config, d = mj.Config(n=4), 6
    width, m = config.projection_width, config.n * d
    names = interop.v4_sublayer_names(2, "ffn")
    tensors = {
        names["fn"]: rng.standard_normal((width, m)).astype(np.float32),
        names["base"]: rng.standard_normal(width).astype(np.float32),
        names["scale"]: rng.standard_normal(3).astype(np.float32),
    }
    layer = ManifoldConstrainedHyperConnections(config, d, rngs=nnx.Rngs(seed))
    layer.load_params(interop.params_from_v4(tensors, config, layer=2, sublayer="ffn"))
    back = interop.params_to_v4(layer.params(), config, layer=2, sublayer="ffn")
    for name, value in tensors.items():
        assert np.array_equal(np.asarray(back[name]), value), name
    x = jax.random.normal(jax.random.key(seed), (3, 4, d))
    params = interop.params_from_v4(tensors, config, layer=2, sublayer="ffn")
    want = mj.post(jnp.tanh(mj.pre(x, params, config)[0]), mj.pre(x, params, config)[1])
    assert jnp.array_equal(layer(lambda h: h, jnp.tanh, x), want)

    head_tensors = {
        "hc_head_fn": rng.standard_normal((config.n, m)).astype(np.float32),
        "hc_head_base": rng.standard_normal(config.n).astype(np.float32),
        "hc_head_scale": rng.standard_normal(1).astype(np.float32),
    }
    head = Head(config, d, rngs=nnx.Rngs(seed))
    head.load_params(interop.head_from_v4(head_tensors, config))
    for name, value in interop.head_to_v4(head.params(), config).items():
        assert np.array_equal(np.asarray(value), head_tensors[name]), name


def test_load_params_checks_what_it_is_given(seed):
    from mhc.flax import Head

    config, d = mj.Config(n=2), 4
    layer = ManifoldConstrainedHyperConnections(config, d, rngs=nnx.Rngs(seed))
    before = layer.params()
    other_width = mj.init_params(jax.random.key(0), config, d + 1)
    with pytest.raises(ValueError, match=r"params\.norm_weight: expected shape \(8,\) for n=2, D=4, mix='sinkhorn'"):
        layer.load_params(other_width)
    with pytest.raises(TypeError, match=r"params\.phi: expected float32, got bfloat16"):
        layer.load_params(before._replace(phi=before.phi.astype(jnp.bfloat16)))
    with pytest.raises(TypeError, match=r"params: expected mhc\.jax\.Params, got HeadParams"):
        layer.load_params(mj.init_head_params(jax.random.key(0), config, d))
    for got, want in zip(layer.params(), before, strict=True):
        assert jnp.array_equal(got, want)  # nothing was set by a failed load
    head = Head(config, d, rngs=nnx.Rngs(seed))
    with pytest.raises(ValueError, match=r"params\.fn: expected shape \(2, 8\) for n=2, D=4"):
        head.load_params(mj.init_head_params(jax.random.key(0), config, d + 1))


@pytest.mark.slow  # over 5 s of CPU at -n 0 (pyproject.toml, markers; docs/testing.md, Fast tier)
def test_mixes_are_sown_when_asked_and_read_under_nnx_jit(seed):
    """H_res is sown as nnx.Intermediate "h_res" by a view with sow_mixes=True, collected with
    nnx.capture under nnx.jit (whole layers and chains alike); without it nothing is stored."""
    config, d = mj.Config(n=3), 8
    layers = make_layers(seed, config, d)
    x = jax.random.normal(jax.random.key(seed + 1), (2, 5, 3, d))
    params = layers[True].params()
    want = numpy_reference.coefficients(x, params, config)[2].reshape(2, 5, 3, 3)

    def h_res_near_exact(got, context):  # the float64 oracle with the one rule, not eager vs jit
        def perturbed(rng):
            moved = round_by_one_unit(rng, x), np.zeros((2, 5, d)), round_by_one_unit(rng, params), config, rng
            return numpy_reference._forward(*moved)["h_res"].reshape(want.shape)

        assert got.shape == want.shape, got.shape
        assert_matches("h_res", got, want, 1e-5, perturbed, f"({context}, seed {seed})")

    for use_kernel, layer in layers.items():
        probe = nnx.view(layer, sow_mixes=True)
        forward = nnx.jit(nnx.capture(lambda layer, x: layer(rms_norm, jnp.tanh, x), nnx.Intermediate))
        out, sown = forward(probe, x)
        (h_res,) = sown["h_res"].get_value()
        h_res_near_exact(h_res, f"whole layer, use_kernel={use_kernel}")
        chained = nnx.jit(nnx.capture(lambda layer, x: mj.finish(layer.chain(rms_norm, jnp.tanh, x)), nnx.Intermediate))
        _, sown = chained(probe, x)
        h_res_near_exact(sown["h_res"].get_value()[0], f"chain, use_kernel={use_kernel}")
        assert not layer.sow_mixes and not nnx.state(layer, nnx.Intermediate)
        # With and without sowing, each against the float64 layer (XLA may fuse them differently).
        plain = nnx.jit(lambda layer, x: layer(rms_norm, jnp.tanh, x))(layer, x)
        sublayer = [(params, config, lambda h: jnp.tanh(rms_norm(h)))]
        for label, streams in (("sown", out), ("not sown", plain)):
            context = f"({label}, use_kernel={use_kernel}, seed {seed})"
            assert_chain_matches({"out": streams}, x, sublayer, np.zeros(x.shape), context)
        assert not nnx.state(layer, nnx.Intermediate)  # training steps carry no intermediates


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


@pytest.mark.slow  # over 5 s of CPU at -n 0 (pyproject.toml, markers; docs/testing.md, Fast tier)
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

    # scan and remat may round differently: the scanned and the chained streams each against the
    # float64 chain with the one accuracy rule (the cotangent is unused: outputs only).
    sublayers = [(layer.params(), config, lambda h: jnp.tanh(rms_norm(h))) for layer in stack.layers]
    for label, out in (("scanned", jax.jit(scanned)(x)), ("chained", stack(x, True))):
        assert_chain_matches({"out": out}, x, sublayers, np.zeros(x.shape), f"({label}, seed {seed})")

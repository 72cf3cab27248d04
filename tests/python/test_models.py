"""The model stack: the hyper-connections baseline against its documented formulas, its unconstrained
H_res against mHC's doubly stochastic one, DeepSeek-V4's head in the stack, one seed for all kinds.
(Training through the head, on both paths, is test_demo's.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mhc.jax as mj
from conftest import assert_matches, assert_recompute_keeps_the_mhc_bits, round_by_one_unit
from mhc.flax import Head, ManifoldConstrainedHyperConnections, stack
from mhc.models import RESIDUALS, HyperConnections, ModelConfig, Transformer, loss_fn
from model_reference import assert_model_gradients_match

TINY = dict(width=16, layers=2, heads=2, n=4)


def _randomize(module: nnx.Module, rng: np.random.Generator, scale: float = 0.5):
    """Every parameter of `module` moved by a random amount, so no coefficient is at its initial value."""
    for _path, variable in nnx.iter_graph(module):
        if isinstance(variable, nnx.Param):
            value = np.asarray(variable[...])
            variable[...] = jnp.asarray(value + scale * rng.standard_normal(value.shape), jnp.float32)


def test_hyper_connections_follow_their_formulas(seed):
    rng = np.random.default_rng(seed)
    n, dim, layer_index = 3, 8, 4
    layer = HyperConnections(n, dim, layer_index)
    np.testing.assert_array_equal(layer.static_pre[...], np.eye(n)[layer_index % n])
    np.testing.assert_array_equal(layer.static_res[...], np.eye(n))
    _randomize(layer, rng)
    x = rng.standard_normal((5, n, dim)).astype(np.float32)
    weight = rng.standard_normal((dim, dim)).astype(np.float32)
    out = layer(lambda h: 2.0 * h, lambda h: jnp.tanh(h @ weight), jnp.asarray(x))

    names = ("static_pre", "static_post", "static_res", "dynamic_pre", "dynamic_post", "dynamic_res")
    p = {name: np.asarray(getattr(layer, name)[...]) for name in (*names, "scale_mix", "scale_post")}
    want = _hyper_connections_formulas(x, p, weight)

    def perturbed(rng):
        moved = {name: round_by_one_unit(rng, value) for name, value in p.items()}
        return _hyper_connections_formulas(round_by_one_unit(rng, x), moved, round_by_one_unit(rng, weight))

    assert_matches("out", out, want, 1e-5, perturbed, f"(seed {seed})")


def _hyper_connections_formulas(x, p, weight):
    """The documented hyper-connections (with the test's branch tanh(2 h W)) in float64."""
    x64 = np.asarray(x, np.float64)
    p = {name: np.asarray(value, np.float64) for name, value in p.items()}
    x_norm = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-6)
    h_pre = p["static_pre"] + p["scale_mix"] * np.tanh(x_norm @ p["dynamic_pre"])
    h_post = p["static_post"] + p["scale_post"] * np.tanh(x_norm @ p["dynamic_post"])
    h_res = p["static_res"] + p["scale_mix"] * np.tanh(x_norm @ p["dynamic_res"])
    layer_out = np.tanh((2.0 * np.einsum("tk,tkd->td", h_pre, x64)) @ np.asarray(weight, np.float64))
    return np.einsum("tij,tid->tjd", h_res, x64) + h_post[:, :, None] * layer_out[:, None, :]


@pytest.mark.slow  # over 5 s of CPU at -n 0 (pyproject.toml, markers; docs/testing.md, Fast tier)
def test_hc_mixes_are_unconstrained_and_mhc_mixes_doubly_stochastic(seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((6, 4, 8)), jnp.float32)
    layers = {"hc": HyperConnections(4, 8, 0)}
    for residual in ("mhc", "mhc-lite"):
        config = ModelConfig(**TINY, residual=residual).mhc_config()
        layers[residual] = ManifoldConstrainedHyperConnections(config, 8, use_kernel=False, rngs=nnx.Rngs(seed))
    column_error = {}
    for residual, layer in layers.items():
        _randomize(layer, rng)
        _, sown = nnx.capture(nnx.view(layer, sow_mixes=True), nnx.Intermediate)(lambda h: h, lambda h: h, x)
        (h_res,) = sown["h_res"].get_value()
        h_res = np.asarray(h_res)
        assert h_res.shape == (6, 4, 4)
        column_error[residual] = np.abs(h_res.sum(axis=-2) - 1.0).max()
        if residual != "hc":
            assert h_res.min() >= 0.0
    assert column_error["mhc"] < 1e-4 and column_error["mhc-lite"] < 1e-5, column_error
    assert column_error["hc"] > 0.1, column_error


@pytest.mark.slow  # over 5 s of CPU at -n 0 (pyproject.toml, markers; docs/testing.md, Fast tier)
def test_every_residual_starts_from_the_same_sublayer_weights(seed):
    def sublayer_weights(residual):
        model = Transformer(ModelConfig(**TINY, residual=residual, use_kernel=False), rngs=nnx.Rngs(seed))
        weights = [model.embed.embedding[...], model.head.kernel[...]]
        for block in model.blocks:
            weights += [block.attn.qkv.kernel[...], block.attn.out.kernel[...], block.mlp.up.kernel[...]]
        return weights

    plain = sublayer_weights("plain")
    for residual in RESIDUALS[1:]:
        for got, want in zip(sublayer_weights(residual), plain, strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_the_head_collapses_the_streams_on_the_model_s_path(seed, residual):
    for use_kernel in (True, False):
        model = Transformer(ModelConfig(**TINY, residual=residual, use_kernel=use_kernel), rngs=nnx.Rngs(seed))
        assert isinstance(model.collapse, Head) and model.collapse.use_kernel is use_kernel
    assert Transformer(ModelConfig(**TINY, collapse="sum"), rngs=nnx.Rngs(seed)).collapse is None
    assert Transformer(ModelConfig(**TINY, residual="plain"), rngs=nnx.Rngs(seed)).collapse is None


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="residual"):
        ModelConfig(residual="hyper")
    with pytest.raises(ValueError, match="collapse"):
        ModelConfig(collapse="mean")
    with pytest.raises(ValueError, match="width"):
        ModelConfig(width=30, heads=4)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        ModelConfig(dtype="float16")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="recompute: expected None or a group size"):
            ModelConfig(recompute=bad)
    for residual, use_kernel in (("plain", True), ("hc", True), ("mhc", False)):
        with pytest.raises(ValueError, match="recompute: rebuilds mHC's streams with its kernels"):
            ModelConfig(residual=residual, use_kernel=use_kernel, recompute=2)
    assert jax.tree.leaves(nnx.state(HyperConnections(2, 4, 0), nnx.Param))


@pytest.mark.slow  # over 5 s of CPU at -n 0 (pyproject.toml, markers; docs/testing.md, Fast tier)
@pytest.mark.parametrize("residual,fuse_boundaries", [("mhc", True), ("mhc-lite", False)])
def test_recompute_gives_the_gradients_and_mixes_of_keeping_every_stream(seed, residual, fuse_boundaries, monkeypatch):
    monkeypatch.setattr(mj, "_cpu_scheduler_warned", True)  # the scheduler is not what this checks
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 256, (2, 8)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 256, (2, 8)), jnp.int32)

    def run(recompute):
        # 2 blocks: 4 sublayers, so groups of 3 span a block boundary and leave a group of 1
        config = ModelConfig(**TINY, residual=residual, fuse_boundaries=fuse_boundaries, recompute=recompute)
        model = Transformer(config, rngs=nnx.Rngs(seed))
        _randomize(model, np.random.default_rng(seed), scale=0.1)
        grads = nnx.jit(nnx.grad(loss_fn))(model, tokens, targets)
        return nnx.to_flat_state(nnx.state(grads)), model.residual_mixes(tokens), model

    want_grads, want_mixes, model = run(None)
    got_grads, got_mixes, _ = run(3)
    assert_recompute_keeps_the_mhc_bits(got_grads, want_grads, seed)
    evaluations = {"every stream kept": want_grads, "recompute": got_grads}
    assert_model_gradients_match(evaluations, model, tokens, targets, f"(seed {seed})")
    np.testing.assert_array_equal(got_mixes, want_mixes)  # sown through nnx.remat


def test_the_flax_stack_refuses_what_it_cannot_run(seed):
    config = mj.Config(n=4)
    plain = ManifoldConstrainedHyperConnections(config, 8, use_kernel=False, rngs=nnx.Rngs(seed))
    x = jnp.ones((3, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"recompute: sublayers\[0\] runs the plain path"):
        stack(x, [(plain, lambda h: h, jnp.tanh)], recompute=1)
    with pytest.raises(TypeError, match=r"sublayers\[1\]: expected \(ManifoldConstrainedHyperConnections"):
        stack(x, [(plain, lambda h: h, jnp.tanh), (jnp.tanh, jnp.tanh, jnp.tanh)])
    with pytest.raises(ValueError, match="recompute: expected None or a group size"):
        stack(x, [], recompute=0)

"""vmap of the kernel path: over token axes (batched activations and cotangents, unbatched
parameters) the forward operations and post's backward fold the batch axis into the tokens (one
kernel call, no loop); a batched parameter, and the backward operations whose parameter gradients
are one sum per batch element, run the batch elements in turn. Either way vmap equals the loop of
single calls: values, per-example gradients (vmap of grad), gradients of a vmapped loss (grad of
vmap), nested vmap and a batch axis that is not the leading one."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
from conftest import random_params, relative_error

CONFIG = mj.Config(n=3, sinkhorn_iters=4, pre_eps=0.1, sinkhorn_eps=0.05, post_scale=1.3)
B, T, D = 3, 5, 12


def _sublayer(x, params, head):
    """pre -> tanh -> post -> boundary -> tanh -> post -> head: every operation, forward and backward."""
    layer_in, ctx = mj.pre(x, params, CONFIG)
    layer_in, ctx = mj.boundary(jnp.tanh(layer_in), ctx, params, CONFIG)
    return mj.head(mj.post(jnp.tanh(layer_in), ctx), head, CONFIG)


def _loss(x, params, head):
    return jnp.sum(_sublayer(x, params, head) ** 2)


def _problem(seed, batch_shape=(B,)):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (*batch_shape, T, CONFIG.n, D), jnp.float32)
    head = mj.init_head_params(keys[2], CONFIG, D)._replace(scale=jnp.array([0.9], jnp.float32))
    return x, random_params(keys[1], CONFIG, D), head


def _loop(f, xs):
    """f applied to each batch element of the pytree xs in turn (single, unbatched calls), stacked
    like vmap's output."""
    size = jax.tree.leaves(xs)[0].shape[0]
    results = [f(jax.tree.map(lambda a, i=i: a[i], xs)) for i in range(size)]
    return jax.tree.map(lambda *parts: jnp.stack(parts), *results)


def _assert_close(got, want, tolerance=1e-6):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape
        assert relative_error(a, b) <= tolerance


def _calls(hlo: str, target: str) -> int:
    return len(re.findall(rf'custom_call_target="{target}"', hlo))


def test_vmap_equals_the_loop(seed):
    x, params, head = _problem(seed)
    # The forward is per token: folded or not, each token's outputs are the same bits.
    got = jax.jit(jax.vmap(lambda x: _sublayer(x, params, head)))(x)
    np.testing.assert_array_equal(got, _loop(jax.jit(lambda x: _sublayer(x, params, head)), x))


def test_vmap_of_grad_gives_per_example_gradients(seed):
    x, params, head = _problem(seed)
    grad = jax.grad(_loss, argnums=(0, 1, 2))
    got = jax.jit(jax.vmap(grad, in_axes=(0, None, None)))(x, params, head)
    _assert_close(got, _loop(jax.jit(lambda x: grad(x, params, head)), x))


def test_grad_of_vmap_sums_the_examples(seed):
    x, params, head = _problem(seed)

    def batched_loss(x, params, head):
        return jnp.sum(jax.vmap(_loss, in_axes=(0, None, None))(x, params, head))

    got = jax.jit(jax.grad(batched_loss, argnums=(0, 1, 2)))(x, params, head)
    per_example = _loop(jax.jit(lambda x: jax.grad(_loss, argnums=(0, 1, 2))(x, params, head)), x)
    want = (per_example[0], *jax.tree.map(lambda g: g.sum(0), per_example[1:]))
    _assert_close(got, want)


def test_nested_vmap(seed):
    x, params, head = _problem(seed, batch_shape=(2, B))
    inner = jax.vmap(jax.value_and_grad(_loss, argnums=(0, 1)), in_axes=(0, None, None))
    got = jax.jit(jax.vmap(inner, in_axes=(0, None, None)))(x, params, head)
    one = jax.jit(lambda x: jax.value_and_grad(_loss, argnums=(0, 1))(x, params, head))
    _assert_close(got, _loop(lambda xs: _loop(one, xs), x))


def test_vmap_over_a_middle_axis(seed):
    """x [T, B, n, D] batched over axis 1, the output batched over axis 2 of [T, D, B]."""
    x, params, head = _problem(seed)
    x = jnp.moveaxis(x, 0, 1)
    f = jax.value_and_grad(_loss, argnums=(0, 1))
    got = jax.jit(jax.vmap(f, in_axes=(1, None, None), out_axes=(0, (1, 0))))(x, params, head)
    want = _loop(jax.jit(lambda xb: f(xb, params, head)), jnp.moveaxis(x, 1, 0))
    want = (want[0], (jnp.moveaxis(want[1][0], 0, 1), want[1][1]))
    _assert_close(got, want)
    out = jax.jit(jax.vmap(lambda xb: _sublayer(xb, params, head), in_axes=1, out_axes=2))(x)
    assert out.shape == (T, D, B)


def test_batched_parameters_run_in_turn(seed):
    """A parameter batched (an ensemble): one call per element, the same values as the loop."""
    x, params, head = _problem(seed)
    ensemble = jax.tree.map(lambda p: jnp.stack([p, 1.1 * p, 0.9 * p]), params)
    f = jax.value_and_grad(_loss, argnums=(0, 1))
    program = jax.jit(jax.vmap(f, in_axes=(None, 0, None)))
    got = program(x[0], ensemble, head)
    _assert_close(got, _loop(jax.jit(lambda p: f(x[0], p, head)), ensemble))
    assert "while" in program.lower(x[0], ensemble, head).compile().as_text()


def test_an_unbatched_activation_beside_a_batched_one(seed):
    """post with its context unbatched and only layer_out batched: the context is broadcast."""
    x, params, _ = _problem(seed)
    layer_in, ctx = mj.pre(x[0], params, CONFIG)
    layer_outs = jnp.stack([layer_in, jnp.tanh(layer_in), -layer_in])
    got = jax.jit(jax.vmap(lambda lo: jax.vjp(lambda lo, c: mj.post(lo, c), lo, ctx)[1](x[0])))(layer_outs)
    want = _loop(jax.jit(lambda lo: jax.vjp(lambda lo, c: mj.post(lo, c), lo, ctx)[1](x[0])), layer_outs)
    _assert_close(got, want)


@pytest.mark.parametrize("batch_shape", [(B,), (2, B)], ids=["vmap", "nested"])
def test_a_token_batched_forward_is_one_kernel_call(batch_shape):
    x, params, head = _problem(0, batch_shape)
    f = lambda x: _sublayer(x, params, head)  # noqa: E731
    for _ in batch_shape:
        f = jax.vmap(f)
    hlo = jax.jit(f).lower(x).compile().as_text()
    for target in ("mhc_pre_forward", "mhc_boundary_forward", "mhc_post_forward", "mhc_head_forward"):
        assert _calls(hlo, target) == 1, target
    assert "while" not in hlo


def test_the_backward_folds_only_where_every_result_is_per_token():
    """post's backward (no parameters) is one call, no loop; a backward with parameter gradients
    (one sum per batch element under vmap) runs in a loop, one call inside it."""
    x, params, head = _problem(0)
    layer_in, ctx = jax.vmap(lambda x: mj.pre(x, params, CONFIG))(x)

    def post_vjp(layer_in, ctx, cotangent):
        return jax.vjp(lambda lo, c: mj.post(lo, c), layer_in, ctx)[1](cotangent)

    hlo = jax.jit(jax.vmap(post_vjp)).lower(layer_in, ctx, x).compile().as_text()
    assert _calls(hlo, "mhc_post_backward") == 1 and "while" not in hlo
    for name, loss in {
        "pre": lambda x, p: mj.pre(x, p, CONFIG)[0].sum(),
        "head": lambda x, h: mj.head(x, h, CONFIG).sum(),
    }.items():
        argument = params if name == "pre" else head
        program = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))
        hlo = program.lower(x, argument).compile().as_text()
        assert _calls(hlo, f"mhc_{name}_backward") == 1 and "while" in hlo, name

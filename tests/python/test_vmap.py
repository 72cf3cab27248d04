"""vmap of the kernel path: over token axes (batched activations and cotangents, unbatched
parameters) the forward operations and post's backward fold the batch axis into the tokens (one
kernel call, no loop); a batched parameter, and the backward operations whose parameter gradients
are one sum per batch element, run the batch elements in turn. Either way vmap gives the loop of
single calls: the forward the same bits; per-example gradients (vmap of grad), gradients of a
vmapped loss (grad of vmap), nested vmap and a batch axis that is not the leading one, vmap and
the loop each against the float64 oracle (not bitwise: the folded calls sum in another order)."""

import functools
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
from conftest import assert_matches, chain_values, head_loss_values, random_params, round_by_one_unit

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


def _oracle(x, params, head, noise=None) -> dict:
    """_loss and its gradients in float64 (conftest.chain_values for pre -> tanh -> post twice,
    the boundary being post then pre, with the same params; conftest.head_loss_values for the
    head): "loss", "dx", "dparams" (the two sublayers' summed), "dhead". x [..., T, n, D]: the
    loss and the parameter gradients are sums over every token. noise: numpy_reference's."""

    def dstreams(streams):  # the cotangent of the streams for the loss sum(head(streams)^2)
        return head_loss_values(streams, head, CONFIG, 0.0, noise)["dx"]

    streams, dx, dparams, _ = chain_values(x, [(params, CONFIG, jnp.tanh)] * 2, dstreams, noise)
    head_values = head_loss_values(streams, head, CONFIG, 0.0, noise)
    summed = mj.Params(*(a + b for a, b in zip(*dparams, strict=True)))
    return {"loss": head_values["loss"], "dx": dx, "dparams": summed, "dhead": head_values["dhead"]}


def _assert_matches_oracle(got: dict, x, params, head, context=""):
    """Each of got's "loss", "dx", "dparams", "dhead" (an f32 evaluation of _loss on x, params,
    head) against _oracle with the one accuracy rule (conftest.assert_matches): vmap and the
    loop of single calls each against float64, never with each other."""
    want = _oracle(x, params, head)

    def perturbed(key, index, rng):
        moved = (round_by_one_unit(rng, value) for value in (x, params, head))
        return jax.tree.leaves(_oracle(*moved, noise=rng)[key])[index]

    for key, value in got.items():
        leaves = jax.tree.leaves(value)
        wanted = jax.tree.leaves(want[key])
        assert len(leaves) == len(wanted), key
        for index, (leaf, expected) in enumerate(zip(leaves, wanted, strict=True)):
            assert np.shape(leaf) == np.shape(expected), f"{key}[{index}]: {np.shape(leaf)} {context}"
            resample = functools.partial(perturbed, key, index)
            assert_matches(f"{key}[{index}]", leaf, expected, 1e-5, resample, context)


def _each(tree, index):
    return jax.tree.map(lambda a: a[index], tree)


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
    loop = _loop(jax.jit(lambda x: grad(x, params, head)), x)
    for label, result in (("vmap", got), ("loop", loop)):
        for b in range(B):
            dx, dparams, dhead = _each(result, b)
            got_b = {"dx": dx, "dparams": dparams, "dhead": dhead}
            _assert_matches_oracle(got_b, x[b], params, head, f"{label} example {b} (seed {seed})")


def test_grad_of_vmap_sums_the_examples(seed):
    x, params, head = _problem(seed)

    def batched_loss(x, params, head):
        return jnp.sum(jax.vmap(_loss, in_axes=(0, None, None))(x, params, head))

    got = jax.jit(jax.grad(batched_loss, argnums=(0, 1, 2)))(x, params, head)
    per_example = _loop(jax.jit(lambda x: jax.grad(_loss, argnums=(0, 1, 2))(x, params, head)), x)
    loop = (per_example[0], *jax.tree.map(lambda g: g.sum(0), per_example[1:]))
    for label, (dx, dparams, dhead) in (("grad of vmap", got), ("loop", loop)):
        # The oracle on the whole batch: the parameter gradients summed over every example's tokens.
        result = {"dx": dx, "dparams": dparams, "dhead": dhead}
        _assert_matches_oracle(result, x, params, head, f"{label} (seed {seed})")


def _assert_value_and_grads_match(results: dict, xs, params, head, seed):
    """results: label -> (loss [E], (dx [E, ...], dparams [E, ...])) for the examples xs [E, ...]
    (params: one, or one per example [E, ...]); each example against _oracle."""
    for label, (loss, (dx, dparams)) in results.items():
        for e in range(len(xs)):
            params_e = params if np.ndim(params.alpha) == 1 else _each(params, e)
            got = {"loss": loss[e], "dx": dx[e], "dparams": _each(dparams, e)}
            _assert_matches_oracle(got, xs[e], params_e, head, f"{label} example {e} (seed {seed})")


@pytest.mark.slow  # over 5 s of CPU at -n 0 (pyproject.toml, markers; docs/testing.md, Fast tier)
def test_nested_vmap(seed):
    x, params, head = _problem(seed, batch_shape=(2, B))
    inner = jax.vmap(jax.value_and_grad(_loss, argnums=(0, 1)), in_axes=(0, None, None))
    got = jax.jit(jax.vmap(inner, in_axes=(0, None, None)))(x, params, head)
    one = jax.jit(lambda x: jax.value_and_grad(_loss, argnums=(0, 1))(x, params, head))
    loop = _loop(lambda xs: _loop(one, xs), x)
    flat = lambda tree: jax.tree.map(lambda a: a.reshape(2 * B, *a.shape[2:]), tree)  # noqa: E731
    results = {"nested vmap": flat(got), "loop": flat(loop)}
    _assert_value_and_grads_match(results, flat(x), params, head, seed)


def test_vmap_over_a_middle_axis(seed):
    """x [T, B, n, D] batched over axis 1, the output batched over axis 2 of [T, D, B]."""
    x, params, head = _problem(seed)
    x = jnp.moveaxis(x, 0, 1)
    f = jax.value_and_grad(_loss, argnums=(0, 1))
    got = jax.jit(jax.vmap(f, in_axes=(1, None, None), out_axes=(0, (1, 0))))(x, params, head)
    loop = _loop(jax.jit(lambda xb: f(xb, params, head)), jnp.moveaxis(x, 1, 0))
    got = (got[0], (jnp.moveaxis(got[1][0], 1, 0), got[1][1]))  # dx back to [B, T, n, D]
    results = {"vmap over axis 1": got, "loop": loop}
    _assert_value_and_grads_match(results, jnp.moveaxis(x, 1, 0), params, head, seed)
    out = jax.jit(jax.vmap(lambda xb: _sublayer(xb, params, head), in_axes=1, out_axes=2))(x)
    assert out.shape == (T, D, B)


def test_batched_parameters_run_in_turn(seed):
    """A parameter batched (an ensemble): one call per element, the same values as the loop."""
    x, params, head = _problem(seed)
    ensemble = jax.tree.map(lambda p: jnp.stack([p, 1.1 * p, 0.9 * p]), params)
    f = jax.value_and_grad(_loss, argnums=(0, 1))
    program = jax.jit(jax.vmap(f, in_axes=(None, 0, None)))
    got = program(x[0], ensemble, head)
    loop = _loop(jax.jit(lambda p: f(x[0], p, head)), ensemble)
    xs = jnp.broadcast_to(x[0], (3, *x.shape[1:]))
    _assert_value_and_grads_match({"vmap": got, "loop": loop}, xs, ensemble, head, seed)
    assert "while" in program.lower(x[0], ensemble, head).compile().as_text()


def _post_vjp_oracle(layer_out, ctx, g):
    """post's VJP in float64 (spec: Forward step 8, out_j = sum_i H_res[i, j] x_i + H_post[j]
    layer_out) at the cotangent g: (dlayer_out, dx, dh_post, dh_res)."""
    layer_out, x, h_post, h_res, g = (np.asarray(a, np.float64) for a in (layer_out, ctx.x, ctx.h_post, ctx.h_res, g))
    dlayer_out = np.einsum("...j,...jd->...d", h_post, g)
    dx = np.einsum("...ij,...jd->...id", h_res, g)
    dh_post = np.einsum("...d,...jd->...j", layer_out, g)
    dh_res = np.einsum("...id,...jd->...ij", x, g)
    return dlayer_out, dx, dh_post, dh_res


def test_an_unbatched_activation_beside_a_batched_one(seed):
    """post with its context unbatched and only layer_out batched: the context is broadcast."""
    x, params, _ = _problem(seed)
    layer_in, ctx = mj.pre(x[0], params, CONFIG)
    layer_outs = jnp.stack([layer_in, jnp.tanh(layer_in), -layer_in])

    def post_vjp(lo):
        return jax.vjp(lambda lo, c: mj.post(lo, c), lo, ctx)[1](x[0])

    got = jax.jit(jax.vmap(post_vjp))(layer_outs)
    loop = _loop(jax.jit(post_vjp), layer_outs)
    for label, (dlayer_out, dctx) in (("vmap", got), ("loop", loop)):
        for e in range(len(layer_outs)):
            results = (dlayer_out[e], dctx.x[e], dctx.h_post[e], dctx.h_res[e])
            want = _post_vjp_oracle(layer_outs[e], ctx, x[0])

            def perturbed(index, rng, e=e):
                moved = (round_by_one_unit(rng, a) for a in (layer_outs[e], ctx.x, ctx.h_post, ctx.h_res, x[0]))
                lo, x_, h_post, h_res, g = moved
                return _post_vjp_oracle(lo, SimpleNamespace(x=x_, h_post=h_post, h_res=h_res), g)[index]

            names = ("dlayer_out", "dx", "dh_post", "dh_res")
            for index, (name, value) in enumerate(zip(names, results, strict=True)):
                resample = functools.partial(perturbed, index)
                assert_matches(name, value, want[index], 1e-5, resample, f"{label} example {e} (seed {seed})")


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

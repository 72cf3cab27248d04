"""The fused boundary in JAX (mhc.jax.boundary, sublayer/finish): a chain of sublayers whose posts
fuse into the next pre equals the same chain of separate pre/post calls bit for bit (values and
every gradient), agrees with the plain path, runs the fused custom calls only on the kernel path,
and composes with jit, grad, vmap and checkpoint. Sharded runs: sharding_cases.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
from conftest import assert_chain_matches, random_params


def _problem(seed, config, dtype, d=33, layers=3):
    keys = jax.random.split(jax.random.key(seed), layers + 3)
    x = jax.random.normal(keys[0], (3, 5, config.n, d), jnp.float32).astype(dtype)
    params = [random_params(k, config, d) for k in keys[3:]]
    weights = [jax.random.normal(keys[1], (d, d)) / np.sqrt(d), jax.random.normal(keys[2], (d, d)) / np.sqrt(d)]
    # At least f32 inside (bf16 layer_in), float64 in conftest.chain_values' x64 oracle.
    branches = [
        lambda h, w=w: jnp.tanh(h.astype(jnp.promote_types(h.dtype, jnp.float32)) @ w).astype(h.dtype) for w in weights
    ]
    branches.append(lambda h: h * 1.5)
    return x, params, branches[:layers]


def _chain(x, params, config, branches, *, use_kernel=True, fused=True):
    if fused:
        state = x
        for p, branch in zip(params, branches, strict=True):
            state = mj.sublayer(state, p, config, branch, use_kernel=use_kernel)
        return mj.finish(state)
    for p, branch in zip(params, branches, strict=True):
        layer_in, ctx = mj.pre(x, p, config, use_kernel=use_kernel)
        x = mj.post(branch(layer_in), ctx)
    return x


def _value_and_grads(x, params, config, branches, **kwargs):
    cotangent = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

    def loss(x, params):
        return jnp.sum(_chain(x, params, config, branches, **kwargs).astype(jnp.float32) * cotangent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, params)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mix", ["sinkhorn", "permutations"])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_chain_equals_separate_calls_bit_for_bit(seed, dtype, mix, n):
    config = mj.Config(n=n, mix=mix)
    x, params, branches = _problem(seed, config, dtype)
    fused = _value_and_grads(x, params, config, branches, fused=True)
    separate = _value_and_grads(x, params, config, branches, fused=False)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(fused), jax.tree.leaves(separate), strict=True):
        assert not np.any(np.isnan(np.asarray(a, np.float32))), f"{jax.tree_util.keystr(path)} (seed {seed})"
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"{jax.tree_util.keystr(path)} differs (seed {seed})"


@pytest.mark.parametrize("mix", ["sinkhorn", "permutations"])
def test_chain_agrees_with_the_plain_path(seed, mix):
    config = mj.Config(n=4, mix=mix)
    x, params, branches = _problem(seed, config, jnp.float32)
    cotangent = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)  # _value_and_grads'
    sublayers = list(zip(params, [config] * len(params), branches, strict=True))
    for use_kernel in (True, False):
        # Each path against the float64 chain with the one accuracy rule, not against the other.
        _, (dx, dparams) = _value_and_grads(x, params, config, branches, use_kernel=use_kernel)
        out = jax.jit(lambda x: _chain(x, params, config, branches, use_kernel=use_kernel))(x)  # noqa: B023
        got = {"out": out, "dx": dx, "dparams": dparams}
        assert_chain_matches(got, x, sublayers, cotangent, f"(use_kernel={use_kernel}, seed {seed})")


@pytest.mark.slow  # over 5 s of CPU at -n 0 (pyproject.toml, markers; docs/testing.md, Fast tier)
def test_fused_calls_only_on_the_kernel_path():
    config = mj.Config(n=4)
    x, params, branches = _problem(0, config, jnp.float32)

    def hlo(use_kernel):
        loss = lambda x, params: jnp.sum(_chain(x, params, config, branches, use_kernel=use_kernel))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=1)).lower(x, params).compile().as_text()

    kernel = hlo(True)
    # Two boundaries: two fused forwards and two fused backwards; the chain's ends are a pre and a
    # post (the last post's forward is dead code in a gradient of this loss).
    assert kernel.count('custom_call_target="mhc_boundary_forward"') == 2
    assert kernel.count('custom_call_target="mhc_boundary_backward"') == 2
    assert kernel.count('custom_call_target="mhc_pre_forward"') == 1
    assert kernel.count('custom_call_target="mhc_pre_backward"') == 1
    assert kernel.count('custom_call_target="mhc_post_backward"') == 1
    assert "mhc_" not in hlo(False)


def test_checkpoint_and_vmap(seed):
    config = mj.Config(n=3)
    x, params, branches = _problem(seed, config, jnp.float32, layers=2)

    def loss(x, params, remat):
        state = x
        for p, branch in zip(params, branches, strict=True):
            step = lambda s, p, branch=branch: mj.sublayer(s, p, config, branch)  # noqa: E731
            state = (jax.checkpoint(step) if remat else step)(state, p)
        return jnp.sum(mj.finish(state) * cotangent)

    cotangent = jax.random.normal(jax.random.key(seed + 1), x.shape)
    sublayers = list(zip(params, [config] * len(params), branches, strict=True))
    for remat in (False, True):
        # XLA may fuse the recomputed branch (matmul, tanh) differently: each run against the
        # float64 chain with the one accuracy rule, not against the other.
        dx, dparams = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, params, remat)
        assert_chain_matches({"dx": dx, "dparams": dparams}, x, sublayers, cotangent, f"(remat={remat}, seed {seed})")
    # vmap over a leading axis: the calls run per batch element, same values.
    batched = jax.vmap(lambda x: _chain(x, params, config, branches))(x)
    assert np.array_equal(np.asarray(batched), np.asarray(_chain(x, params, config, branches)))


def test_bad_arguments_are_named():
    config = mj.Config(n=4)
    x, params, branches = _problem(0, config, jnp.float32, layers=2)
    state = mj.sublayer(x, params[0], config, branches[0])
    with pytest.raises(ValueError, match="config: the next sublayer's n"):
        mj.sublayer(state, params[1], mj.Config(n=3), branches[1])
    with pytest.raises(ValueError, match=r"params.phi: expected shape"):
        mj.sublayer(state, params[1]._replace(phi=params[1].phi[:-1]), config, branches[1])
    with pytest.raises(ValueError, match=r"layer_out: expected shape"):
        mj.boundary(state.layer_out[..., :-1], state.ctx, params[1], config)
    with pytest.raises(TypeError, match="ctx: expected the Context"):
        mj.boundary(state.layer_out, (state.ctx.x,), params[1], config)
    # finish of a plain array is the array itself (a chain of zero sublayers).
    assert mj.finish(x) is x

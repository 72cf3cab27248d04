"""The residuals the custom VJPs save carry checkpoint names (mhc.jax._kernels.RESIDUAL_NAMES), so a
jax.checkpoint policy can pick them: saving only those names keeps exactly them (and the arguments),
and the gradients under every policy are the same bits as without jax.checkpoint. Kernel path, f32."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
from conftest import random_params, saved_residuals
from mhc.jax import _kernels

N, D, T = 4, 64, 32
CONFIG = mj.Config(n=N)
POLICIES = jax.checkpoint_policies
ALL = set(mj.RESIDUAL_NAMES)
assert mj.RESIDUAL_NAMES == _kernels.RESIDUAL_NAMES


def _problem(seed, layers=3):
    keys = jax.random.split(jax.random.key(seed), layers + 4)
    x = jax.random.normal(keys[0], (T, N, D), jnp.float32)
    params = [random_params(k, CONFIG, D) for k in keys[4:]]
    head = mj.init_head_params(keys[1], CONFIG, D)
    # a nonzero base and scale, so every head gradient is exercised
    head = head._replace(base=jax.random.normal(keys[2], head.base.shape), scale=head.scale + 0.5)
    weight = jax.random.normal(keys[3], (D, D)) / np.sqrt(D)
    return x, params, head, weight


def _loss(model, x, params, head, weight):
    branch = lambda h: jnp.tanh(h @ weight)  # noqa: E731
    if model == "pre_post":
        for p in params:
            layer_in, ctx = mj.pre(x, p, CONFIG)
            x = mj.post(branch(layer_in), ctx)
        return jnp.sum(jnp.sin(x))
    state = x
    for p in params:
        state = mj.sublayer(state, p, CONFIG, branch)
    x = mj.finish(state)
    if model == "boundary":
        return jnp.sum(jnp.sin(x))
    return jnp.sum(jnp.sin(mj.head(x, head, CONFIG)))


def _names(lines) -> set[str]:
    return {m.group(1) for line in lines if (m := re.search(r"named '([^']*)'", line))}


# how many x each model's custom VJPs save (3 sublayers): pre and post one each per sublayer; the
# fused chain one in its first pre, one per boundary, one in its final post; the head one more
X_SAVED = {"pre_post": 6, "boundary": 4, "head": 5}


@pytest.mark.parametrize("model", ["pre_post", "boundary", "head"])
def test_a_names_policy_saves_the_named_residuals_and_only_the_arguments_besides(seed, model):
    x, params, head, weight = _problem(seed)
    loss = lambda x, params, head: _loss(model, x, params, head, weight)  # noqa: E731
    lines = saved_residuals(
        jax.checkpoint(loss, policy=POLICIES.save_only_these_names(*_kernels.RESIDUAL_NAMES)), x, params, head
    )
    assert _names(lines) == ALL, lines
    others = [line for line in lines if "named 'mhc_" not in line and "from the argument" not in line]
    # the branch's weight is a closed-over constant; nothing else is saved under this policy
    assert all("from a constant" in line for line in others), others
    # per sublayer one layer_out, h_post and h_res and pre's partial sums; x once per custom VJP
    layers = len(params)
    assert sum("named 'mhc_x'" in line for line in lines) == X_SAVED[model], lines
    assert sum("named 'mhc_pre_partials'" in line for line in lines) == layers, lines
    assert sum("named 'mhc_layer_out'" in line for line in lines) == layers, lines
    assert sum("named 'mhc_coefficients'" in line for line in lines) == 2 * layers, lines
    # one name alone: only it is kept
    only_x = POLICIES.save_only_these_names(_kernels.RESIDUAL_X)
    lines = saved_residuals(jax.checkpoint(loss, policy=only_x), x, params, head)
    assert _names(lines) == {_kernels.RESIDUAL_X}, lines


@pytest.mark.parametrize("model", ["pre_post", "boundary", "head"])
def test_gradients_under_every_policy_are_the_bits_without_checkpoint(seed, model):
    x, params, head, weight = _problem(seed)
    loss = lambda x, params, head: _loss(model, x, params, head, weight)  # noqa: E731
    grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, params, head)  # noqa: E731
    expected = grad(loss)
    policies = {
        "mhc names": POLICIES.save_only_these_names(*_kernels.RESIDUAL_NAMES),
        "mhc_x only": POLICIES.save_only_these_names(_kernels.RESIDUAL_X),
        "nothing_saveable": POLICIES.nothing_saveable,
        "everything_saveable": POLICIES.everything_saveable,
    }
    for label, policy in policies.items():
        got = grad(jax.checkpoint(loss, policy=policy))
        leaves = jax.tree_util.tree_leaves_with_path(got)
        for (path, a), b in zip(leaves, jax.tree.leaves(expected), strict=True):
            assert np.all(np.isfinite(np.asarray(a))), f"{label}: {jax.tree_util.keystr(path)} (seed {seed})"
            assert np.array_equal(np.asarray(a), np.asarray(b)), (
                f"{label}: {jax.tree_util.keystr(path)} differs (seed {seed})"
            )


def test_a_real_carried_mix_at_a_seam_is_saved_by_its_name(seed):
    """V4.1 (spec: Single-pass schedule) with a seam before the last sublayer (V4.1's Engram: the
    post, a stream update, then the pre on their own): that pre reads a real carried mix, the
    previous sublayer's h_pre [T, n], which its custom VJP must save under its checkpoint name, so
    that a names policy keeps it rather than re-running the sublayer before to get it back. (The
    first sublayer's one-hot is an empty [T, 0] array: the count below leaves it out.)"""
    config = mj.Config(n=N, pre_from_previous=True)
    x, params, _, weight = _problem(seed)
    update = jax.random.normal(jax.random.fold_in(jax.random.key(seed), 1), x.shape, jnp.float32)
    branch = lambda h: jnp.tanh(h @ weight)  # noqa: E731

    def loss(x, params, update):
        state = mj.stack(x, [(p, config, branch) for p in params[:-1]])
        before = mj.streams(state)  # the seam: the pending post applied, then the update
        state = mj.sublayer(mj.Streams(before.x + update, before.carried), params[-1], config, branch)
        return jnp.sum(jnp.sin(mj.collapse(state)))

    policy = POLICIES.save_only_these_names(*_kernels.RESIDUAL_NAMES)
    lines = saved_residuals(jax.checkpoint(loss, policy=policy), x, params, update)
    assert _names(lines) == ALL, lines
    others = [line for line in lines if "named 'mhc_" not in line and "from the argument" not in line]
    assert all("from a constant" in line for line in others), others
    mixes = [line for line in lines if line.startswith(f"f32[{T},{N}] named 'mhc_coefficients'")]
    # h_pre and h_post of the fused boundary (sublayers 0 -> 1), h_post of the post before the seam,
    # the carried mix of the pre after it, h_post of the last post, the carried mix of the collapse
    assert len(mixes) == 6, lines
    assert sum(line.endswith("(pre)") for line in mixes) == 1, mixes

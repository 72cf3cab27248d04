"""Batch invariance through mhc.jax (spec: Accuracy): a token's forward outputs are the same bits
computed alone (one token) as at any position of a larger call, for pre, post, the fused
boundary and the head, f32 and bf16, on the kernel path under jit. Every token of the large call is
compared. D = 4096 sends the lone token through the kernels' decode split (the projection split
over rows of W); the thread-count half of the property is in tests/cpp/batch_invariance_test.cc."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
from conftest import random_numpy_params


def _forward_outputs(x, layer_out, params, next_params, head, config):
    """Every forward output of the four operations, for tokens [T, n, D]."""
    layer_in, ctx = mj.pre(x, params, config)
    out = mj.post(layer_out, ctx)
    next_layer_in, next_ctx = mj.boundary(layer_out, ctx, next_params, config)
    return {
        "pre.layer_in": layer_in,
        "pre.h_post": ctx.h_post,
        "pre.h_res": ctx.h_res,
        "post.out": out,
        "boundary.x_next": next_ctx.x,
        "boundary.layer_in": next_layer_in,
        "boundary.h_post": next_ctx.h_post,
        "boundary.h_res": next_ctx.h_res,
        "head.out": mj.head(x, head, config),
    }


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "mix,n,d,tokens", [("sinkhorn", 4, 130, 70), ("permutations", 3, 33, 40), ("sinkhorn", 4, 4096, 12)]
)
def test_a_token_alone_equals_its_row_in_a_large_call(seed, dtype, mix, n, d, tokens):
    config = mj.Config(n=n, mix=mix)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, n, d)), dtype)
    layer_out = jnp.asarray(rng.standard_normal((tokens, d)), dtype)
    params, next_params = random_numpy_params(rng, config, d), random_numpy_params(rng, config, d)
    head = mj.HeadParams(
        fn=(rng.standard_normal((n, n * d)) / np.sqrt(n * d)).astype(np.float32),
        base=rng.standard_normal(n).astype(np.float32),
        scale=np.array([0.8], np.float32),
    )
    run = jax.jit(lambda x, layer_out: _forward_outputs(x, layer_out, params, next_params, head, config))
    whole = jax.tree.map(np.asarray, run(x, layer_out))
    for name, value in whole.items():
        assert value.shape[0] == tokens, name
        assert np.isfinite(value.astype(np.float32)).all(), f"{name}: non-finite (seed {seed})"
    for t in range(tokens):
        alone = jax.tree.map(np.asarray, run(x[t : t + 1], layer_out[t : t + 1]))
        for name, value in alone.items():
            # Bits, not values: compare the raw bytes (bf16 included).
            assert value.tobytes() == whole[name][t : t + 1].tobytes(), (
                f"{name} of token {t} of {tokens} computed alone differs from the large call (seed {seed})"
            )

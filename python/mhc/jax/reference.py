"""The plain-JAX path: the spec's formulas in jax.numpy (f32 coefficient math), differentiated
by JAX autodiff. ``mhc.jax.pre(..., use_kernel=False)`` runs this; it is also the baseline the
benchmarks compare the kernels with."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mhc._config import PreApply
from mhc.jax._types import (
    Config,
    Context,
    HeadParams,
    Params,
    check_carried,
    check_collapse_args,
    check_head_args,
    check_post_args,
    check_pre_args,
    names_its_errors,
)

_HIGHEST = jax.lax.Precision.HIGHEST


def permutation_matrices(n: int) -> np.ndarray:
    """[n!, n, n] with [p, i, perm_p(i)] = 1, permutations of range(n) in lexicographic order."""
    perms = list(itertools.permutations(range(n)))
    mats = np.zeros((len(perms), n, n), np.float32)
    for p, perm in enumerate(perms):
        mats[p, np.arange(n), perm] = 1.0
    return mats


def mix_matrix(config: Config, logits: jax.Array) -> jax.Array:
    """H_res [..., n, n] from the residual logits [..., R] (spec: Forward step 5)."""
    n, eps = config.n, config.sinkhorn_eps
    if config.mix == "permutations":
        weights = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("...p,pij->...ij", weights, permutation_matrices(n), precision=_HIGHEST)
    s = jax.nn.softmax(logits.reshape(*logits.shape[:-1], n, n), axis=-1) + eps
    s = s / (s.sum(axis=-2, keepdims=True) + eps)
    for _ in range(config.sinkhorn_iters - 1):
        s = s / (s.sum(axis=-1, keepdims=True) + eps)
        s = s / (s.sum(axis=-2, keepdims=True) + eps)
    return s


def _tokens(a: jax.Array, trailing: int) -> jax.Array:
    """a with its leading axes (all but the last `trailing`) flattened into one token axis. XLA's CPU
    code for batched products and reductions over several leading axes was up to 10x slower: the
    plain sublayer's forward+backward took 14.3 s with x [1, T, n, D] and 1.5 s with [T, n, D]."""
    lead = a.shape[: a.ndim - trailing]
    return a.reshape((math.prod(lead),) + a.shape[a.ndim - trailing :])


@names_its_errors("mhc.jax.reference.coefficients")
def coefficients(x: jax.Array, params: Params, config: Config):
    """h_pre [..., n], h_post [..., n], h_res [..., n, n] in f32 (spec: Forward steps 1-5)."""
    n = config.n
    lead = x.shape[:-2]
    flat = _tokens(x, 2).astype(jnp.float32).reshape(math.prod(lead), n * x.shape[-1])
    r = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + config.rms_eps)
    projection = jnp.matmul(flat * params.norm_weight, params.phi, precision=_HIGHEST)
    scale = jnp.concatenate(
        [
            jnp.broadcast_to(params.alpha[0], (n,)),
            jnp.broadcast_to(params.alpha[1], (n,)),
            jnp.broadcast_to(params.alpha[2], (config.residual_logits,)),
        ]
    )
    logits = scale * (r * projection) + params.bias
    h_pre = jax.nn.sigmoid(logits[..., :n]) + config.pre_eps
    h_post = config.post_scale * jax.nn.sigmoid(logits[..., n : 2 * n])
    h_res = mix_matrix(config, logits[..., 2 * n :])
    return h_pre.reshape(*lead, n), h_post.reshape(*lead, n), h_res.reshape(*lead, n, n)


@names_its_errors("mhc.jax.reference.pre")
def pre(x: jax.Array, params: Params, config: Config, carried: jax.Array | None = None):
    """layer_in [..., D] (x's dtype) and the Context for post.

    V4 (``config.pre_from_previous`` False): layer_in = sum_k h_pre[k] x[k]. V4.1: layer_in =
    sum_k carried[k] x[k], the carried mix [..., n] f32 (None: the one-hot on stream 0), and the
    context keeps this sublayer's h_pre for the next (spec: Single-pass schedule)."""
    check_pre_args(x, params, config)
    check_carried(carried, x, config)
    pre_apply = PreApply.of(config, carried)
    h_pre, h_post, h_res = coefficients(x, params, config)
    if pre_apply is PreApply.OWN_GATES:
        return _mix(h_pre, x), Context(x, h_post, h_res, config, False)
    layer_in = x[..., 0, :] if pre_apply is PreApply.ONE_HOT else _mix(carried, x)
    return layer_in, Context(x, h_post, h_res, config, False, h_pre=h_pre)


def _mix(weights: jax.Array, x: jax.Array) -> jax.Array:
    """sum_k weights[..., k] x[..., k, :] in f32, rounded to x's dtype: [..., D]."""
    out = jnp.einsum("tk,tkd->td", _tokens(weights, 1), _tokens(x, 2).astype(jnp.float32), precision=_HIGHEST)
    return out.reshape(x.shape[:-2] + x.shape[-1:]).astype(x.dtype)


@names_its_errors("mhc.jax.reference.collapse")
def collapse(x: jax.Array, carried: jax.Array) -> jax.Array:
    """DeepSeek-V4.1's end of the model: h [..., D] = sum_k carried[..., k] x[..., k, :] (x's
    dtype), carried the last sublayer's h_pre [..., n] f32 (spec: Single-pass schedule)."""
    check_collapse_args(x, carried)
    return _mix(carried, x)


@names_its_errors("mhc.jax.reference.post")
def post(layer_out: jax.Array, ctx: Context) -> jax.Array:
    """out[..., j, d] = sum_i h_res[..., i, j] x[..., i, d] + h_post[..., j] layer_out[..., d]."""
    check_post_args(layer_out, ctx)
    x = _tokens(ctx.x, 2).astype(jnp.float32)
    mixed = jnp.einsum("tij,tid->tjd", _tokens(ctx.h_res, 2), x, precision=_HIGHEST)
    out = mixed + _tokens(ctx.h_post, 1)[:, :, None] * _tokens(layer_out, 1).astype(jnp.float32)[:, None, :]
    return out.reshape(ctx.x.shape).astype(ctx.x.dtype)


@names_its_errors("mhc.jax.reference.head")
def head(x: jax.Array, params: HeadParams, config: Config) -> jax.Array:
    """DeepSeek-V4's head [..., D] (x's dtype): sum_k g_k x_k with
    g = sigmoid(scale * r * (x_flat . fn^T) + base) + pre_eps (spec: Head)."""
    check_head_args(x, params, config)
    n = config.n
    tokens = _tokens(x, 2).astype(jnp.float32)
    flat = tokens.reshape(tokens.shape[0], n * x.shape[-1])
    r = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + config.rms_eps)
    projection = jnp.matmul(flat, params.fn.T, precision=_HIGHEST)
    gates = jax.nn.sigmoid(params.scale[0] * (r * projection) + params.base) + config.pre_eps
    out = jnp.einsum("tk,tkd->td", gates, tokens, precision=_HIGHEST)
    return out.reshape(x.shape[:-2] + x.shape[-1:]).astype(x.dtype)

"""mHC for JAX: ``pre`` and ``post`` around a sublayer, on the fused C++ kernels or plain JAX.

    layer_in, ctx = mhc.jax.pre(x, params, config)        # x: [..., n, D], f32 or bf16
    out = mhc.jax.post(branch(layer_in), ctx)              # out: [..., n, D]

With ``use_kernel=True`` (default) both are ``jax.custom_vjp`` functions whose forward and
backward are the C++ operations (XLA FFI custom calls); with ``use_kernel=False`` they are the
plain jax.numpy formulas of ``mhc.jax.reference``, differentiated by JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mhc.jax import _kernels, reference  # _kernels registers the FFI targets at import
from mhc.jax._types import Config, Context, Params, check_post_args, check_pre_args, init_params

__all__ = [
    "Config",
    "Context",
    "Params",
    "init_params",
    "pre",
    "post",
    "expand",
    "reduce",
    "sharded_pre",
    "sharded_post",
    "reference",
]


def _pre_kernel(x, params: Params, config: Config):
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    layer_in, x_ctx, h_post, h_res = _kernels.pre(config, x.reshape(-1, n, d), params)
    return layer_in.reshape(*lead, d), Context(
        x_ctx.reshape(x.shape), h_post.reshape(*lead, n), h_res.reshape(*lead, n, n), config, True
    )


def _post_kernel(layer_out, ctx: Context):
    n, d = ctx.x.shape[-2:]
    out = _kernels.post(
        ctx.config,
        ctx.x.reshape(-1, n, d),
        layer_out.reshape(-1, d),
        ctx.h_post.reshape(-1, n),
        ctx.h_res.reshape(-1, n, n),
    )
    return out.reshape(ctx.x.shape)


def pre(x: jax.Array, params: Params, config: Config, *, use_kernel: bool = True):
    """The sublayer's input and the context for ``post`` (spec: Forward steps 1-6).

    x: [..., n, D] in float32 or bfloat16; params: f32 ``Params``. Returns layer_in [..., D] in
    x's dtype and a ``Context`` (x, h_post, h_res) to pass to ``post``.
    """
    if not use_kernel:
        return reference.pre(x, params, config)
    check_pre_args(x, params, config)
    return _pre_kernel(x, params, config)


def post(layer_out: jax.Array, ctx: Context) -> jax.Array:
    """The new streams [..., n, D]: H_res^T x + H_post layer_out (spec: Forward step 8).

    layer_out: [..., D] (float32 or bfloat16). Runs the same path (kernel or reference) as the
    ``pre`` that produced ``ctx``.
    """
    check_post_args(layer_out, ctx)
    if not ctx.use_kernel:
        return reference.post(layer_out, ctx)
    return _post_kernel(layer_out, ctx)


def expand(h: jax.Array, n: int) -> jax.Array:
    """Repeat an embedding [..., D] into n streams [..., n, D] (no scaling)."""
    return jnp.broadcast_to(h[..., None, :], (*h.shape[:-1], n, h.shape[-1]))


def reduce(x: jax.Array) -> jax.Array:
    """Sum the streams [..., n, D] back to [..., D]."""
    return x.sum(axis=-2, dtype=jnp.float32).astype(x.dtype)


def _axes_tuple(token_axes):
    return (token_axes,) if isinstance(token_axes, str) else tuple(token_axes)


def sharded_pre(x, params: Params, config: Config, *, mesh, token_axes):
    """``pre`` on the kernels with x's first axis sharded over the mesh axes ``token_axes``.

    Parameters are replicated. Each device runs the C++ kernels on its local tokens; the
    transpose of shard_map sums the replicated parameters' per-device gradients over the mesh
    (psum), so ``jax.grad`` returns the same gradients as on one device (tests/python/
    sharding_cases.py pins this). Use ``sharded_post`` with the returned context.
    """
    check_pre_args(x, params, config)
    x_spec = PartitionSpec(_axes_tuple(token_axes))

    def local(x_local, params_local):
        layer_in, ctx = _pre_kernel(x_local, params_local, config)
        return layer_in, ctx.x, ctx.h_post, ctx.h_res

    layer_in, x_ctx, h_post, h_res = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(x_spec, PartitionSpec()),
        out_specs=(x_spec, x_spec, x_spec, x_spec),
        check_vma=False,
    )(x, params)
    return layer_in, Context(x_ctx, h_post, h_res, config, True)


def sharded_post(layer_out, ctx: Context, *, mesh, token_axes):
    """``post`` on the kernels, sharded like ``sharded_pre`` (same mesh and token_axes)."""
    check_post_args(layer_out, ctx)
    if not ctx.use_kernel:
        raise ValueError("ctx: sharded_post needs the context of sharded_pre (use_kernel=True)")
    spec = PartitionSpec(_axes_tuple(token_axes))

    def local(layer_out_local, x_local, h_post_local, h_res_local):
        return _post_kernel(layer_out_local, Context(x_local, h_post_local, h_res_local, ctx.config, True))

    return jax.shard_map(
        local, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec, check_vma=False
    )(layer_out, ctx.x, ctx.h_post, ctx.h_res)

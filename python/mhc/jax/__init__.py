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


def _axes_tuple(axes) -> tuple:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


class _Layout:
    """PartitionSpecs of one sharded call: tokens (x's first axis) over ``token_axes``, D (the
    last axis) over ``tensor_axis``, streams and other leading axes replicated."""

    def __init__(self, mesh, token_axes, tensor_axis, x_ndim: int, d: int):
        tokens = _axes_tuple(token_axes)
        for name in tokens + _axes_tuple(tensor_axis):
            if name not in mesh.shape:
                raise ValueError(f"token_axes/tensor_axis: {name!r} is not an axis of the mesh {dict(mesh.shape)}")
        if tensor_axis is not None and not isinstance(tensor_axis, str):
            raise TypeError(f"tensor_axis: expected one mesh axis name (str) or None, got {tensor_axis!r}")
        if tensor_axis is not None and tensor_axis in tokens:
            raise ValueError(f"tensor_axis: {tensor_axis!r} is also one of token_axes {tokens}")
        self.slices = 1 if tensor_axis is None else mesh.shape[tensor_axis]
        if d % self.slices:
            raise ValueError(
                f"x: D = {d} must be divisible by the {self.slices} devices of tensor_axis {tensor_axis!r}"
            )
        self.tensor_axis = tensor_axis
        token_entry = tokens if tokens else None
        middle = (None,) * (x_ndim - 3) if x_ndim >= 3 else ()
        # x [T, ..., n, D], layer_in [T, ..., D], coefficients [T, ..., n(, n)].
        if x_ndim >= 3:
            self.x = PartitionSpec(token_entry, *middle, None, tensor_axis)
            self.layer_in = PartitionSpec(token_entry, *middle, tensor_axis)
            self.coefficients = PartitionSpec(token_entry)
        else:  # x [n, D]: a single token
            self.x = PartitionSpec(None, tensor_axis)
            self.layer_in = PartitionSpec(tensor_axis)
            self.coefficients = PartitionSpec()
        # norm_weight as [n, D] and phi as [n, D, N]: rows of the local D slice of each stream.
        self.params = Params(
            PartitionSpec(None, tensor_axis), PartitionSpec(None, tensor_axis, None), PartitionSpec(), PartitionSpec()
        )


def sharded_pre(x, params: Params, config: Config, *, mesh, token_axes=None, tensor_axis=None):
    """``pre`` on the kernels under ``jax.shard_map``: x's first axis split over the mesh axes
    ``token_axes`` and, with ``tensor_axis``, its last axis (D) split over that mesh axis.

    Data parallelism (token_axes): parameters are replicated and each device runs the fused
    kernels on its tokens; shard_map's transpose sums the parameter gradients over the mesh.

    Tensor parallelism (tensor_axis): each device holds D / size features of every stream and
    the matching rows of norm_weight and phi (shard them as ``norm_weight.reshape(n, D)`` and
    ``phi.reshape(n, D, N)`` on axis 1 to avoid any resharding). The RMS and the projection sum
    over all of n*D, so each device computes its partial sums, and one all-reduce of a
    [tokens, N+1] f32 array per call (and one of [tokens, 2n + n*n] in the backward) completes
    them; x itself never moves. Gradients equal one device's (tests/python/sharding_cases.py).

    Use ``sharded_post`` with the returned context and the same mesh and axes.
    """
    check_pre_args(x, params, config)
    n, d = x.shape[-2:]
    layout = _Layout(mesh, token_axes, tensor_axis, x.ndim, d)
    slices, axis = layout.slices, layout.tensor_axis

    def local(x_local, params_local):
        lead, dl = x_local.shape[:-2], x_local.shape[-1]
        flat = Params(
            params_local.norm_weight.reshape(n * dl),
            params_local.phi.reshape(n * dl, -1),
            params_local.alpha,
            params_local.bias,
        )
        if slices == 1:  # the fused kernels: one pass over x
            layer_in, ctx = _pre_kernel(x_local, flat, config)
            return layer_in, ctx.x, ctx.h_post, ctx.h_res
        layer_in, x_ctx, h_post, h_res = _kernels.pre_sliced(config, axis, slices, x_local.reshape(-1, n, dl), flat)
        return (
            layer_in.reshape(*lead, dl),
            x_ctx.reshape(x_local.shape),
            h_post.reshape(*lead, n),
            h_res.reshape(*lead, n, n),
        )

    width = config.projection_width
    shaped = Params(params.norm_weight.reshape(n, d), params.phi.reshape(n, d, width), params.alpha, params.bias)
    layer_in, x_ctx, h_post, h_res = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(layout.x, layout.params),
        out_specs=(layout.layer_in, layout.x, layout.coefficients, layout.coefficients),
        check_vma=False,
    )(x, shaped)
    return layer_in, Context(x_ctx, h_post, h_res, config, True)


def sharded_post(layer_out, ctx: Context, *, mesh, token_axes=None, tensor_axis=None):
    """``post`` on the kernels, sharded like ``sharded_pre`` (same mesh, token_axes and
    tensor_axis). Purely local: each device mixes its own slice of the streams."""
    check_post_args(layer_out, ctx)
    if not ctx.use_kernel:
        raise ValueError("ctx: sharded_post needs the context of sharded_pre (use_kernel=True)")
    layout = _Layout(mesh, token_axes, tensor_axis, ctx.x.ndim, ctx.x.shape[-1])

    def local(layer_out_local, x_local, h_post_local, h_res_local):
        return _post_kernel(layer_out_local, Context(x_local, h_post_local, h_res_local, ctx.config, True))

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(layout.layer_in, layout.x, layout.coefficients, layout.coefficients),
        out_specs=layout.x,
        check_vma=False,
    )(layer_out, ctx.x, ctx.h_post, ctx.h_res)

"""mHC for JAX: ``pre`` and ``post`` around a sublayer, on the fused C++ kernels or plain JAX.

A stack of sublayers, with each post fused into the next sublayer's pre (spec: Boundary):

    state = x                                              # x: [..., n, D], f32 or bf16
    for params, branch in sublayers:
        state = mhc.jax.sublayer(state, params, config, branch)   # a Pending post
    x = mhc.jax.finish(state)                              # [..., n, D]

One sublayer on its own:

    layer_in, ctx = mhc.jax.pre(x, params, config)
    out = mhc.jax.post(branch(layer_in), ctx)              # out: [..., n, D]

With ``use_kernel=True`` (default) both are ``jax.custom_vjp`` functions whose forward and
backward are the C++ operations (XLA FFI custom calls); with ``use_kernel=False`` they are the
plain jax.numpy formulas of ``mhc.jax.reference``, differentiated by JAX. On a platform without
the kernels, ``use_kernel=True`` raises when the program is lowered (README, Support).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mhc.jax import _kernels, reference  # _kernels registers the FFI targets at import
from mhc.jax._types import (
    Config,
    Context,
    HeadParams,
    Params,
    Pending,
    check_head_args,
    check_post_args,
    check_pre_args,
    init_head_params,
    init_params,
)

__all__ = [
    "Config",
    "Context",
    "Params",
    "init_params",
    "HeadParams",
    "init_head_params",
    "head",
    "pre",
    "post",
    "boundary",
    "Pending",
    "sublayer",
    "finish",
    "expand",
    "reduce",
    "sharded_pre",
    "sharded_post",
    "reference",
]


def _pre_kernel(x, params: Params, config: Config):
    layer_in, x_ctx, h_post, h_res = _kernels.pre(config, x, params)
    return layer_in, Context(x_ctx, h_post, h_res, config, True)


def _post_kernel(layer_out, ctx: Context):
    return _kernels.post(ctx.config, ctx.x, layer_out, ctx.h_post, ctx.h_res)


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


def boundary(
    layer_out: jax.Array,
    ctx: Context,
    params: Params,
    config: Config,
    *,
    use_kernel: bool = True,
    fallback: str = "warn",
):
    """``post(layer_out, ctx)`` then ``pre`` of the next sublayer on its result, in one pass
    (spec: Boundary): the next sublayer's (layer_in, Context), whose ``x`` is the new streams.

    On the kernel path (``use_kernel`` and ``ctx.use_kernel``) the CPU runs the fused boundary
    kernels: the new streams are written once and projected while in cache, and the backward
    recomputes them instead of keeping them, never storing their gradient. The results equal the
    two calls bit for bit. With D split over devices it runs the two operations.

    ``fallback``: what to do on a platform without the fused kernels but with the ``post`` and
    ``pre`` kernels (a GPU): run those two, with a warning once per process (``"warn"``), without
    it (``"allow"``), or raise instead (``"error"``). A platform without any mhc kernel (a TPU)
    raises either way; ``use_kernel=False`` runs the plain formulas anywhere.
    ``config`` is the next sublayer's (same n as ``ctx.config``).
    """
    if fallback not in _kernels.FALLBACK_CHOICES:
        raise ValueError(f"fallback: expected one of {_kernels.FALLBACK_CHOICES}, got {fallback!r}")
    check_post_args(layer_out, ctx)
    if not (use_kernel and ctx.use_kernel):
        return pre(post(layer_out, ctx), params, config, use_kernel=use_kernel)
    if config.n != ctx.config.n:
        raise ValueError(f"config: the next sublayer's n ({config.n}) must equal ctx.config.n ({ctx.config.n})")
    check_pre_args(ctx.x, params, config)
    x, h_post, h_res = ctx.x, ctx.h_post, ctx.h_res
    layer_in, x_next, h_post, h_res = _kernels.boundary(config, fallback, x, layer_out, h_post, h_res, params)
    return layer_in, Context(x_next, h_post, h_res, config, True)


def sublayer(
    state, params: Params, config: Config, branch, *, use_kernel: bool = True, fallback: str = "warn"
) -> Pending:
    """One mHC-wrapped sublayer of a stack, its post left pending so that the next sublayer's
    pre fuses with it (``boundary``).

    state: the streams [..., n, D] (the first sublayer) or the ``Pending`` the previous sublayer
    returned; branch: layer_in [..., D] -> layer_out [..., D] (e.g. norm then attention).
    Returns a ``Pending``: pass it to the next ``sublayer``, or to ``finish`` for the streams.
    Works under jit, grad, checkpoint and scan (``Pending`` is a pytree). ``fallback``: as for
    ``boundary``.
    """
    if isinstance(state, Pending):
        layer_in, ctx = boundary(state.layer_out, state.ctx, params, config, use_kernel=use_kernel, fallback=fallback)
    else:
        layer_in, ctx = pre(state, params, config, use_kernel=use_kernel)
    return Pending(branch(layer_in), ctx)


def finish(state) -> jax.Array:
    """The streams [..., n, D] of a chain: the pending post applied (an array passes through)."""
    if isinstance(state, Pending):
        return post(state.layer_out, state.ctx)
    return state


def expand(h: jax.Array, n: int) -> jax.Array:
    """Repeat an embedding [..., D] into n streams [..., n, D] (no scaling)."""
    return jnp.broadcast_to(h[..., None, :], (*h.shape[:-1], n, h.shape[-1]))


def reduce(x: jax.Array) -> jax.Array:
    """Sum the streams [..., n, D] back to [..., D]."""
    return x.sum(axis=-2, dtype=jnp.float32).astype(x.dtype)


def head(x: jax.Array, params: HeadParams, config: Config, *, use_kernel: bool = True) -> jax.Array:
    """DeepSeek-V4's learned collapse of the streams [..., n, D] into one [..., D] (spec: Head), in
    place of ``reduce``: out = sum_k g_k x_k, g = sigmoid(scale * r * (x_flat . fn^T) + base) + pre_eps.

    params: f32 ``HeadParams`` (fn [n, n*D], base [n], scale [1]); uses config.n, rms_eps and pre_eps.
    The kernels run on the CPU only: elsewhere ``use_kernel=True`` raises, ``use_kernel=False``
    runs the plain formulas.
    """
    if not use_kernel:
        return reference.head(x, params, config)
    check_head_args(x, params, config)
    return _kernels.head(config, x, params)


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


def _constrain(mesh, value, spec):
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, spec))


def sharded_pre(x, params: Params, config: Config, *, mesh, token_axes=None, tensor_axis=None):
    """``pre`` with x, layer_in and the context constrained to a layout: x's first axis split over
    the mesh axes ``token_axes`` and, with ``tensor_axis``, its last axis (D) over that mesh axis.

    A convenience only: ``pre`` itself carries the partitioning rules, so plain ``jax.jit`` on
    arrays already sharded this way does the same (README, "Many devices"). This checks the axes
    and pins the shardings with ``jax.lax.with_sharding_constraint``; call it under ``jax.jit``
    (outside jit the calls run, correctly, on whole arrays).

    Data parallelism (token_axes): each device runs the fused kernels on its tokens; the parameter
    gradients are summed over the token axes by one all-reduce.

    Tensor parallelism (tensor_axis): each device holds D / size features of every stream and
    uses the matching rows of norm_weight and phi (rows k*D + d of each stream k): replicated
    parameters are sliced on each device without communication. The RMS and the projection sum
    over all of n*D: each device computes its partial sums, and one all-reduce of a [tokens, N+1]
    f32 array per call completes them (in the backward, [tokens, n] for dh_pre and
    [tokens, n + n*n] for dh_post and dh_res, which XLA combines); x itself never moves.

    Use ``sharded_post`` with the returned context and the same mesh and axes.
    """
    check_pre_args(x, params, config)
    layout = _Layout(mesh, token_axes, tensor_axis, x.ndim, x.shape[-1])
    layer_in, ctx = _pre_kernel(_constrain(mesh, x, layout.x), params, config)
    return _constrain(mesh, layer_in, layout.layer_in), Context(
        _constrain(mesh, ctx.x, layout.x),
        _constrain(mesh, ctx.h_post, layout.coefficients),
        _constrain(mesh, ctx.h_res, layout.coefficients),
        config,
        True,
    )


def sharded_post(layer_out, ctx: Context, *, mesh, token_axes=None, tensor_axis=None):
    """``post`` with its output constrained like ``sharded_pre`` (same mesh, token_axes and
    tensor_axis). Purely local: each device mixes its own slice of the streams."""
    check_post_args(layer_out, ctx)
    if not ctx.use_kernel:
        raise ValueError("ctx: sharded_post needs the context of sharded_pre (use_kernel=True)")
    layout = _Layout(mesh, token_axes, tensor_axis, ctx.x.ndim, ctx.x.shape[-1])
    out = _post_kernel(_constrain(mesh, layer_out, layout.layer_in), ctx)
    return _constrain(mesh, out, layout.x)

"""post: the kernel calls, per-device functions, partitioned operations and custom VJP."""

from __future__ import annotations

import functools

import jax

from mhc._config import Config
from mhc.jax._kernels.dispatch import (
    RESIDUAL_COEFFICIENTS,
    RESIDUAL_LAYER_OUT,
    RESIDUAL_X,
    _apply,
    _call,
    _flat,
    _lead,
    _named,
    _psum_together,
    _unflat,
)
from mhc.jax._partitioning import Operation


def post_forward(config: Config, x, layer_out, h_post, h_res):
    return _call("mhc_post_forward", config, x, layer_out, h_post, h_res)


def post_backward(config: Config, g, x, layer_out, h_post, h_res):
    return _call("mhc_post_backward", config, g, x, layer_out, h_post, h_res)


def _post_forward_local(config: Config, plan, x, layer_out, h_post, h_res):
    lead = x.shape[:-2]
    return _unflat(lead, post_forward(config, *_flat(lead, x, layer_out, h_post, h_res)))


def _post_backward_local(config: Config, plan, g, x, layer_out, h_post, h_res):
    lead = x.shape[:-2]
    dx_partial, dlayer_out, dh_post, dh_res = post_backward(config, *_flat(lead, g, x, layer_out, h_post, h_res))
    # dh_post and dh_res sum over D: with D split, one all-reduce completes them.
    dh_post, dh_res = _psum_together((dh_post, dh_res), plan.feature_axes)
    return _unflat(lead, dx_partial, dlayer_out, dh_post, dh_res)


POST_FORWARD = Operation(
    "post_forward",
    targets=("mhc_post_forward",),
    split_targets=("mhc_post_forward",),  # the same kernel on each device's features
    operands=("Bnd", "Bd", "Bn", "Bnm"),
    results=("Bnd",),
    local=_post_forward_local,
)
POST_BACKWARD = Operation(
    "post_backward",
    targets=("mhc_post_backward",),
    split_targets=("mhc_post_backward",),  # the same kernel, then an all-reduce of dh_post, dh_res
    operands=("Bnd", "Bnd", "Bd", "Bn", "Bnm"),
    results=("Bnd", "Bd", "Bn", "Bnm"),
    local=_post_backward_local,
    primary=1,  # x
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def post(config: Config, tensor_axis, x, layer_out, h_post, h_res):
    """-> out [..., n, D]."""
    return _apply(POST_FORWARD, config, _lead(x), x, layer_out, h_post, h_res, tensor_axis=tensor_axis)[0]


def _post_fwd(config, tensor_axis, x, layer_out, h_post, h_res):
    out = post(config, tensor_axis, x, layer_out, h_post, h_res)
    return out, (
        *_named(RESIDUAL_X, x),
        *_named(RESIDUAL_LAYER_OUT, layer_out),
        *_named(RESIDUAL_COEFFICIENTS, h_post, h_res),
    )


def _post_bwd(config, tensor_axis, residuals, g):
    return tuple(_apply(POST_BACKWARD, config, _lead(residuals[0]), g, *residuals, tensor_axis=tensor_axis))


post.defvjp(_post_fwd, _post_bwd)

"""Pallas TPU kernels for mHC (a backend beside the CPU and CUDA ones). Every kernel is unverified
on TPU hardware: each is checked in TPU interpret mode against the float64 reference, lowered to
Mosaic, and compiled for v5e/v6e through libtpu's compile-only topologies, never run on a chip.

The functions take and return the flat shapes of mhc.jax's kernel calls (x [T, n, D], Params with
norm_weight [n D] and phi [n D, N]), so that a dispatch can swap them in.

KERNELS is the one place that says which operations this backend has: it maps the name of the C++
backends' FFI target to a function taking the same operands in the same order,
``kernel(config, *operands, interpret=None)``, and returning the same results. The dispatch in
mhc.jax reads it, so a kernel added here is used on a TPU with no other change."""

from mhc.jax._types import HeadParams, Params
from mhc.tpu._boundary import (
    boundary_backward,
    boundary_backward_carried,
    boundary_forward,
    boundary_forward_carried,
)
from mhc.tpu._collapse import collapse_backward, collapse_forward
from mhc.tpu._head import head_backward, head_forward
from mhc.tpu._layout import TOKEN_TILES
from mhc.tpu._post import post_backward, post_forward
from mhc.tpu._pre import pre_forward, pre_forward_carried
from mhc.tpu._pre_backward import pre_backward, pre_backward_carried


def _pre_forward_target(config, x, norm_weight, phi, alpha, bias, *, interpret=None):
    return pre_forward(config, x, Params(norm_weight, phi, alpha, bias), interpret=interpret)


def _pre_forward_carried_target(config, x, carried, norm_weight, phi, alpha, bias, *, interpret=None):
    return pre_forward_carried(config, x, carried, Params(norm_weight, phi, alpha, bias), interpret=interpret)


def _pre_backward_carried_target(
    config, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, carried, norm_weight, phi, alpha, bias, *, interpret=None
):
    params = Params(norm_weight, phi, alpha, bias)
    cotangents = (dlayer_in, dx_partial, dh_pre, dh_post, dh_res)
    return pre_backward_carried(config, *cotangents, x, carried, params, interpret=interpret)


def _boundary_forward_target(config, x, layer_out, h_post, h_res, norm_weight, phi, alpha, bias, *, interpret=None):
    return boundary_forward(
        config, x, layer_out, h_post, h_res, Params(norm_weight, phi, alpha, bias), interpret=interpret
    )


def _pre_backward_target(
    config, dlayer_in, dx_partial, dh_post, dh_res, x, norm_weight, phi, alpha, bias, *, interpret=None
):
    params = Params(norm_weight, phi, alpha, bias)
    return pre_backward(config, dlayer_in, dx_partial, dh_post, dh_res, x, params, interpret=interpret)


def _boundary_backward_target(
    config,
    dlayer_in,
    dx_partial_next,
    dh_post_next,
    dh_res_next,
    x,
    layer_out,
    h_post,
    h_res,
    norm_weight,
    phi,
    alpha,
    bias,
    *,
    interpret=None,
):
    cotangents = (dlayer_in, dx_partial_next, dh_post_next, dh_res_next)
    params = Params(norm_weight, phi, alpha, bias)
    return boundary_backward(config, *cotangents, x, layer_out, h_post, h_res, params, interpret=interpret)


def _boundary_forward_carried_target(
    config, x, layer_out, h_pre, h_post, h_res, norm_weight, phi, alpha, bias, *, interpret=None
):
    params = Params(norm_weight, phi, alpha, bias)
    return boundary_forward_carried(config, x, layer_out, h_pre, h_post, h_res, params, interpret=interpret)


def _boundary_backward_carried_target(
    config,
    next_dlayer_in,
    next_dx_partial,
    next_dh_pre,
    next_dh_post,
    next_dh_res,
    x,
    layer_out,
    h_pre,
    h_post,
    h_res,
    norm_weight,
    phi,
    alpha,
    bias,
    *,
    interpret=None,
):
    cotangents = (next_dlayer_in, next_dx_partial, next_dh_pre, next_dh_post, next_dh_res)
    params = Params(norm_weight, phi, alpha, bias)
    return boundary_backward_carried(
        config, *cotangents, x, layer_out, h_pre, h_post, h_res, params, interpret=interpret
    )


def _head_forward_target(config, x, fn, base, scale, *, interpret=None):
    return head_forward(config, x, HeadParams(fn, base, scale), interpret=interpret)


def _head_backward_target(config, dout, x, fn, base, scale, *, interpret=None):
    return head_backward(config, dout, x, HeadParams(fn, base, scale), interpret=interpret)


KERNELS = {
    "mhc_pre_forward": _pre_forward_target,
    "mhc_post_forward": post_forward,
    "mhc_post_backward": post_backward,
    "mhc_boundary_forward": _boundary_forward_target,
    "mhc_pre_backward": _pre_backward_target,
    "mhc_head_forward": _head_forward_target,
    "mhc_head_backward": _head_backward_target,
    "mhc_boundary_backward": _boundary_backward_target,
    # DeepSeek-V4.1's carried mix (spec: Single-pass schedule).
    "mhc_pre_forward_carried": _pre_forward_carried_target,
    "mhc_pre_backward_carried": _pre_backward_carried_target,
    "mhc_collapse_forward": collapse_forward,
    "mhc_collapse_backward": collapse_backward,
    "mhc_boundary_forward_carried": _boundary_forward_carried_target,
    "mhc_boundary_backward_carried": _boundary_backward_carried_target,
}

__all__ = [
    "KERNELS",
    "TOKEN_TILES",
    "boundary_backward",
    "boundary_backward_carried",
    "boundary_forward",
    "boundary_forward_carried",
    "collapse_backward",
    "collapse_forward",
    "head_backward",
    "head_forward",
    "post_backward",
    "post_forward",
    "pre_backward",
    "pre_backward_carried",
    "pre_forward",
    "pre_forward_carried",
]

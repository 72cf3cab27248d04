"""The boundary (post of sublayer l, then pre of l+1, fused): the kernel calls, per-device
functions, partitioned operations and custom VJPs of V4's and V4.1's boundary."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mhc._config import Config, Params
from mhc.jax._kernels.dispatch import (
    _F32,
    _PARAMS,
    RESIDUAL_COEFFICIENTS,
    RESIDUAL_LAYER_OUT,
    RESIDUAL_PARTIALS,
    RESIDUAL_X,
    _apply,
    _call,
    _flat,
    _lead,
    _local_param_grads,
    _local_params,
    _named,
    _param_grads,
    _present,
    _shaped,
    _split_form,
    _target,
    _unflat,
    _v4_results,
    _where_registered,
    _zero_padded_rows,
)
from mhc.jax._kernels.post import (
    POST_BACKWARD,
    POST_FORWARD,
    _post_backward_local,
    _post_forward_local,
)
from mhc.jax._kernels.pre import (
    PRE_BACKWARD,
    PRE_BACKWARD_CARRIED,
    PRE_FORWARD,
    PRE_FORWARD_CARRIED,
    _pre_backward_local,
    _pre_forward_local,
)
from mhc.jax._partitioning import Operation


def boundary_forward(config: Config, x, layer_out, h_post, h_res, params: Params, *, h_pre=None):
    args = (x, layer_out, *_present(h_pre), h_post, h_res, *params)
    return _call(_target("mhc_boundary_forward", h_pre), config, *args)


def boundary_backward(config: Config, next_cotangents, x, layer_out, h_post, h_res, params: Params, *, h_pre=None):
    """-> dx_partial, dlayer_out, dh_post, dh_res, (V4.1: dh_pre, the cotangent of h_pre: the
    dcarried of sublayer l+1,) then the parameter gradients of l+1. ``next_cotangents``: those of
    l+1's pre, V4.1's with its dh_pre third."""
    args = (*next_cotangents, x, layer_out, *_present(h_pre), h_post, h_res, *params)
    return _call(_target("mhc_boundary_backward", h_pre), config, *args)


def _boundary_forward_local(config: Config, plan, x, layer_out, h_pre, h_post, h_res, *shaped):
    """post of sublayer l, then pre of l+1 (V4.1: reading h_pre of l) -> x_next and the pre's
    results: fused where the platform has the boundary kernel and D is whole, else (a platform
    whose backend has no boundary kernel, or D split over devices) the two operations in turn. A
    platform with neither was refused by the platform check."""
    operation = BOUNDARY_FORWARD if h_pre is None else BOUNDARY_FORWARD_CARRIED

    def separate():
        (x_next,) = _post_forward_local(config, plan, x, layer_out, h_post, h_res)
        return (x_next, *_pre_forward_local(config, plan, x_next, h_pre, *shaped))

    def fused():
        lead = x.shape[:-2]
        xf, lo, hpre, hp, hr = _flat(lead, x, layer_out, h_pre, h_post, h_res)
        results = boundary_forward(config, xf, lo, hp, hr, _local_params(config, *shaped), h_pre=hpre)
        partials = jnp.zeros((*lead, config.projection_width + 1), _F32)  # only the split backward reads them
        return (*_unflat(lead, *results), partials)

    if plan.slices > 1:
        x = _split_form(operation, x)
        return separate()
    return tuple(jax.lax.platform_dependent(**_where_registered(operation.targets[0], fused), default=separate))


def _boundary_forward_v4_local(config: Config, plan, x, layer_out, h_post, h_res, *shaped):
    return _v4_results(_boundary_forward_local(config, plan, x, layer_out, None, h_post, h_res, *shaped), 2)


def _boundary_backward_local(config: Config, plan, *operands):
    """pre_backward of sublayer l+1 (its x recomputed by the post of l; V4.1: carried = h_pre of
    l), then post_backward of l with g = its dx -> dx_partial, dlayer_out, dh_pre (V4.1: l+1's
    dcarried), dh_post, dh_res of l and the parameter gradients of l+1: fused where the platform
    has the kernel and D is whole (dx_next never stored), else in turn."""
    next_cotangents, (x, layer_out, h_pre, h_post, h_res, partials), shaped = (
        operands[:5],
        operands[5:11],
        operands[11:],
    )
    operation = BOUNDARY_BACKWARD if h_pre is None else BOUNDARY_BACKWARD_CARRIED

    def separate():
        (x_next,) = _post_forward_local(config, plan, x, layer_out, h_post, h_res)
        dx_next, dh_pre, *grads = _pre_backward_local(config, plan, *next_cotangents, x_next, h_pre, partials, *shaped)
        dx_partial, dlayer_out, dh_post, dh_res = _post_backward_local(
            config, plan, dx_next, x, layer_out, h_post, h_res
        )
        return (dx_partial, dlayer_out, dh_pre, dh_post, dh_res, *grads)

    def fused():
        lead, (n, d) = x.shape[:-2], x.shape[-2:]
        # Padded rows zeroed in the post's inputs too: the x_next recomputed from them is then zero.
        padded = _zero_padded_rows(plan.valid_tokens(lead), *next_cotangents, x, layer_out, h_pre, h_post, h_res)
        flat = _flat(lead, *padded)
        xf, lo, hpre, hp, hr = flat[5:]
        dx_partial, dlayer_out, dh_post, dh_res, *grads = boundary_backward(
            config, _present(*flat[:5]), xf, lo, hp, hr, _local_params(config, *shaped), h_pre=hpre
        )
        dh_pre = None if h_pre is None else grads.pop(0)
        post_grads = _unflat(lead, dx_partial, dlayer_out, dh_pre, dh_post, dh_res)
        return (*post_grads, *_local_param_grads(plan, grads, n, d))

    if plan.slices > 1:
        x = _split_form(operation, x)
        return separate()
    return tuple(jax.lax.platform_dependent(**_where_registered(operation.targets[0], fused), default=separate))


def _boundary_backward_v4_local(config: Config, plan, *operands):
    """V4's operands are V4.1's without the two V4.1 adds: the cotangent of l+1's h_pre and h_pre of l."""
    dli, dxp, dhp, dhr, x, layer_out, h_post, h_res, *rest = operands
    operands = (dli, dxp, None, dhp, dhr, x, layer_out, None, h_post, h_res, *rest)
    return _v4_results(_boundary_backward_local(config, plan, *operands), 2)


BOUNDARY_FORWARD = Operation(
    "boundary_forward",
    targets=("mhc_boundary_forward",),
    split_targets=(*POST_FORWARD.split_targets, *PRE_FORWARD.split_targets),  # post, then pre (no fused split)
    operands=("Bnd", "Bd", "Bn", "Bnm", *_PARAMS),
    results=("Bnd", "Bd", "Bn", "Bnm", "Bp"),
    local=_boundary_forward_v4_local,
    fallback=(POST_FORWARD, PRE_FORWARD),
)
BOUNDARY_BACKWARD = Operation(
    "boundary_backward",
    targets=("mhc_boundary_backward",),
    split_targets=(*POST_FORWARD.split_targets, *PRE_BACKWARD.split_targets, *POST_BACKWARD.split_targets),
    operands=("Bd", "Bnd", "Bn", "Bnm", "Bnd", "Bd", "Bn", "Bnm", "Bp", *_PARAMS),
    results=("Bnd", "Bd", "Bn", "Bnm", *_PARAMS),
    local=_boundary_backward_v4_local,
    primary=4,  # x
    fallback=(PRE_BACKWARD, POST_BACKWARD, POST_FORWARD),
)


BOUNDARY_FORWARD_CARRIED = Operation(
    "boundary_forward_carried",
    targets=("mhc_boundary_forward_carried",),
    split_targets=(*POST_FORWARD.split_targets, *PRE_FORWARD_CARRIED.split_targets),  # no fused split
    operands=("Bnd", "Bd", "Bn", "Bn", "Bnm", *_PARAMS),
    results=("Bnd", "Bd", "Bn", "Bn", "Bnm", "Bp"),
    local=_boundary_forward_local,
    fallback=(POST_FORWARD, PRE_FORWARD_CARRIED),
)
BOUNDARY_BACKWARD_CARRIED = Operation(
    "boundary_backward_carried",
    targets=("mhc_boundary_backward_carried",),
    split_targets=(*POST_FORWARD.split_targets, *PRE_BACKWARD_CARRIED.split_targets, *POST_BACKWARD.split_targets),
    operands=("Bd", "Bnd", "Bn", "Bn", "Bnm", "Bnd", "Bd", "Bn", "Bn", "Bnm", "Bp", *_PARAMS),
    results=("Bnd", "Bd", "Bn", "Bn", "Bnm", *_PARAMS),
    local=_boundary_backward_local,
    primary=5,  # x
    fallback=(PRE_BACKWARD_CARRIED, POST_BACKWARD, POST_FORWARD),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def boundary(config: Config, fallback: str, tensor_axis, x, layer_out, h_post, h_res, params: Params):
    """post of sublayer l (x, layer_out, h_post, h_res) then pre of l+1 (params, config) ->
    layer_in [..., D], x_next (for the next context), h_post [..., n], h_res [..., n, n] of l+1:
    the outputs of ``pre`` for x_next. The backward keeps x, not x_next (recomputed per tile).
    ``fallback``: one of FALLBACK_CHOICES, for a platform without the fused kernels."""
    return _boundary_fwd(config, fallback, tensor_axis, x, layer_out, h_post, h_res, params)[0]


def _boundary_fwd(config, fallback, tensor_axis, x, layer_out, h_post, h_res, params):
    shaped = _shaped(config, x.shape[-1], params, tensor_axis)
    operands = (x, layer_out, h_post, h_res, *shaped)
    x_next, layer_in, next_h_post, next_h_res, partials = _apply(
        BOUNDARY_FORWARD, config, _lead(x), *operands, fallback=fallback, tensor_axis=tensor_axis
    )
    saved = (
        *_named(RESIDUAL_X, x),
        *_named(RESIDUAL_LAYER_OUT, layer_out),
        *_named(RESIDUAL_COEFFICIENTS, h_post, h_res),
        *_named(RESIDUAL_PARTIALS, partials),
    )
    return (layer_in, x_next, next_h_post, next_h_res), (*saved, params)


def _boundary_bwd(config, fallback, tensor_axis, residuals, cotangents):
    x, layer_out, h_post, h_res, partials, params = residuals
    shaped = _shaped(config, x.shape[-1], params, tensor_axis)
    # cotangents: layer_in, x_next (the next post's dx_partial), h_post, h_res of sublayer l+1.
    operands = (*cotangents, x, layer_out, h_post, h_res, partials, *shaped)
    results = _apply(BOUNDARY_BACKWARD, config, _lead(x), *operands, fallback=fallback, tensor_axis=tensor_axis)
    return (*results[:4], _param_grads(params, tensor_axis, *results[4:]))


boundary.defvjp(_boundary_fwd, _boundary_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def boundary_carried(config: Config, fallback: str, tensor_axis, x, layer_out, h_pre, h_post, h_res, params: Params):
    """post of sublayer l (x, layer_out, h_post, h_res) then V4.1's pre of l+1 reading h_pre of l
    -> layer_in [..., D], x_next, h_pre, h_post, h_res of l+1: the outputs of ``pre_carried`` for
    x_next. The backward keeps x, not x_next (recomputed per tile)."""
    return _boundary_carried_fwd(config, fallback, tensor_axis, x, layer_out, h_pre, h_post, h_res, params)[0]


def _boundary_carried_fwd(config, fallback, tensor_axis, x, layer_out, h_pre, h_post, h_res, params):
    shaped = _shaped(config, x.shape[-1], params, tensor_axis)
    operands = (x, layer_out, h_pre, h_post, h_res, *shaped)
    x_next, layer_in, next_h_pre, next_h_post, next_h_res, partials = _apply(
        BOUNDARY_FORWARD_CARRIED, config, _lead(x), *operands, fallback=fallback, tensor_axis=tensor_axis
    )
    saved = (
        *_named(RESIDUAL_X, x),
        *_named(RESIDUAL_LAYER_OUT, layer_out),
        *_named(RESIDUAL_COEFFICIENTS, h_pre, h_post, h_res),
        *_named(RESIDUAL_PARTIALS, partials),
    )
    return (layer_in, x_next, next_h_pre, next_h_post, next_h_res), (*saved, params)


def _boundary_carried_bwd(config, fallback, tensor_axis, residuals, cotangents):
    x, layer_out, h_pre, h_post, h_res, partials, params = residuals
    shaped = _shaped(config, x.shape[-1], params, tensor_axis)
    # cotangents: layer_in, x_next (the next post's dx_partial), h_pre, h_post, h_res of l+1.
    operands = (*cotangents, x, layer_out, h_pre, h_post, h_res, partials, *shaped)
    results = _apply(BOUNDARY_BACKWARD_CARRIED, config, _lead(x), *operands, fallback=fallback, tensor_axis=tensor_axis)
    return (*results[:5], _param_grads(params, tensor_axis, *results[5:]))


boundary_carried.defvjp(_boundary_carried_fwd, _boundary_carried_bwd)

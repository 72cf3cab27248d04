"""pre: the kernel calls, per-device functions, partitioned operations and custom VJPs of V4's pre
and V4.1's carried pre (spec: Algorithm, Single-pass schedule, Tensor parallelism)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mhc._config import Config, Params
from mhc.jax._kernels.dispatch import (
    _F32,
    _PARAMS,
    RESIDUAL_COEFFICIENTS,
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
    _zero_padded_rows,
)
from mhc.jax._partitioning import Operation


def pre_forward(config: Config, x, params: Params, *, carried=None):
    return _call(_target("mhc_pre_forward", carried), config, x, *_present(carried), *params)


def pre_backward(
    config: Config, dlayer_in, dx_partial, dh_post, dh_res, x, params: Params, *, dh_pre=None, carried=None
):
    """-> dx, (V4.1: dcarried,) then the parameter gradients. V4.1 takes dh_pre, the cotangent of
    the sublayer's own h_pre; V4 derives it from dlayer_in."""
    args = (dlayer_in, dx_partial, *_present(dh_pre), dh_post, dh_res, x, *_present(carried), *params)
    return _call(_target("mhc_pre_backward", carried), config, *args)


def pre_forward_partials(config: Config, slices: int, x, norm_weight, phi):
    return _call("mhc_pre_forward_partials", config, x, norm_weight, phi, slices=slices)


def pre_forward_finish(config: Config, slices: int, x, partials, alpha, bias, *, carried=None):
    args = (x, partials, *_present(carried), alpha, bias)
    return _call(_target("mhc_pre_forward_finish", carried), config, *args, slices=slices)


def pre_backward_partials(config: Config, slices: int, dlayer_in, x):
    return _call("mhc_pre_backward_partials", config, dlayer_in, x, slices=slices)


def pre_backward_finish(
    config: Config,
    slices: int,
    dlayer_in,
    dx_partial,
    dh_pre,
    dh_post,
    dh_res,
    x,
    partials,
    params: Params,
    *,
    carried=None,
):
    args = (dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials, *_present(carried), *params)
    return _call(_target("mhc_pre_backward_finish", carried), config, *args, slices=slices)


def _pre_forward_local(config: Config, plan, x, carried, norm_weight, phi, alpha, bias):
    """-> layer_in, h_pre (which V4.1 carries to the next sublayer), h_post, h_res, partials."""
    lead, width = x.shape[:-2], config.projection_width
    xf, cf = _flat(lead, x, carried)
    params = _local_params(config, norm_weight, phi, alpha, bias)
    if plan.slices == 1:
        coefficients = pre_forward(config, xf, params, carried=cf)
        partials = jnp.zeros((xf.shape[0], width + 1), _F32)  # only the split backward reads them
    else:
        xf = _split_form(PRE_FORWARD if carried is None else PRE_FORWARD_CARRIED, xf)
        partials = pre_forward_partials(config, plan.slices, xf, params.norm_weight, params.phi)
        partials = jax.lax.psum(partials, plan.feature_axes)
        coefficients = pre_forward_finish(config, plan.slices, xf, partials, alpha, bias, carried=cf)
    return _unflat(lead, *coefficients, partials)


def _pre_forward_v4_local(config: Config, plan, x, *shaped):
    return _v4_results(_pre_forward_local(config, plan, x, None, *shaped), 1)


def _pre_backward_local(
    config: Config, plan, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, carried, partials, *shaped
):
    """-> dx, dcarried, then the parameter gradients. V4.1: dh_pre is the cotangent of this
    sublayer's own h_pre (from the next sublayer or the collapse), not derived from dlayer_in, and
    dcarried the carried mix's. V4: dh_pre, carried and dcarried are None."""
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    operands = (dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, carried, partials)
    dli, dxp, dhpre, dhp, dhr, xf, cf, pf = _flat(lead, *_zero_padded_rows(plan.valid_tokens(lead), *operands))
    params = _local_params(config, *shaped)
    v4 = carried is None
    if plan.slices == 1:
        dx, *grads = pre_backward(config, dli, dxp, dhp, dhr, xf, params, dh_pre=dhpre, carried=cf)
        dcarried = None if v4 else grads.pop(0)
    else:
        xf = _split_form(PRE_BACKWARD if v4 else PRE_BACKWARD_CARRIED, xf)
        # <x_k, dlayer_in> over this device's features (none for V4.1's one-hot [T, 0]): V4's
        # dh_pre once summed over D in one all-reduce; V4.1's dcarried, summed the same way under
        # jit, left as this device's share inside shard_map (Plan.shares), where the incoming
        # dh_pre is a share instead and takes that one all-reduce.
        one_hot = not v4 and not cf.shape[-1]
        x_dli = jnp.zeros(cf.shape, _F32) if one_hot else pre_backward_partials(config, plan.slices, dli, xf)
        if v4:
            dhpre, dcarried = jax.lax.psum(x_dli, plan.feature_axes), None
        elif plan.shares:
            dhpre, dcarried = jax.lax.psum(dhpre, plan.feature_axes), x_dli
        else:
            dcarried = x_dli if one_hot else jax.lax.psum(x_dli, plan.feature_axes)
        dx, *grads = pre_backward_finish(config, plan.slices, dli, dxp, dhpre, dhp, dhr, xf, pf, params, carried=cf)
    return (*_unflat(lead, dx, dcarried), *_local_param_grads(plan, grads, n, d))


def _pre_backward_v4_local(config: Config, plan, dlayer_in, dx_partial, dh_post, dh_res, x, partials, *shaped):
    operands = (dlayer_in, dx_partial, None, dh_post, dh_res, x, None, partials)
    return _v4_results(_pre_backward_local(config, plan, *operands, *shaped), 1)


PRE_FORWARD = Operation(
    "pre_forward",
    targets=("mhc_pre_forward",),
    split_targets=("mhc_pre_forward_partials", "mhc_pre_forward_finish"),
    operands=("Bnd", *_PARAMS),
    results=("Bd", "Bn", "Bnm", "Bp"),
    local=_pre_forward_v4_local,
)
PRE_BACKWARD = Operation(
    "pre_backward",
    targets=("mhc_pre_backward",),
    split_targets=("mhc_pre_backward_partials", "mhc_pre_backward_finish"),
    operands=("Bd", "Bnd", "Bn", "Bnm", "Bnd", "Bp", *_PARAMS),
    results=("Bnd", *_PARAMS),
    local=_pre_backward_v4_local,
    primary=4,  # x: a cotangent's sharding may not be known (a replicated constant upstream)
)


PRE_FORWARD_CARRIED = Operation(
    "pre_forward_carried",
    targets=("mhc_pre_forward_carried",),
    split_targets=("mhc_pre_forward_partials", "mhc_pre_forward_finish_carried"),
    operands=("Bnd", "Bc", *_PARAMS),
    results=("Bd", "Bn", "Bn", "Bnm", "Bp"),
    local=_pre_forward_local,
)
PRE_BACKWARD_CARRIED = Operation(
    "pre_backward_carried",
    targets=("mhc_pre_backward_carried",),
    split_targets=("mhc_pre_backward_partials", "mhc_pre_backward_finish_carried"),
    operands=("Bd", "Bnd", "Bn", "Bn", "Bnm", "Bnd", "Bc", "Bp", *_PARAMS),
    results=("Bnd", "Bc", *_PARAMS),
    local=_pre_backward_local,
    primary=5,  # x
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def pre(config: Config, tensor_axis, x, params: Params):
    """x [..., n, D] -> layer_in [..., D], x (for the context), h_post [..., n], h_res [..., n, n].
    ``tensor_axis``: None, or inside shard_map the mesh axis that splits D (x holds D / size of it;
    params every feature's rows)."""
    return _pre_fwd(config, tensor_axis, x, params)[0]


def _pre_fwd(config, tensor_axis, x, params):
    shaped = _shaped(config, x.shape[-1], params, tensor_axis)
    layer_in, h_post, h_res, partials = _apply(PRE_FORWARD, config, _lead(x), x, *shaped, tensor_axis=tensor_axis)
    (x_saved,) = _named(RESIDUAL_X, x)
    (partials,) = _named(RESIDUAL_PARTIALS, partials)
    return (layer_in, x, h_post, h_res), (x_saved, partials, params)


def _pre_bwd(config, tensor_axis, residuals, cotangents):
    x, partials, params = residuals
    shaped = _shaped(config, x.shape[-1], params, tensor_axis)
    operands = (*cotangents, x, partials, *shaped)
    grads = _apply(PRE_BACKWARD, config, _lead(x), *operands, tensor_axis=tensor_axis)
    return grads[0], _param_grads(params, tensor_axis, *grads[1:])


pre.defvjp(_pre_fwd, _pre_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def pre_carried(config: Config, tensor_axis, x, carried, params: Params):
    """V4.1's pre: x [..., n, D] and the carried mix [..., n] (or [..., 0]: the one-hot) ->
    layer_in [..., D], x (for the context), h_pre [..., n] (to carry), h_post, h_res. The
    cotangent of h_pre enters the backward's gate step as given (spec: Single-pass schedule)."""
    return _pre_carried_fwd(config, tensor_axis, x, carried, params)[0]


def _pre_carried_fwd(config, tensor_axis, x, carried, params):
    shaped = _shaped(config, x.shape[-1], params, tensor_axis)
    operands = (x, carried, *shaped)
    layer_in, h_pre, h_post, h_res, partials = _apply(
        PRE_FORWARD_CARRIED, config, _lead(x), *operands, tensor_axis=tensor_axis
    )
    saved = (*_named(RESIDUAL_X, x), *_named(RESIDUAL_COEFFICIENTS, carried), *_named(RESIDUAL_PARTIALS, partials))
    return (layer_in, x, h_pre, h_post, h_res), (*saved, params)


def _pre_carried_bwd(config, tensor_axis, residuals, cotangents):
    x, carried, partials, params = residuals
    shaped = _shaped(config, x.shape[-1], params, tensor_axis)
    operands = (*cotangents, x, carried, partials, *shaped)
    dx, dcarried, *grads = _apply(PRE_BACKWARD_CARRIED, config, _lead(x), *operands, tensor_axis=tensor_axis)
    return dx, dcarried, _param_grads(params, tensor_axis, *grads)


pre_carried.defvjp(_pre_carried_fwd, _pre_carried_bwd)

"""V4.1's collapse: the kernel calls, per-device functions, partitioned operations and custom VJP."""

from __future__ import annotations

import functools
import math

import jax

from mhc._config import Config
from mhc.jax._kernels.dispatch import (
    RESIDUAL_COEFFICIENTS,
    RESIDUAL_X,
    _apply,
    _call,
    _lead,
    _named,
    _psum_together,
)
from mhc.jax._partitioning import Operation


def collapse_forward(config: Config, x, carried):
    return _call("mhc_collapse_forward", config, x, carried)


def collapse_backward(config: Config, dout, x, carried):
    return _call("mhc_collapse_backward", config, dout, x, carried)


def _collapse_forward_local(config: Config, plan, x, carried):
    """Per feature: with D split each device collapses its own features, no collective."""
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    t = math.prod(lead)
    return (collapse_forward(config, x.reshape(t, n, d), carried.reshape(t, n)).reshape(*lead, d),)


def _collapse_backward_local(config: Config, plan, dout, x, carried):
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    t = math.prod(lead)
    dx, dcarried = collapse_backward(config, dout.reshape(t, d), x.reshape(t, n, d), carried.reshape(t, n))
    # dcarried sums over D: with D split, one all-reduce completes it under jit; inside shard_map
    # it stays this device's share (Plan.shares), summed by the transpose of the carried input or
    # by the pre backward that takes it as dh_pre.
    if not plan.shares:
        (dcarried,) = _psum_together((dcarried,), plan.feature_axes)
    return dx.reshape(x.shape), dcarried.reshape(carried.shape)


COLLAPSE_FORWARD = Operation(
    "collapse_forward",
    targets=("mhc_collapse_forward",),
    split_targets=("mhc_collapse_forward",),  # the same kernel on each device's features
    operands=("Bnd", "Bn"),
    results=("Bd",),
    local=_collapse_forward_local,
)
COLLAPSE_BACKWARD = Operation(
    "collapse_backward",
    targets=("mhc_collapse_backward",),
    split_targets=("mhc_collapse_backward",),  # the same kernel, then an all-reduce of dcarried
    operands=("Bd", "Bnd", "Bn"),
    results=("Bnd", "Bn"),
    local=_collapse_backward_local,
    primary=1,  # x
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def collapse(config: Config, tensor_axis, x, carried):
    """V4.1's end: x [..., n, D], carried [..., n] -> sum_k carried[k] x[k], [..., D]."""
    return _apply(COLLAPSE_FORWARD, config, _lead(x), x, carried, tensor_axis=tensor_axis)[0]


def _collapse_fwd(config, tensor_axis, x, carried):
    out = collapse(config, tensor_axis, x, carried)
    return out, (*_named(RESIDUAL_X, x), *_named(RESIDUAL_COEFFICIENTS, carried))


def _collapse_bwd(config, tensor_axis, residuals, dout):
    x, carried = residuals
    return tuple(_apply(COLLAPSE_BACKWARD, config, _lead(x), dout, x, carried, tensor_axis=tensor_axis))


collapse.defvjp(_collapse_fwd, _collapse_bwd)

"""DeepSeek-V4's head: the kernel calls, per-device functions, partitioned operations and custom VJP."""

from __future__ import annotations

import functools
import math

import jax

from mhc._config import Config, HeadParams
from mhc.jax._kernels.dispatch import (
    RESIDUAL_X,
    _apply,
    _call,
    _lead,
    _named,
    _psum_together,
    _zero_padded_rows,
    on_common_manual_axes,
)
from mhc.jax._partitioning import Operation


def head_forward(config: Config, x, head: HeadParams):
    return _call("mhc_head_forward", config, x, *head)


def head_backward(config: Config, dout, x, head: HeadParams):
    return _call("mhc_head_backward", config, dout, x, *head)


def _head_forward_local(config: Config, plan, x, fn, base, scale):
    """The head on this device's tokens (D whole: the head has no split form)."""
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    out, _ = head_forward(config, x.reshape(math.prod(lead), n, d), HeadParams(fn, base, scale))
    return (out.reshape(*lead, d),)


def _head_backward_local(config: Config, plan, dout, x, fn, base, scale):
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    dout, x = _zero_padded_rows(plan.valid_tokens(lead), dout, x)
    t = math.prod(lead)
    dx, *grads = head_backward(config, dout.reshape(t, d), x.reshape(t, n, d), HeadParams(fn, base, scale))
    return (dx.reshape(x.shape), *_psum_together(grads, plan.token_axes))


# The head: D written as "e" (gathered), fn [n, n*D] as "qf", base [n] as "q", scale [1] as "s"
# (replicated; q apart from x's n, as for _PARAMS).
_HEAD_PARAMS = ("qf", "q", "s")
HEAD_FORWARD = Operation(
    "head_forward",
    targets=("mhc_head_forward",),
    split_targets=(),  # none: D is gathered
    operands=("Bne", *_HEAD_PARAMS),
    results=("Be",),
    local=_head_forward_local,
    splits_features=False,
)
HEAD_BACKWARD = Operation(
    "head_backward",
    targets=("mhc_head_backward",),
    split_targets=(),
    operands=("Be", "Bne", *_HEAD_PARAMS),
    results=("Bne", *_HEAD_PARAMS),
    local=_head_backward_local,
    primary=1,  # x
    splits_features=False,
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def head(config: Config, x, params: HeadParams):
    """DeepSeek-V4's head: x [..., n, D] -> [..., D]. The backward recomputes the gates from x."""
    return _apply(HEAD_FORWARD, config, _lead(x), x, *params)[0]


def _head_fwd(config, x, params):
    return head(config, x, params), (*_named(RESIDUAL_X, x), params)


def _head_bwd(config, residuals, dout):
    x, params = residuals
    dx, dfn, dbase, dscale = _apply(HEAD_BACKWARD, config, _lead(x), dout, x, *params)
    return dx, HeadParams(dfn, dbase, dscale)


head.defvjp(_head_fwd, _head_bwd)


def head_gathering_features(config: Config, tensor_axis: str, x, params: HeadParams):
    """The head inside shard_map with D split over ``tensor_axis`` (it has no split form): x
    all-gathered over the axis, the head on the whole D on every device of it, and this device's
    slice of the output kept. The backward (JAX's transposes) reduce-scatters dx."""
    d = x.shape[-1]
    whole = jax.lax.all_gather(x, tensor_axis, axis=x.ndim - 1, tiled=True)
    out = head(config, *on_common_manual_axes(whole, params))
    return jax.lax.dynamic_slice_in_dim(out, jax.lax.axis_index(tensor_axis) * d, d, axis=-1)

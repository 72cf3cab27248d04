"""mHC for PyTorch: ``pre`` and ``post`` around a sublayer, on mhc's C++ kernels or plain torch.

The same functional API as ``mhc.jax``, name for name, on torch tensors ``[..., n, D]`` in
float32 or bfloat16 (parameters float32). A stack of sublayers, each post fused into the next
sublayer's pre (spec: Boundary):

    state = x
    for params, branch in sublayers:
        state = mhc.torch.sublayer(state, params, config, branch)   # a Pending post
    x = mhc.torch.finish(state)

DeepSeek-V4.1 (``Config(n, pre_from_previous=True)``): each pre reads the previous sublayer's
gates (the carried mix), and the model ends with ``collapse(state)`` instead of a head.

With ``use_kernel=True`` (default) every step is a torch custom op (``torch.ops.mhc.*``) that runs
mhc's C++ kernel on the CPU, forward and backward (``torch.autograd``), traced by
``torch.compile`` through its fake implementation; the results have the bits of ``mhc.jax``'s
kernel path. ``use_kernel=False`` runs the spec's formulas in plain torch (``mhc.torch.reference``)
on any device. CUDA tensors with ``use_kernel=True`` raise: the CUDA backend has never run
(unverified). Importing this module never imports jax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.utils.checkpoint

from mhc._config import BINDING_API, Config, HeadParams, Params, PreApply
from mhc._errors import names_its_errors
from mhc.torch import _checks, _ops, reference

__all__ = list(BINDING_API)


class Context(NamedTuple):
    """What ``pre`` hands to ``post``: the streams x, the gates, and (V4.1) this sublayer's h_pre."""

    x: torch.Tensor
    h_post: torch.Tensor
    h_res: torch.Tensor
    config: Config
    use_kernel: bool
    h_pre: torch.Tensor | None = None


class Pending(NamedTuple):
    """A sublayer whose post is not applied yet: the next ``sublayer`` fuses it with its pre."""

    layer_out: torch.Tensor
    ctx: Context


class Streams(NamedTuple):
    """Streams with their post applied, and (V4.1) the mix the next pre reads."""

    x: torch.Tensor
    carried: torch.Tensor | None = None


def init_params(config: Config, dim: int, *, generator: torch.Generator | None = None) -> Params:
    """alpha 0.01, bias 0, norm_weight 1, phi ~ N(0, 1/(n*D)); dim is D, the features per stream."""
    m = config.n * dim
    phi = torch.randn((m, config.projection_width), generator=generator) / m**0.5
    return Params(
        norm_weight=torch.ones(m),
        phi=phi,
        alpha=torch.full((3,), 0.01),
        bias=torch.zeros(config.projection_width),
    )


def init_head_params(config: Config, dim: int, *, generator: torch.Generator | None = None) -> HeadParams:
    """scale 0.01, base 0, fn ~ N(0, 1/(n*D)); dim is D."""
    m = config.n * dim
    return HeadParams(
        fn=torch.randn((config.n, m), generator=generator) / m**0.5,
        base=torch.zeros(config.n),
        scale=torch.full((1,), 0.01),
    )


def _lead_and_tokens(x: torch.Tensor):
    return x.shape[:-2], _ops.tokens(x, 2)


def _unflat(lead, *tensors):
    return tuple(t.reshape(*lead, *t.shape[1:]) for t in tensors)


@names_its_errors("mhc.torch.pre")
def pre(x: torch.Tensor, params: Params, config: Config, *, carried=None, use_kernel: bool = True):
    """The sublayer's input [..., D] (x's dtype) and the ``Context`` for ``post`` (spec: Forward
    steps 1-6). carried: only with ``config.pre_from_previous`` (V4.1): the mix [..., n] f32 the
    pre-apply reads (the previous sublayer's ``ctx.h_pre``); None is the one-hot on stream 0."""
    _checks.check_pre_args(x, params, config, use_kernel)
    _checks.check_carried(carried, x, config, use_kernel)
    pre_apply = PreApply.of(config, carried)
    if not use_kernel:
        h_pre, h_post, h_res = reference.coefficients(x, params, config)
        layer_in = reference.pre_apply(pre_apply, x, h_pre, carried)
        return layer_in, Context(x, h_post, h_res, config, False, None if pre_apply is PreApply.OWN_GATES else h_pre)
    lead, xf = _lead_and_tokens(x)
    if pre_apply is PreApply.OWN_GATES:
        layer_in, x_ctx, h_post, h_res = _ops.PreFunction.apply(config, xf, *params)
        layer_in, x_ctx, h_post, h_res = _unflat(lead, layer_in, x_ctx, h_post, h_res)
        return layer_in, Context(x_ctx, h_post, h_res, config, True)
    carried = _ops.carried_operand(pre_apply, xf, carried)
    outputs = _unflat(lead, *_ops.PreCarriedFunction.apply(config, xf, carried, *params))
    layer_in, x_ctx, h_pre, h_post, h_res = outputs
    return layer_in, Context(x_ctx, h_post, h_res, config, True, h_pre)


def _check_ctx(ctx) -> None:
    if not isinstance(ctx, Context):
        raise TypeError(f"ctx: expected the Context returned by mhc.torch.pre, got {type(ctx).__name__}")


@names_its_errors("mhc.torch.post")
def post(layer_out: torch.Tensor, ctx: Context) -> torch.Tensor:
    """The new streams [..., n, D]: H_res^T x + H_post layer_out (spec: Forward step 8), on the
    path (kernel or plain) of the ``pre`` that made ``ctx``."""
    _check_ctx(ctx)
    _checks.check_layer_out(layer_out, ctx.x, ctx.use_kernel)
    if not ctx.use_kernel:
        return reference.post(ctx.x, layer_out, ctx.h_post, ctx.h_res)
    lead = ctx.x.shape[:-2]
    flat = (_ops.tokens(ctx.x, 2), _ops.tokens(layer_out, 1), _ops.tokens(ctx.h_post, 1), _ops.tokens(ctx.h_res, 2))
    return _ops.PostFunction.apply(ctx.config, *flat).reshape(*lead, *ctx.x.shape[-2:])


@names_its_errors("mhc.torch.boundary")
def boundary(layer_out: torch.Tensor, ctx: Context, params: Params, config: Config, *, use_kernel: bool = True):
    """``post(layer_out, ctx)`` then the next sublayer's ``pre`` in one fused pass (spec: Boundary):
    the next (layer_in, Context). Same bits as the two calls. V4.1: the next pre reads ``ctx.h_pre``."""
    _check_ctx(ctx)
    if not (use_kernel and ctx.use_kernel):
        return pre(post(layer_out, ctx), params, config, carried=ctx.h_pre, use_kernel=False)
    if config.n != ctx.config.n:
        raise ValueError(f"config: the next sublayer's n ({config.n}) must equal ctx.config.n ({ctx.config.n})")
    if config.pre_from_previous != ctx.config.pre_from_previous:
        raise ValueError("config: pre_from_previous must be the same for every sublayer of a chain (V4 or V4.1)")
    _checks.check_pre_args(ctx.x, params, config, True)
    _checks.check_layer_out(layer_out, ctx.x, True)
    lead = ctx.x.shape[:-2]
    flat = (_ops.tokens(ctx.x, 2), _ops.tokens(layer_out, 1))
    h_post, h_res = _ops.tokens(ctx.h_post, 1), _ops.tokens(ctx.h_res, 2)
    if not config.pre_from_previous:
        outputs = _ops.BoundaryFunction.apply(config, *flat, h_post, h_res, *params)
        layer_in, x_next, next_h_post, next_h_res = _unflat(lead, *outputs)
        return layer_in, Context(x_next, next_h_post, next_h_res, config, True)
    h_pre = _ops.tokens(ctx.h_pre, 1)
    outputs = _ops.BoundaryCarriedFunction.apply(config, *flat, h_pre, h_post, h_res, *params)
    layer_in, x_next, next_h_pre, next_h_post, next_h_res = _unflat(lead, *outputs)
    return layer_in, Context(x_next, next_h_post, next_h_res, config, True, next_h_pre)


@names_its_errors("mhc.torch.sublayer")
def sublayer(state, params: Params, config: Config, branch: Callable, *, use_kernel: bool = True) -> Pending:
    """One mHC-wrapped sublayer of a chain, its post left pending for the next sublayer's pre.
    state: the streams [..., n, D], the previous ``Pending``, or ``Streams``; branch: layer_in
    [..., D] -> layer_out [..., D]."""
    if isinstance(state, Pending):
        layer_in, ctx = boundary(state.layer_out, state.ctx, params, config, use_kernel=use_kernel)
    elif isinstance(state, Streams):
        layer_in, ctx = pre(state.x, params, config, carried=state.carried, use_kernel=use_kernel)
    else:
        layer_in, ctx = pre(state, params, config, use_kernel=use_kernel)
    return Pending(branch(layer_in), ctx)


@names_its_errors("mhc.torch.finish")
def finish(state) -> torch.Tensor:
    """The streams [..., n, D] of a chain: the pending post applied (a tensor passes through)."""
    if isinstance(state, Pending):
        return post(state.layer_out, state.ctx)
    if isinstance(state, Streams):
        return state.x
    return state


@names_its_errors("mhc.torch.streams")
def streams(state) -> Streams:
    """A chain's state as ``Streams(x, carried)``: the post applied, and in V4.1 the mix the next
    pre reads. The seam where the caller may change the streams (V4.1's Engram)."""
    if isinstance(state, Pending):
        return Streams(post(state.layer_out, state.ctx), state.ctx.h_pre)
    if isinstance(state, Streams):
        return state
    _checks.check_activation("state", state, use_kernel=False)
    return Streams(state, None)


@names_its_errors("mhc.torch.collapse")
def collapse(state, *, use_kernel: bool = True) -> torch.Tensor:
    """DeepSeek-V4.1's end of the model: h [..., D] = sum_k carried[k] x[k] (x's dtype), from the
    Pending of a V4.1 chain or ``Streams`` with a carried mix."""
    if isinstance(state, Pending):
        if state.ctx.h_pre is None:
            raise ValueError(
                "state: collapse is DeepSeek-V4.1's end and needs a chain of Config(..., pre_from_previous=True); "
                "a V4 chain ends with finish (then head or reduce)"
            )
        x, carried, config = post(state.layer_out, state.ctx), state.ctx.h_pre, state.ctx.config
        use_kernel = use_kernel and state.ctx.use_kernel
    elif isinstance(state, Streams):
        if state.carried is None:
            raise ValueError("state: Streams without a carried mix (carried=None); collapse needs the last h_pre")
        x, carried = state
        _checks.check_streams("x", x, None, use_kernel)
        config = Config(n=x.shape[-2], pre_from_previous=True)
    else:
        raise TypeError(f"state: expected the Pending of a V4.1 chain or mhc.torch.Streams, got {type(state).__name__}")
    _checks.check_streams("x", x, None, use_kernel)
    _checks.check_tensor("carried", carried, (torch.float32,), x.shape[:-1], use_kernel)
    if not use_kernel:
        return reference.collapse(x, carried)
    out = _ops.CollapseFunction.apply(config, _ops.tokens(x, 2), _ops.tokens(carried, 1))
    return out.reshape(*x.shape[:-2], x.shape[-1])


@names_its_errors("mhc.torch.head")
def head(x: torch.Tensor, params: HeadParams, config: Config, *, use_kernel: bool = True) -> torch.Tensor:
    """DeepSeek-V4's learned collapse of the streams [..., n, D] into [..., D] (spec: Head)."""
    _checks.check_head_args(x, params, config, use_kernel)
    if not use_kernel:
        return reference.head(x, params, config)
    out = _ops.HeadFunction.apply(config, _ops.tokens(x, 2), *params)
    return out.reshape(*x.shape[:-2], x.shape[-1])


def stack(
    state,
    sublayers: Sequence[tuple[Params, Config, Callable]],
    *,
    recompute: int | None = None,
    use_kernel: bool = True,
):
    """``sublayer`` over each (params, config, branch) in order; returns the last ``Pending``.
    recompute=k: each group of k sublayers runs under ``torch.utils.checkpoint`` (non-reentrant),
    so its backward recomputes the group's forward (branches included) instead of keeping it."""
    if recompute is not None and (isinstance(recompute, bool) or not isinstance(recompute, int) or recompute < 1):
        raise ValueError(f"mhc.torch.stack: recompute: expected None or a group size k >= 1, got {recompute!r}")
    sublayers = list(sublayers)
    size = recompute or max(1, len(sublayers))
    for start in range(0, len(sublayers), size):
        group = sublayers[start : start + size]

        def run(state, group=group):
            for params, config, branch in group:
                state = sublayer(state, params, config, branch, use_kernel=use_kernel)
            return state

        state = torch.utils.checkpoint.checkpoint(run, state, use_reentrant=False) if recompute else run(state)
    return state


def expand(h: torch.Tensor, n: int) -> torch.Tensor:
    """Repeat an embedding [..., D] into n streams [..., n, D] (no scaling), contiguous."""
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1]).contiguous()


def reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum the streams [..., n, D] back to [..., D] (in f32, rounded once)."""
    return x.float().sum(dim=-2).to(x.dtype)

"""mHC for JAX: ``pre`` and ``post`` around a sublayer, on the fused C++ kernels or plain JAX.

A stack of sublayers, with each post fused into the next sublayer's pre (spec: Boundary):

    state = x                                              # x: [..., n, D], f32 or bf16
    for params, branch in sublayers:
        state = mhc.jax.sublayer(state, params, config, branch)   # a Pending post
    x = mhc.jax.finish(state)                              # [..., n, D]

A whole stack in one call, optionally recomputing the streams inside groups of sublayers in
the backward instead of keeping them (``recompute=k``; ``suggested_recompute`` picks k):

    state = mhc.jax.stack(x, [(params, config, branch), ...], recompute=k)
    x = mhc.jax.finish(state)

DeepSeek-V4.1's single-pass schedule (``Config(n, pre_from_previous=True)``; spec: Single-pass
schedule): each pre-apply reads the previous sublayer's pre gates, the carried mix (the first
sublayer: the one-hot on stream 0), and the model ends with ``collapse`` instead of a head:

    state = mhc.jax.stack(x, [(params, config, branch), ...])   # V4.1 configs
    h = mhc.jax.collapse(state)                            # [..., D]: sum_k carried[k] x[k]

A seam where the streams change between a post and the next pre (V4.1's Engram):

    s = mhc.jax.streams(state)                             # Streams(x, carried), the post applied
    state = mhc.jax.Streams(s.x + update, s.carried)       # the next sublayer takes it

One sublayer on its own:

    layer_in, ctx = mhc.jax.pre(x, params, config)
    out = mhc.jax.post(branch(layer_in), ctx)              # out: [..., n, D]

With ``use_kernel=True`` (default) both are ``jax.custom_vjp`` functions whose forward and
backward are the C++ operations (XLA FFI custom calls); with ``use_kernel=False`` they are the
plain jax.numpy formulas of ``mhc.jax.reference``, differentiated by JAX. On a platform without
the kernels, ``use_kernel=True`` raises when the program is lowered (README, Support).
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from mhc._config import BINDING_API, PreApply
from mhc.jax import _kernels, reference  # _kernels registers the FFI targets at import
from mhc.jax._kernels import RESIDUAL_NAMES  # the checkpoint_names of the custom VJPs' residuals
from mhc.jax._types import (
    Config,
    Context,
    HeadParams,
    Params,
    Pending,
    Streams,
    check_activation,
    check_carried,
    check_collapse_args,
    check_head_args,
    check_post_args,
    check_pre_args,
    names_its_errors,
)
from mhc.jax._types import init_head_params as init_head_params  # re-exported (BINDING_API)
from mhc.jax._types import init_params as init_params

__all__ = [*BINDING_API, "recompute_streams", "recompute_policy", "suggested_recompute", "RESIDUAL_NAMES"]


def _tensor_slices(tensor_axis, use_kernel: bool) -> int:
    """How many devices split D: the size of ``tensor_axis`` (a mesh axis of the enclosing
    ``jax.shard_map``), 1 without it."""
    if tensor_axis is None:
        return 1
    if not isinstance(tensor_axis, str):
        raise TypeError(
            f"tensor_axis: expected the name (str) of the mesh axis that splits D, or None, got {tensor_axis!r}"
        )
    if not use_kernel:
        raise ValueError(
            "tensor_axis: the plain path (use_kernel=False) has no split form; inside jax.shard_map with "
            "D split, use the kernels (use_kernel=True)"
        )
    try:
        return jax.lax.axis_size(tensor_axis)
    except NameError:
        raise ValueError(
            f"tensor_axis: {tensor_axis!r} is not a mesh axis of an enclosing jax.shard_map. tensor_axis names "
            "the manual axis that splits D inside shard_map; under jax.jit on sharded arrays D needs no argument"
        ) from None


def _rows(params, field: str, axis: int):
    """The parameter's size along the axis of n * D, or None if it is not an array (checked later)."""
    value = getattr(params, field, None)
    return value.shape[axis] if getattr(value, "ndim", 0) > 0 else None


def _global_x(x, rows, what: str, tensor_axis, slices: int, function: str):
    """x's shape with the whole D (its last axis times ``slices``), for the argument checks; and
    the errors of ``mhc.jax.<function>`` when the parameters' rows and x's D disagree about the
    split (inside shard_map with D split, x holds a slice and the parameters every feature)."""
    if x.ndim < 2 or rows is None:  # the argument checks name what is wrong
        return x
    n, d = x.shape[-2:]
    name = f"mhc.jax.{function}: {what}"
    if tensor_axis is None and n and d and rows != n * d and rows % (n * d) == 0:
        raise ValueError(
            f"{name}: {rows} rows are {rows // n} features per stream, but x holds D = {d} (shape "
            f"{tuple(x.shape)}): inside jax.shard_map with D split over a mesh axis, pass "
            "tensor_axis=<the mesh axis that splits D> (the parameters stay whole, every feature's rows)"
        )
    if tensor_axis is not None and rows == n * d and slices > 1:
        whole = f"(n * D = {n * d * slices} rows, replicated)"
        split = _kernels.varies_over(x, tensor_axis)
        if split:  # x holds a D slice: so do the parameters
            raise ValueError(
                f"{name}: {rows} rows are this device's D = {d} only; with tensor_axis={tensor_axis!r} pass the "
                f"whole parameters {whole}, not their D slice"
            )
        if split is False:  # x the same on every device of the axis: its D is whole
            raise ValueError(
                f"{name}: tensor_axis={tensor_axis!r} says x's D is split over {slices} devices, but x holds "
                f"D = {d} and the parameters {rows} rows (n * D), every feature for both: x's last axis is not "
                f"split over {tensor_axis!r}. Leave tensor_axis out "
                f"when each device holds the whole D, or split x's D over {tensor_axis!r} (shard_map's in_specs) "
                f"and keep the parameters whole {whole}"
            )
        raise ValueError(  # shard_map without check_vma: no type says whether x is split
            f"{name}: {rows} rows match x's D = {d}. If x's last axis is not split over {tensor_axis!r}, leave "
            f"tensor_axis out; if it is, pass the whole parameters {whole}, not their D slice"
        )
    return jax.ShapeDtypeStruct((*x.shape[:-1], x.shape[-1] * slices), x.dtype) if slices > 1 else x


@names_its_errors("mhc.jax.pre")
def pre(
    x: jax.Array,
    params: Params,
    config: Config,
    *,
    carried: jax.Array | None = None,
    use_kernel: bool = True,
    tensor_axis: str | None = None,
):
    """The sublayer's input and the context for ``post`` (spec: Forward steps 1-6).

    x: [..., n, D] in float32 or bfloat16; params: f32 ``Params``. Returns layer_in [..., D] in
    x's dtype and a ``Context`` (x, h_post, h_res) to pass to ``post``.

    carried: only with ``config.pre_from_previous`` (DeepSeek-V4.1; spec: Single-pass schedule):
    the mix [..., n] f32 that the pre-apply reads, layer_in = sum_k carried[k] x[k]: the previous
    sublayer's ``ctx.h_pre``; None is the one-hot on stream 0 (the first sublayer). The context
    then holds this sublayer's own gates as ``ctx.h_pre``, for the next sublayer or ``collapse``;
    gradients flow back through both (the cotangent of ``ctx.h_pre`` enters this sublayer's gate
    backward, and the carried mix gets sum_d x[k, d] dlayer_in[d]).

    tensor_axis: only inside ``jax.shard_map`` with D split over a mesh axis: that axis's name.
    x is then this device's [..., n, D / size] slice and params the whole, replicated parameters
    (n * D rows); pre runs the tensor-parallel split (partial sums, one psum over the axis,
    finish), forward and backward, and layer_in is this device's slice. The parameter gradients
    come back whole (shard_map sums them over the mesh axes, as for any replicated input). Under
    ``jax.jit`` on sharded arrays leave it None: the partitioning rules split D themselves.
    """
    slices = _tensor_slices(tensor_axis, use_kernel)
    if not use_kernel:
        return reference.pre(x, params, config, carried)
    check_activation("x", x)
    check_pre_args(
        _global_x(x, _rows(params, "norm_weight", 0), "params.norm_weight", tensor_axis, slices, "pre"), params, config
    )
    check_carried(carried, x, config)
    pre_apply = PreApply.of(config, carried)
    if pre_apply is PreApply.OWN_GATES:
        x, params = _kernels.on_common_manual_axes(x, params)
        layer_in, x_ctx, h_post, h_res = _kernels.pre(config, tensor_axis, x, params)
        return layer_in, Context(x_ctx, h_post, h_res, config, True, tensor_axis)
    carried = _kernels.carried_operand(pre_apply, x, carried)
    x, carried, params = _kernels.on_common_manual_axes(x, carried, params)
    layer_in, x_ctx, h_pre, h_post, h_res = _kernels.pre_carried(config, tensor_axis, x, carried, params)
    return layer_in, Context(x_ctx, h_post, h_res, config, True, tensor_axis, h_pre=h_pre)


@names_its_errors("mhc.jax.post")
def post(layer_out: jax.Array, ctx: Context) -> jax.Array:
    """The new streams [..., n, D]: H_res^T x + H_post layer_out (spec: Forward step 8).

    layer_out: [..., D] (float32 or bfloat16). Runs the same path (kernel or reference) as the
    ``pre`` that produced ``ctx``, with its ``tensor_axis`` (the context carries it).
    """
    check_post_args(layer_out, ctx)
    if not ctx.use_kernel:
        return reference.post(layer_out, ctx)
    x, layer_out, h_post, h_res = _kernels.on_common_manual_axes(ctx.x, layer_out, ctx.h_post, ctx.h_res)
    return _kernels.post(ctx.config, ctx.tensor_axis, x, layer_out, h_post, h_res)


@names_its_errors("mhc.jax.boundary")
def boundary(
    layer_out: jax.Array,
    ctx: Context,
    params: Params,
    config: Config,
    *,
    use_kernel: bool = True,
    fallback: str = "warn",
    tensor_axis: str | None = None,
):
    """``post(layer_out, ctx)`` then ``pre`` of the next sublayer on its result, in one pass
    (spec: Boundary): the next sublayer's (layer_in, Context), whose ``x`` is the new streams.

    On the kernel path (``use_kernel`` and ``ctx.use_kernel``) the CPU and the TPU run the fused
    boundary kernels: the new streams are written once and projected while in cache, and the backward
    recomputes them instead of keeping them, never storing their gradient. The results equal the
    two calls bit for bit. With D split over devices it runs the two operations.

    ``fallback``: what to do on a platform without the fused kernels but with the ``post`` and
    ``pre`` kernels (a GPU): run those two, with a warning once per process (``"warn"``), without
    it (``"allow"``), or raise instead (``"error"``). The CPU and the TPU have the fused kernels,
    a GPU only the fallback's; a platform without any mhc kernel raises either way;
    ``use_kernel=False`` runs the plain formulas anywhere.
    ``config`` is the next sublayer's (same n as ``ctx.config``). ``tensor_axis``: as for ``pre``,
    and the same as the one ``ctx`` was made with (the streams keep their layout).

    V4.1 (``pre_from_previous`` in both configs): the next pre reads ``ctx.h_pre`` as its carried
    mix, and the fused kernels are V4.1's boundary (spec: Single-pass schedule).
    """
    _check_fallback(fallback)
    check_post_args(layer_out, ctx)
    if tensor_axis != ctx.tensor_axis:
        raise ValueError(
            f"tensor_axis: expected the tensor_axis of the pre that made ctx ({ctx.tensor_axis!r}), got {tensor_axis!r}"
        )
    if isinstance(config, Config) and config.pre_from_previous != ctx.config.pre_from_previous:
        raise ValueError(
            f"config: the next sublayer's pre_from_previous ({config.pre_from_previous}) must equal "
            f"ctx.config.pre_from_previous ({ctx.config.pre_from_previous}): a chain runs one schedule, V4 or V4.1"
        )
    if not (use_kernel and ctx.use_kernel):
        options = dict(carried=ctx.h_pre, use_kernel=use_kernel, tensor_axis=tensor_axis)
        return pre(post(layer_out, ctx), params, config, **options)
    if config.n != ctx.config.n:
        raise ValueError(f"config: the next sublayer's n ({config.n}) must equal ctx.config.n ({ctx.config.n})")
    slices = _tensor_slices(tensor_axis, use_kernel)
    rows = _rows(params, "norm_weight", 0)
    check_pre_args(_global_x(ctx.x, rows, "params.norm_weight", tensor_axis, slices, "boundary"), params, config)
    if config.pre_from_previous:
        operands = _kernels.on_common_manual_axes(ctx.x, layer_out, ctx.h_pre, ctx.h_post, ctx.h_res, params)
        layer_in, x_next, h_pre, h_post, h_res = _kernels.boundary_carried(config, fallback, tensor_axis, *operands)
        return layer_in, Context(x_next, h_post, h_res, config, True, tensor_axis, h_pre=h_pre)
    x, layer_out, h_post, h_res, params = _kernels.on_common_manual_axes(
        ctx.x, layer_out, ctx.h_post, ctx.h_res, params
    )
    operands = (x, layer_out, h_post, h_res, params)
    layer_in, x_next, h_post, h_res = _kernels.boundary(config, fallback, tensor_axis, *operands)
    return layer_in, Context(x_next, h_post, h_res, config, True, tensor_axis)


def _check_fallback(fallback) -> None:
    if fallback not in _kernels.FALLBACK_CHOICES:
        raise ValueError(f"fallback: expected one of {_kernels.FALLBACK_CHOICES}, got {fallback!r}")


@names_its_errors("mhc.jax.sublayer")
def sublayer(
    state,
    params: Params,
    config: Config,
    branch,
    *,
    use_kernel: bool = True,
    fallback: str = "warn",
    tensor_axis: str | None = None,
) -> Pending:
    """One mHC-wrapped sublayer of a stack, its post left pending so that the next sublayer's
    pre fuses with it (``boundary``).

    state: the streams [..., n, D] (the first sublayer; in V4.1 it reads the one-hot on stream 0),
    the ``Pending`` the previous sublayer returned, or ``Streams`` (x and, in V4.1, the carried
    mix: the streams changed between a post and this pre, ``streams``); branch: layer_in [..., D]
    -> layer_out [..., D] (e.g. norm then attention).
    Returns a ``Pending``: pass it to the next ``sublayer``, or to ``finish`` for the streams.
    Works under jit, grad, checkpoint and scan (``Pending`` is a pytree). ``fallback``: as for
    ``boundary``; ``tensor_axis``: as for ``pre`` (the same for every sublayer of the chain).
    """
    _check_fallback(fallback)  # the first sublayer too, though only the next ones use it
    options = dict(use_kernel=use_kernel, tensor_axis=tensor_axis)
    if isinstance(state, Pending):
        layer_in, ctx = boundary(state.layer_out, state.ctx, params, config, fallback=fallback, **options)
    elif isinstance(state, Streams):
        layer_in, ctx = pre(state.x, params, config, carried=state.carried, **options)
    else:
        layer_in, ctx = pre(state, params, config, **options)
    return Pending(branch(layer_in), ctx)


@names_its_errors("mhc.jax.finish")
def finish(state) -> jax.Array:
    """The streams [..., n, D] of a chain: the pending post applied (an array passes through)."""
    if isinstance(state, Pending):
        return post(state.layer_out, state.ctx)
    if isinstance(state, Streams):
        return state.x
    return state


@names_its_errors("mhc.jax.streams")
def streams(state) -> Streams:
    """A chain's state as ``Streams(x, carried)``: the pending post applied, and in V4.1 the mix the
    next sublayer's pre reads (the last sublayer's ``ctx.h_pre``; None in V4, and for plain
    streams, whose next pre reads the one-hot). The seam where the caller may change the
    streams: ``sublayer(Streams(x + update, carried), ...)`` runs the post, the update and the
    pre separately where ``sublayer`` on the Pending would fuse them (spec: Single-pass schedule)."""
    if isinstance(state, Pending):
        return Streams(post(state.layer_out, state.ctx), state.ctx.h_pre)
    if isinstance(state, Streams):
        return state
    check_activation("state", state)
    return Streams(state, None)


@names_its_errors("mhc.jax.collapse")
def collapse(state, *, use_kernel: bool = True, tensor_axis: str | None = None) -> jax.Array:
    """DeepSeek-V4.1's end of the model: h [..., D] = sum_k carried[k] x[k] (x's dtype), the
    streams after the last post collapsed by that sublayer's pre gates (spec: Single-pass
    schedule); no parameters. Then the model's final norm, as after V4's ``head``.

    state: the ``Pending`` of a V4.1 chain (``Config.pre_from_previous``), whose pending post is
    applied first, or ``Streams`` with a carried mix. Kernel path where ``use_kernel`` and (for a
    Pending) the chain's path are; ``tensor_axis``: as for ``pre`` (for a Pending, the chain's)."""
    if isinstance(state, Pending):
        ctx = state.ctx
        if ctx.h_pre is None:
            raise ValueError(
                "state: collapse is DeepSeek-V4.1's end and needs a chain of Config(..., pre_from_previous=True); "
                "a V4 chain ends with finish (then head or reduce)"
            )
        if tensor_axis != ctx.tensor_axis:
            raise ValueError(
                f"tensor_axis: expected the chain's tensor_axis ({ctx.tensor_axis!r}), got {tensor_axis!r}"
            )
        x, carried, config = post(state.layer_out, ctx), ctx.h_pre, ctx.config
        use_kernel = use_kernel and ctx.use_kernel
    elif isinstance(state, Streams):
        if state.carried is None:
            raise ValueError(
                "state: Streams without a carried mix (carried=None); collapse needs the last sublayer's h_pre, "
                "as mhc.jax.streams returns it for a V4.1 chain"
            )
        x, carried = state
        check_collapse_args(x, carried)
        config = Config(n=x.shape[-2], pre_from_previous=True)
    else:
        raise TypeError(f"state: expected the Pending of a V4.1 chain or mhc.jax.Streams, got {type(state).__name__}")
    _tensor_slices(tensor_axis, use_kernel)
    if not use_kernel:
        return reference.collapse(x, carried)
    check_collapse_args(x, carried)
    x, carried = _kernels.on_common_manual_axes(x, carried)
    return _kernels.collapse(config, tensor_axis, x, carried)


def _runs_a_kernel(primitive, params) -> bool:
    """Whether an equation is, or contains (custom_vmap_call, custom_partitioning, cond around
    the FFI calls), an mhc kernel: the platform check on x or a custom call to an mhc target."""
    if primitive is _kernels._check_platform_p:
        return True
    if params.get("target_name") in _kernels.PARTITIONED_TARGETS:
        return True
    return any(
        _runs_a_kernel(eqn.primitive, eqn.params) for jaxpr in jcore.jaxprs_in_params(params) for eqn in jaxpr.eqns
    )


def recompute_policy(primitive, *_avals, **params) -> bool:
    """The ``jax.checkpoint`` policy of ``recompute_streams``: save everything but the mhc kernels'
    outputs and the streams x (the residual named ``"mhc_x"``).

    So the backward of a checkpointed group of sublayers re-runs only the mhc kernel forwards
    (pre, the fused boundary, post): they rebuild the streams x, each sublayer's layer_in and its
    coefficients from the group's first x and the stored layer_outs. Whatever else the group
    computes (the branches: attention, MLP, their norms) is saved, never re-run. The small
    named residuals (coefficients, pre's partial sums) and every layer_out stay saved.
    Combine with other policies by ``jax.checkpoint_policies.save_from_both_policies``."""
    if primitive.name == "name":  # jax.ad_checkpoint.checkpoint_name
        return params.get("name") != _kernels.RESIDUAL_X
    return not _runs_a_kernel(primitive, params)


def recompute_streams(fn: Callable) -> Callable:
    """``fn`` (a group of mHC sublayers: state -> state, e.g. a few ``sublayer`` calls, or the
    body of a ``jax.lax.scan`` over layers) under ``jax.checkpoint`` with ``recompute_policy``:
    the streams inside it are not kept for the backward but rebuilt by the mhc kernels from the
    group's input. Only the kernel path (``use_kernel=True``) has anything to recompute.

    On the CPU, XLA's default scheduler (concurrency-optimized) is free to run a group's
    recomputation early, right after the forward, where it keeps the streams it was meant to drop
    (seen: a 16-sublayer stack needed more memory with recompute than without). Start the process
    with ``XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false`` (XLA's
    memory-minimizing scheduler, which places it in the backward; jit's ``compiler_options`` do not
    reach it), or scan over the groups (the loop fixes the order). Without that flag a CPU trace
    warns once per process."""
    if not callable(fn):
        raise TypeError(f"fn: expected a callable (a group of sublayers), got {type(fn).__name__}")
    checkpointed = jax.checkpoint(fn, policy=recompute_policy)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        _warn_about_the_cpu_scheduler()
        return checkpointed(*args, **kwargs)

    return run


CPU_MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
_cpu_scheduler_warned = False


def _warn_about_the_cpu_scheduler() -> None:
    global _cpu_scheduler_warned
    if _cpu_scheduler_warned or jax.default_backend() != "cpu":
        return
    if CPU_MEMORY_SCHEDULER_FLAG in os.environ.get("XLA_FLAGS", "").lower():
        return
    _cpu_scheduler_warned = True
    warnings.warn(
        "mhc.jax recompute on the CPU: XLA's default CPU scheduler may run the streams' recomputation right "
        "after the forward, where it keeps the streams it was meant to drop. Start the process "
        f"with XLA_FLAGS={CPU_MEMORY_SCHEDULER_FLAG} (before JAX initializes) for the memory-minimizing "
        "scheduler. Warned once per process.",
        stacklevel=3,
    )


def suggested_recompute(n: int, sublayers: int) -> int:
    """The group size k (sublayers per recomputed group) that the mHC paper's memory model
    minimizes (Xie et al., "mHC: Manifold-Constrained Hyper-Connections", arXiv 2512.24880):
    stored streams n D per group start plus the recomputed group's (n + 2) D per sublayer,
    n L / k + (n + 2) k, least at k = sqrt(n L / (n + 2)); rounded, within [1, L]."""
    for name, value in (("n", n), ("sublayers", sublayers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return max(1, min(sublayers, round(math.sqrt(n * sublayers / (n + 2)))))


def _check_recompute(recompute, use_kernel: bool) -> None:
    if recompute is None:
        return
    if isinstance(recompute, bool) or not isinstance(recompute, int) or recompute < 1:
        raise ValueError(f"recompute: expected None or a group size k >= 1 (sublayers), got {recompute!r}")
    if not use_kernel:
        raise ValueError(
            "recompute: the plain path (use_kernel=False) has no kernels to rebuild the streams with; "
            "use the kernels, or recompute=None"
        )


def stack(
    state,
    sublayers: Sequence[tuple[Params, Config, Callable]],
    *,
    recompute: int | None = None,
    use_kernel: bool = True,
    fallback: str = "warn",
    tensor_axis: str | None = None,
):
    """``sublayer`` over each (params, config, branch) of ``sublayers`` in order; returns the
    last ``Pending`` (``finish`` gives the streams), or ``state`` itself if there is none.

    recompute: None keeps every sublayer's streams for the backward. k keeps them only at the
    start of every group of k consecutive sublayers (the last group may be shorter): each group
    runs under ``recompute_streams``, and its backward rebuilds its streams with the mhc kernels
    from its first x and the stored layer_outs, never re-running the branches. The kernels
    compute the same bits as without; XLA may fuse and round the branches differently across
    the checkpoint barrier (last bits; docs/jax.md). ``suggested_recompute(n, len(sublayers))`` gives the paper's k.
    k = 1 keeps every x but still rebuilds each sublayer's layer_in (one kernel forward each).
    The other arguments are ``sublayer``'s.
    """
    _check_fallback(fallback)
    _check_recompute(recompute, use_kernel)
    sublayers = list(sublayers)
    options = dict(use_kernel=use_kernel, fallback=fallback, tensor_axis=tensor_axis)
    size = recompute or max(1, len(sublayers))
    for start in range(0, len(sublayers), size):
        group = sublayers[start : start + size]
        run = functools.partial(
            _run_group, configs=[c for _, c, _ in group], branches=[b for _, _, b in group], options=options
        )
        state = (recompute_streams(run) if recompute else run)(state, [p for p, _, _ in group])
    return state


def _run_group(state, params: list, *, configs: list, branches: list, options: dict):
    for p, config, branch in zip(params, configs, branches, strict=True):
        state = sublayer(state, p, config, branch, **options)
    return state


def expand(h: jax.Array, n: int) -> jax.Array:
    """Repeat an embedding [..., D] into n streams [..., n, D] (no scaling)."""
    return jnp.broadcast_to(h[..., None, :], (*h.shape[:-1], n, h.shape[-1]))


def reduce(x: jax.Array) -> jax.Array:
    """Sum the streams [..., n, D] back to [..., D]."""
    return x.sum(axis=-2, dtype=jnp.float32).astype(x.dtype)


@names_its_errors("mhc.jax.head")
def head(
    x: jax.Array, params: HeadParams, config: Config, *, use_kernel: bool = True, tensor_axis: str | None = None
) -> jax.Array:
    """DeepSeek-V4's learned collapse of the streams [..., n, D] into one [..., D] (spec: Head), in
    place of ``reduce``: out = sum_k g_k x_k, g = sigmoid(scale * r * (x_flat . fn^T) + base) + pre_eps.

    params: f32 ``HeadParams`` (fn [n, n*D], base [n], scale [1]); uses config.n, rms_eps and pre_eps.
    The kernels run on the CPU and the TPU (none on a GPU): elsewhere ``use_kernel=True`` raises,
    ``use_kernel=False`` runs the plain formulas.

    tensor_axis: only inside ``jax.shard_map`` with D split over a mesh axis: that axis's name
    (params whole, replicated). The head has no split form: x is all-gathered over the axis, the
    head runs on the whole D on every device of it, and each keeps its slice of the output (the
    backward reduce-scatters dx). Under ``jax.jit`` on sharded arrays leave it None.
    """
    slices = _tensor_slices(tensor_axis, use_kernel)
    if not use_kernel:
        return reference.head(x, params, config)
    check_activation("x", x)
    check_head_args(_global_x(x, _rows(params, "fn", -1), "params.fn", tensor_axis, slices, "head"), params, config)
    if tensor_axis is not None and slices > 1:
        return _kernels.head_gathering_features(config, tensor_axis, x, params)
    return _kernels.head(config, *_kernels.on_common_manual_axes(x, params))

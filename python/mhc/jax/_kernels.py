"""The C++ operations as JAX primitives: ffi_call wrappers and the custom VJPs around them.

The ffi_call wrappers take flat shapes, x [T, n, D]. The custom VJPs take x with any leading
(token) dims and run the calls through partitioned operations (_partitioning), so that under jit
on a mesh each device runs them on its own shards.

pre's custom VJP returns x itself as an extra output (the context's copy). post's backward sends
its dx_partial back along that output, so pre's backward receives it as a cotangent and the C++
pre_backward adds it while it writes dx: no separate pass to sum the two paths of dx.

Dispatch: each kernel call (the wrappers below, by FFI target name) is a platform_dependent over
the backends that have that kernel: the C++ FFI target on cpu and cuda (registered_targets), the
Pallas kernel mhc.tpu.KERNELS has under the same name on tpu. So the custom VJPs and partitioning
rules above them are the same on every platform, and nothing above knows which backend ran.
Each operation runs its own kernels on a platform that has them, its documented fallback's
kernels where only those are (the boundary on a GPU or a TPU without the fused kernel: post then
pre, with a warning once per process unless the caller passed fallback="allow"), and raises an
mhc error otherwise; with D split over devices (tensor parallelism) it needs the split form's
kernels (cpu and cuda have them, tpu not), else the mhc error names what works instead. The
platform is only known when XLA lowers the program (it may be lowered or exported for another
machine), so the checks are a primitive whose lowering rule makes the decision.

Test only: mhc.tpu.testing.interpret_on_cpu makes the CPU lowering dispatch as a TPU would (the
TPU kernels in Pallas's interpreter); see mhc.tpu.testing.interpret_params.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as jax_config  # _check_vma (_tpu_kernel_lowering)
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from mhc import _ffi, tpu
from mhc._config import Config, HeadParams, Params
from mhc.jax._partitioning import Operation, Plan, apply
from mhc.tpu import testing as tpu_testing  # the test switch, interpret_on_cpu

_F32 = jnp.float32


def _attributes(config: Config, slices: int) -> dict:
    return dict(
        n=np.int64(config.n),
        mix=np.int64(0 if config.mix == "sinkhorn" else 1),
        sinkhorn_iters=np.int64(config.sinkhorn_iters),
        sinkhorn_eps=np.float32(config.sinkhorn_eps),
        rms_eps=np.float32(config.rms_eps),
        pre_eps=np.float32(config.pre_eps),
        post_scale=np.float32(config.post_scale),
        tensor_parallel=np.int64(slices),
    )


def on_common_manual_axes(*trees):
    """The arrays of ``trees`` typed as varying over the union of their manual mesh axes.

    Inside ``jax.shard_map`` (with its default check_vma) a custom call needs every operand to
    vary over the same mesh axes, and a custom VJP's cotangents must be typed like its inputs: a
    replicated parameter is made varying where x is, and the transpose of that cast sums its
    gradient over those axes. Outside shard_map, or with check_vma=False, nothing changes."""
    leaves, treedef = jax.tree.flatten(trees)
    varying = frozenset().union(*(jax.typeof(leaf).mat.varying for leaf in leaves))
    leaves = [_vary(leaf, varying) for leaf in leaves]
    return jax.tree.unflatten(treedef, leaves)


def varies_over(array, axis: str) -> bool | None:
    """Inside jax.shard_map: whether ``array`` is typed as varying over the mesh axis ``axis``
    (split over it, or computed per device); None without check_vma, where no type tells."""
    if not jax_config._check_vma.value:
        return None
    return axis in jax.typeof(array).mat.varying


def _vary(array, varying: frozenset):
    missing = tuple(sorted(varying - jax.typeof(array).mat.varying))
    return jax.lax.pcast(array, missing, to="varying") if missing else array


def _manual_axes_types(args, result_types):
    """The operands and result types of a custom call, all on the operands' common manual axes."""
    varying = frozenset().union(*(jax.typeof(a).mat.varying for a in args))
    if not varying:
        return args, result_types
    manual = jax.sharding.ManualAxisType(varying=varying)
    # The manual mesh of shard_map (an abstract mesh: the arrays here are per-device).
    sharding = jax.sharding.NamedSharding(jax.typeof(args[0]).sharding.mesh, jax.sharding.PartitionSpec())
    typed = jax.tree.map(
        lambda r: jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=sharding, manual_axis_type=manual), result_types
    )
    return tuple(_vary(a, varying) for a in args), typed


def _call(target: str, config: Config, result_types, *args, slices: int = 1):
    """The kernel ``target`` on ``args``: on each lowering platform, the backend that has it (the
    C++ FFI target on cpu and cuda, mhc.tpu.KERNELS[target] on tpu, see _backend for the test
    switch). A platform without it gets the FFI call, which XLA refuses there when it compiles;
    the platform checks (_check_platform_p) raise the mhc error at lowering before that."""
    args, result_types = _manual_axes_types(args, result_types)
    single = isinstance(result_types, jax.ShapeDtypeStruct)
    types = (result_types,) if single else tuple(result_types)

    def ffi(*args):
        return _ffi_call(*args, target=target, config=config, result_types=types, slices=slices)

    def tpu_branch(interpret):
        def run(*args):
            options = dict(target=target, config=config, result_types=types, slices=slices, interpret=interpret)
            return tuple(_tpu_kernel_p.bind(*args, **options))

        return run

    branches = {}
    for platform in _KERNEL_PLATFORMS:
        backend = _backend(platform)
        if target in registered_targets(backend):
            # On the CPU under the test switch: the TPU kernel in Pallas's interpreter.
            interpret = None if platform == "tpu" else tpu_testing.interpret_params
            branches[platform] = ffi if backend != "tpu" else tpu_branch(interpret)
    results = jax.lax.platform_dependent(*args, **branches, default=ffi)
    return results[0] if single else results


def _ffi_call(*args, target: str, config: Config, result_types: tuple, slices: int) -> tuple:
    # "sequential": the calls take parameters, which other vmap methods would batch wrongly.
    call = jax.ffi.ffi_call(target, result_types, vmap_method="sequential")
    return tuple(call(*args, **_attributes(config, slices)))


# A TPU kernel as a primitive, whose lowering rule for the TPU runs the Pallas kernel. A module
# lowered for several platforms at once (jax.export) lowers every platform_dependent branch for
# all of them, and Pallas refuses to lower a TPU kernel for another platform: there the rule is
# the FFI call instead, never reached at run time (that platform runs its own branch), or, with
# ``interpret`` (the test switch), the kernel in Pallas's interpreter.
_tpu_kernel_p = Primitive("mhc_tpu_kernel")
_tpu_kernel_p.multiple_results = True
_tpu_kernel_p.def_abstract_eval(lambda *args, result_types, **_: [jax.typeof(r) for r in result_types])


def _tpu_kernel_lowering(ctx, *args, target: str, config: Config, result_types: tuple, slices: int, interpret):
    def kernel(*args):
        results = tpu.KERNELS[target](config, *args, interpret=interpret)
        return (results,) if len(result_types) == 1 else tuple(results)

    # Inside jax.shard_map (check_vma), pallas_call wants each output's varying mesh axes in its
    # out_shape, which the kernels do not give: they see one device's blocks. The primitive's
    # abstract eval has typed the results already (the operands' common manual axes, as the FFI
    # call's), so the kernel is traced and lowered without the check.
    with jax_config._check_vma(False):
        return mlir.lower_fun(kernel, multiple_results=True)(ctx, *args)


def _elsewhere_lowering(ctx, *args, interpret, **params):
    if interpret is not None:
        return _tpu_kernel_lowering(ctx, *args, interpret=interpret, **params)
    return mlir.lower_fun(_ffi_call, multiple_results=True)(ctx, *args, **params)


mlir.register_lowering(_tpu_kernel_p, _elsewhere_lowering)
mlir.register_lowering(_tpu_kernel_p, functools.partial(_tpu_kernel_lowering, interpret=None), platform="tpu")


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _pre_forward_types(x) -> tuple:
    """What the pre forward writes: layer_in [T, D] in x's dtype, h_pre and h_post [T, n] and h_res
    [T, n, n] in f32."""
    t, n, d = x.shape
    return (_sds((t, d), x.dtype), _sds((t, n), _F32), _sds((t, n), _F32), _sds((t, n, n), _F32))


def _grad_types(params) -> tuple:
    return tuple(_sds(p.shape, _F32) for p in params)


# DeepSeek-V4.1's kernels (spec: Single-pass schedule) are V4's with one more operand, which the
# wrappers below take as a keyword: ``carried``, the carried mix f32 [T, n] or [T, 0] for the
# one-hot on stream 0 (the first sublayer), whose dcarried is [T, 0] too; for the boundary
# ``h_pre``, sublayer l's, which the next sublayer's pre-apply reads. None: V4's kernel.


def _target(v4_target: str, carried) -> str:
    return v4_target if carried is None else v4_target + "_carried"


def _present(*arrays) -> tuple:
    return tuple(a for a in arrays if a is not None)


def pre_forward(config: Config, x, params: Params, *, carried=None):
    return _call(_target("mhc_pre_forward", carried), config, _pre_forward_types(x), x, *_present(carried), *params)


def post_forward(config: Config, x, layer_out, h_post, h_res):
    return _call("mhc_post_forward", config, _sds(x.shape, x.dtype), x, layer_out, h_post, h_res)


def post_backward(config: Config, g, x, layer_out, h_post, h_res):
    t, n, _ = x.shape
    types = (_sds(x.shape, x.dtype), _sds(layer_out.shape, layer_out.dtype), _sds((t, n), _F32), _sds((t, n, n), _F32))
    return _call("mhc_post_backward", config, types, g, x, layer_out, h_post, h_res)


def pre_backward(
    config: Config, dlayer_in, dx_partial, dh_post, dh_res, x, params: Params, *, dh_pre=None, carried=None
):
    """-> dx, (V4.1: dcarried,) then the parameter gradients. V4.1 takes dh_pre, the cotangent of
    the sublayer's own h_pre; V4 derives it from dlayer_in."""
    dcarried = () if carried is None else (_sds(carried.shape, _F32),)
    types = (_sds(x.shape, x.dtype), *dcarried, *_grad_types(params))
    args = (dlayer_in, dx_partial, *_present(dh_pre), dh_post, dh_res, x, *_present(carried), *params)
    return _call(_target("mhc_pre_backward", carried), config, types, *args)


def boundary_forward(config: Config, x, layer_out, h_post, h_res, params: Params, *, h_pre=None):
    types = (_sds(x.shape, x.dtype), *_pre_forward_types(x))
    args = (x, layer_out, *_present(h_pre), h_post, h_res, *params)
    return _call(_target("mhc_boundary_forward", h_pre), config, types, *args)


def boundary_backward(config: Config, next_cotangents, x, layer_out, h_post, h_res, params: Params, *, h_pre=None):
    """-> dx_partial, dlayer_out, dh_post, dh_res, (V4.1: dh_pre, the cotangent of h_pre: the
    dcarried of sublayer l+1,) then the parameter gradients of l+1. ``next_cotangents``: those of
    l+1's pre, V4.1's with its dh_pre third."""
    t, n, _ = x.shape
    dh_pre = () if h_pre is None else (_sds((t, n), _F32),)
    types = (
        _sds(x.shape, x.dtype),
        _sds(layer_out.shape, layer_out.dtype),
        _sds((t, n), _F32),
        _sds((t, n, n), _F32),
        *dh_pre,
        *_grad_types(params),
    )
    args = (*next_cotangents, x, layer_out, *_present(h_pre), h_post, h_res, *params)
    return _call(_target("mhc_boundary_backward", h_pre), config, types, *args)


def head_forward(config: Config, x, head: HeadParams):
    t, n, d = x.shape
    return _call("mhc_head_forward", config, (_sds((t, d), x.dtype), _sds((t, n), _F32)), x, *head)


def head_backward(config: Config, dout, x, head: HeadParams):
    types = (_sds(x.shape, x.dtype), *_grad_types(head))
    return _call("mhc_head_backward", config, types, dout, x, *head)


def pre_forward_partials(config: Config, slices: int, x, norm_weight, phi):
    t = x.shape[0]
    types = _sds((t, config.projection_width + 1), _F32)
    return _call("mhc_pre_forward_partials", config, types, x, norm_weight, phi, slices=slices)


def pre_forward_finish(config: Config, slices: int, x, partials, alpha, bias, *, carried=None):
    args = (x, partials, *_present(carried), alpha, bias)
    return _call(_target("mhc_pre_forward_finish", carried), config, _pre_forward_types(x), *args, slices=slices)


def pre_backward_partials(config: Config, slices: int, dlayer_in, x):
    types = _sds(x.shape[:2], _F32)
    return _call("mhc_pre_backward_partials", config, types, dlayer_in, x, slices=slices)


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
    types = (_sds(x.shape, x.dtype), *_grad_types(params))
    args = (dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials, *_present(carried), *params)
    return _call(_target("mhc_pre_backward_finish", carried), config, types, *args, slices=slices)


def collapse_forward(config: Config, x, carried):
    t, _, d = x.shape
    return _call("mhc_collapse_forward", config, _sds((t, d), x.dtype), x, carried)


def collapse_backward(config: Config, dout, x, carried):
    return _call("mhc_collapse_backward", config, (_sds(x.shape, x.dtype), _sds(carried.shape, _F32)), dout, x, carried)


# The operations as partitioned functions (see _partitioning): each takes x with any leading
# (token) dims [..., n, D] and the parameters in the layout of the tensor-parallel split,
# norm_weight [n, D] and phi [n, D, N], so that a device holding D/P features of every stream
# holds the matching rows. Per device: the fused kernels when D is whole; with D split over P
# devices, the partial sums, one all-reduce, and the finish (spec: Tensor parallelism). The
# parameter gradients, sums over tokens, are all-reduced once over the token axes.


def _psum_together(arrays, axes):
    """psum of several arrays in one all-reduce (one flat buffer)."""
    if not axes:
        return tuple(arrays)
    flat = jax.lax.psum(jnp.concatenate([a.reshape(-1) for a in arrays]), axes)
    sizes = np.cumsum([a.size for a in arrays])[:-1]
    return tuple(part.reshape(a.shape) for part, a in zip(jnp.split(flat, sizes), arrays, strict=True))


def _local_params(config: Config, norm_weight, phi, alpha, bias) -> Params:
    """[n, Dl] and [n, Dl, N] shards as the kernels' rows k*Dl + j."""
    return Params(norm_weight.reshape(-1), phi.reshape(-1, config.projection_width), alpha, bias)


def _local_param_grads(plan, grads, n: int, d: int) -> tuple:
    """The kernels' parameter gradients (sums over this device's tokens) summed over the token
    axes in one all-reduce, as the shards of _local_params: [n, Dl], [n, Dl, N], alpha, bias."""
    dnorm_weight, dphi, dalpha, dbias = _psum_together(grads, plan.token_axes)
    return dnorm_weight.reshape(n, d), dphi.reshape(n, d, dphi.shape[-1]), dalpha, dbias


def _flat(lead: tuple, *arrays) -> tuple:
    """The arrays with their token axes ``lead`` merged into one: the kernels' shapes [T, ...]."""
    t, axes = math.prod(lead), len(lead)
    return tuple(None if a is None else a.reshape(t, *a.shape[axes:]) for a in arrays)


def _unflat(lead: tuple, *arrays) -> tuple:
    """The kernels' results [T, ...] with the token axes ``lead`` back."""
    return tuple(None if a is None else a.reshape(*lead, *a.shape[1:]) for a in arrays)


def _zero_padded_rows(valid, *arrays):
    """The arrays (token axes first, as `valid`) with the rows XLA padded set to zero: those rows
    hold anything, and must stay out of the parameter sums. `valid` None: no padding."""
    if valid is None:
        return arrays
    return tuple(
        None if a is None else jnp.where(valid.reshape(valid.shape + (1,) * (a.ndim - valid.ndim)), a, 0)
        for a in arrays
    )


# DeepSeek-V4.1 (spec: Single-pass schedule) runs V4's operations with one more operand: the
# carried mix for the pre (its own layout letter ``c``, n columns or 0 for the one-hot, so that
# Shardy does not equate its size with the streams'), h_pre of sublayer l for the boundary. One
# per-device function serves both: V4's operation passes None for that operand (and for the
# cotangent of h_pre the V4.1 backwards take) and drops the one result V4.1 adds (_v4_results).


def _v4_results(results: tuple, index: int) -> tuple:
    """V4's results: the shared function's, less V4.1's own at ``index`` (None or unused in V4)."""
    return results[:index] + results[index + 1 :]


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


def _post_forward_local(config: Config, plan, x, layer_out, h_post, h_res):
    lead = x.shape[:-2]
    return _unflat(lead, post_forward(config, *_flat(lead, x, layer_out, h_post, h_res)))


def _post_backward_local(config: Config, plan, g, x, layer_out, h_post, h_res):
    lead = x.shape[:-2]
    dx_partial, dlayer_out, dh_post, dh_res = post_backward(config, *_flat(lead, g, x, layer_out, h_post, h_res))
    # dh_post and dh_res sum over D: with D split, one all-reduce completes them.
    dh_post, dh_res = _psum_together((dh_post, dh_res), plan.feature_axes)
    return _unflat(lead, dx_partial, dlayer_out, dh_post, dh_res)


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


# The parameters' rows: q (stream) and r (feature, split as x's D), factors apart from x's n and d
# (see _partitioning: a sharding of the parameters alone, FSDP, must not spread to x).
_PARAMS = ("qr", "qrk", "a", "k")
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
BOUNDARY_FORWARD = Operation(
    "boundary_forward",
    targets=("mhc_boundary_forward",),
    split_targets=(*POST_FORWARD.split_targets, *PRE_FORWARD.split_targets),  # post, then pre (no fused split)
    operands=("Bnd", "Bd", "Bn", "Bnm", *_PARAMS),
    results=("Bnd", "Bd", "Bn", "Bnm", "Bp"),
    local=_boundary_forward_v4_local,
)
BOUNDARY_BACKWARD = Operation(
    "boundary_backward",
    targets=("mhc_boundary_backward",),
    split_targets=(*POST_FORWARD.split_targets, *PRE_BACKWARD.split_targets, *POST_BACKWARD.split_targets),
    operands=("Bd", "Bnd", "Bn", "Bnm", "Bnd", "Bd", "Bn", "Bnm", "Bp", *_PARAMS),
    results=("Bnd", "Bd", "Bn", "Bnm", *_PARAMS),
    local=_boundary_backward_v4_local,
    primary=4,  # x
)
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
BOUNDARY_FORWARD_CARRIED = Operation(
    "boundary_forward_carried",
    targets=("mhc_boundary_forward_carried",),
    split_targets=(*POST_FORWARD.split_targets, *PRE_FORWARD_CARRIED.split_targets),  # no fused split
    operands=("Bnd", "Bd", "Bn", "Bn", "Bnm", *_PARAMS),
    results=("Bnd", "Bd", "Bn", "Bn", "Bnm", "Bp"),
    local=_boundary_forward_local,
)
BOUNDARY_BACKWARD_CARRIED = Operation(
    "boundary_backward_carried",
    targets=("mhc_boundary_backward_carried",),
    split_targets=(*POST_FORWARD.split_targets, *PRE_BACKWARD_CARRIED.split_targets, *POST_BACKWARD.split_targets),
    operands=("Bd", "Bnd", "Bn", "Bn", "Bnm", "Bnd", "Bd", "Bn", "Bn", "Bnm", "Bp", *_PARAMS),
    results=("Bnd", "Bd", "Bn", "Bn", "Bnm", *_PARAMS),
    local=_boundary_backward_local,
    primary=5,  # x
)
OPERATIONS = (
    PRE_FORWARD,
    PRE_BACKWARD,
    POST_FORWARD,
    POST_BACKWARD,
    BOUNDARY_FORWARD,
    BOUNDARY_BACKWARD,
    HEAD_FORWARD,
    HEAD_BACKWARD,
    PRE_FORWARD_CARRIED,
    PRE_BACKWARD_CARRIED,
    COLLAPSE_FORWARD,
    COLLAPSE_BACKWARD,
    BOUNDARY_FORWARD_CARRIED,
    BOUNDARY_BACKWARD_CARRIED,
)
PARTITIONED_TARGETS = frozenset(
    target for operation in OPERATIONS for target in operation.targets + operation.split_targets
)
"""Every FFI target the JAX package calls; tests check it covers every registered target."""


# Dispatch per platform (see the module docstring; README, Support).


_KERNEL_PLATFORMS = ("cpu", "cuda", "tpu")  # the lowering platforms with an mhc backend


def registered_targets(platform: str) -> frozenset:
    """The kernels this process has for a lowering platform ("cpu", "cuda", "tpu"), by FFI target
    name: the C++ FFI targets registered for cpu and cuda, mhc.tpu.KERNELS' keys for tpu."""
    if platform == "tpu":
        return frozenset(tpu.KERNELS)
    return frozenset({"cpu": _ffi.TARGET_NAMES, "cuda": _ffi.CUDA_TARGETS}.get(platform, ()))


def _backend(platform: str) -> str:
    """Whose kernels run on a lowering platform: its own, or the TPU's on the CPU under the switch."""
    return "tpu" if platform == "cpu" and tpu_testing.interpret_params is not None else platform


def _platform_label(platform: str) -> str:
    """The platform as the mhc errors name it."""
    if _backend(platform) != platform:
        return "'tpu' (the TPU kernels interpreted on the CPU: mhc.tpu.testing.interpret_on_cpu)"
    return repr(platform)


def _where_registered(target: str, branch) -> dict:
    """platform_dependent's keywords running ``branch`` on the platforms whose backend has ``target``."""
    return {platform: branch for platform in _KERNEL_PLATFORMS if target in registered_targets(_backend(platform))}


# The documented fallbacks: where a platform lacks an operation's own kernel but has these
# operations' kernels, the operation runs as them (its local function picks that branch).
_FALLBACKS = {
    BOUNDARY_FORWARD.name: (POST_FORWARD, PRE_FORWARD),
    BOUNDARY_BACKWARD.name: (PRE_BACKWARD, POST_BACKWARD, POST_FORWARD),
    BOUNDARY_FORWARD_CARRIED.name: (POST_FORWARD, PRE_FORWARD_CARRIED),
    BOUNDARY_BACKWARD_CARRIED.name: (PRE_BACKWARD_CARRIED, POST_BACKWARD, POST_FORWARD),
}
FALLBACK_CHOICES = ("warn", "allow", "error")
"""``fallback=`` of ``mhc.jax.boundary`` / ``sublayer``: run the documented fallback with a warning
(once per process), run it silently, or raise instead of running it."""

_warned: set = set()  # (public operation name, platform) pairs already warned about in this process


def _public_name(operation: Operation) -> str:
    return "mhc.jax." + operation.name.split("_")[0]


def _check_platform_lowering(ctx, x, *, operation: Operation, fallback: str, split: bool, platform: str | None):
    """The check for one lowering platform (None: one without a rule of its own, named from the
    module's platforms): passes x through, warns, or raises. ``split``: the check of the D-split
    form (tensor parallelism), made where the partitioning chose it."""
    if platform is None:
        platform = "/".join(p for p in ctx.module_context.platforms if p not in _NAMED_PLATFORMS)
    name, label = _public_name(operation), _platform_label(platform)
    registered = registered_targets(_backend(platform))
    needed = frozenset(operation.split_targets if split else operation.targets)
    if needed <= registered:
        return [x]
    substitutes = () if split else _FALLBACKS.get(operation.name, ())
    if substitutes and all(frozenset(s.targets) <= registered for s in substitutes):
        what = f"{name}: no fused kernel for platform {label}, so it runs as the separate post and pre kernels"
        if fallback == "error":
            raise NotImplementedError(
                f"{what}, which fallback='error' refuses. Pass fallback='allow' (or 'warn') to run them, "
                "or use_kernel=False for the plain JAX formulas."
            )
        if fallback == "warn" and (name, label) not in _warned:
            _warned.add((name, label))
            warnings.warn(
                f"{what} (same results; x_next goes through memory). Pass fallback='allow' to run this "
                "without the warning, or fallback='error' to raise instead. Warned once per process.",
                stacklevel=2,
            )
        return [x]
    if len(ctx.module_context.platforms) > 1:
        # Lowered for several platforms at once (jax.export): the call may sit in the caller's
        # platform_dependent branch for the others, which JAX still lowers for every platform;
        # if it is reached on this one, XLA refuses the kernel's custom call when it compiles.
        return [x]
    have = ", ".join(p for p in _KERNEL_PLATFORMS if needed <= registered_targets(p)) or "none"
    if split:
        raise NotImplementedError(
            f"{name}: D (x's last axis) is split over devices (tensor parallelism), and mhc has no kernels "
            f"for that split form on platform {label} (they run on: {have}). Shard only the tokens (keep D "
            "whole on each device), or pass use_kernel=False to run the plain JAX formulas (mhc.jax.reference)."
        )
    raise NotImplementedError(
        f"{name}: mhc has no kernel for platform {label} (its kernels run on: {have}). "
        "Pass use_kernel=False to run the plain JAX formulas (mhc.jax.reference) instead."
    )


# Identity on one operand; its lowering rule checks the platform (and warns or raises). One rule
# per platform, so that JAX picks the platforms each use is lowered for (several when exporting
# for several; only the CPU inside a host-offloaded computation).
_NAMED_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_check_platform_p = Primitive("mhc_check_platform")
_check_platform_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(_check_platform_p, functools.partial(_check_platform_lowering, platform=None))
for _platform in _NAMED_PLATFORMS:
    mlir.register_lowering(
        _check_platform_p, functools.partial(_check_platform_lowering, platform=_platform), platform=_platform
    )


def _split_form(operation: Operation, x):
    """x, after the check that the lowering platform has ``operation``'s D-split form (made in the
    per-device function, where the partitioning has chosen the split)."""
    return _check_platform_p.bind(x, operation=operation, fallback="error", split=True)


@functools.cache
def _check_platform_jitted(operation: Operation, fallback: str, split: bool):
    return jax.jit(functools.partial(_check_platform_p.bind, operation=operation, fallback=fallback, split=split))


# Bound outside jit (vmap of an eager call): lowered for the operand's platform all the same.
_check_platform_p.def_impl(lambda x, **params: _check_platform_jitted(**params)(x))
batching.primitive_batchers[_check_platform_p] = lambda args, dims, **params: (
    _check_platform_p.bind(*args, **params),
    dims[0],
)


def _apply(
    operation: Operation, config: Config, lead: int, *operands, fallback: str = "error", tensor_axis=None
) -> tuple:
    """``apply``, after the platform check on the operand that decides the plan. The check sits
    outside the partitioned call: inside, XLA would lower it only while compiling, per shard.
    Inside ``jax.shard_map`` (``tensor_axis`` given, or operands varying over manual axes), the
    operation's per-device function instead (``_run_manual``)."""
    operands = list(operands)
    primary = operands[operation.primary]
    operands[operation.primary] = _check_platform_p.bind(primary, operation=operation, fallback=fallback, split=False)
    if tensor_axis is not None or any(jax.typeof(a).mat.varying for a in operands):
        return _run_manual(operation, config, lead, tensor_axis, *operands)
    return apply(operation, config, lead, *operands)


# Inside jax.shard_map the arrays are already each device's shards and every mesh axis is manual:
# no partitioning rule applies, so the operation's per-device function (the one the rules pick
# under jit) runs directly, with a plan whose token axes are empty (the caller's shard_map sums
# the parameter gradients over its token axes, as for any replicated input) and whose feature
# axis is ``tensor_axis``. The cotangent of V4.1's carried mix is then each device's share of the
# sum over D (Plan.shares), as for the parameters: JAX's transpose of a replicated input sums it.


def _run_manual(operation: Operation, config: Config, lead: int, tensor_axis, *operands) -> tuple:
    slices = 1 if tensor_axis is None else jax.lax.axis_size(tensor_axis)
    plan = Plan(tokens=(None,) * lead, features=tensor_axis if slices > 1 else None, slices=slices, shares=True)
    results = operation.local(config, plan, *operands)
    # The psums inside leave some results invariant over tensor_axis; a custom VJP wants its
    # cotangents typed like its inputs, which on_common_manual_axes made varying over all axes.
    varying = frozenset().union(*(jax.typeof(a).mat.varying for a in operands))
    return tuple(_vary(result, varying) for result in results)


def _shaped(config: Config, d: int, params: Params, tensor_axis=None) -> tuple:
    """norm_weight [n, D] and phi [n, D, N] (row k*D + j: stream k, feature j), alpha, bias. With
    ``tensor_axis`` (inside shard_map; params hold every feature's rows) this device's D slice."""
    n, width = config.n, config.projection_width
    norm_weight, phi = params.norm_weight.reshape(n, -1), params.phi.reshape(n, -1, width)
    if tensor_axis is not None:
        start = jax.lax.axis_index(tensor_axis) * d
        norm_weight = jax.lax.dynamic_slice_in_dim(norm_weight, start, d, axis=1)
        phi = jax.lax.dynamic_slice_in_dim(phi, start, d, axis=1)
    return norm_weight, phi, params.alpha, params.bias


def _param_grads(params: Params, tensor_axis, dnorm_weight, dphi, dalpha, dbias) -> Params:
    """The gradients shaped like ``params``. With ``tensor_axis``: this device's rows in place and
    zeros elsewhere, and dalpha, dbias (the same on every device of the axis) on its first device
    only, so that the sum over the axis (shard_map's transpose for a replicated input) completes
    them: a parameter-sized all-reduce."""
    if tensor_axis is not None:
        index = jax.lax.axis_index(tensor_axis)
        n, d = dnorm_weight.shape
        start = index * d
        dnorm_weight = jax.lax.dynamic_update_slice_in_dim(
            jnp.zeros((n, params.norm_weight.size // n), _F32), dnorm_weight, start, axis=1
        )
        dphi = jax.lax.dynamic_update_slice_in_dim(
            jnp.zeros((n, params.phi.shape[0] // n, dphi.shape[-1]), _F32), dphi, start, axis=1
        )
        dalpha, dbias = jnp.where(index == 0, dalpha, 0), jnp.where(index == 0, dbias, 0)
    return Params(dnorm_weight.reshape(params.norm_weight.shape), dphi.reshape(params.phi.shape), dalpha, dbias)


def _lead(x) -> int:
    return x.ndim - 2


# The names the custom VJPs' forwards give the residuals they save for the backward, so a
# jax.checkpoint policy can pick them by name: save_only_these_names(...) keeps them, and
# save_and_offload_only_these_names(...) moves them to host memory. A name only labels the
# value (jax.ad_checkpoint.checkpoint_name is an identity); without a policy nothing changes.
# The parameters are not named: they are the caller's arguments, which a policy keeps anyway.
RESIDUAL_X = "mhc_x"  # the streams x [..., n, D] going into a sublayer's post (and pre)
RESIDUAL_LAYER_OUT = "mhc_layer_out"  # the sublayer's output [..., D] given to post / boundary
# h_post [..., n] and h_res [..., n, n] given to post / boundary; and V4.1's carried mix [..., n]
# (the previous sublayer's h_pre, read by pre, the boundary and collapse; [..., 0] for the one-hot).
RESIDUAL_COEFFICIENTS = "mhc_coefficients"
RESIDUAL_PARTIALS = "mhc_pre_partials"  # pre's per-token partial sums (pre, boundary), kept for its backward
RESIDUAL_NAMES = (RESIDUAL_X, RESIDUAL_LAYER_OUT, RESIDUAL_COEFFICIENTS, RESIDUAL_PARTIALS)


def _named(name: str, *arrays):
    """The arrays labelled ``name`` for jax.checkpoint policies (one tuple, in order)."""
    return tuple(checkpoint_name(a, name) for a in arrays)


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

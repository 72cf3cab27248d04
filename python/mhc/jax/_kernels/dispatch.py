"""The dispatch every operation family shares: the kernel call (one FFI target, or the TPU's
Pallas kernel under the same name), the platform check, the partitioned apply, and the helpers
the per-device functions and custom VJPs of pre, post, boundary, head and collapse all use.

Dispatch: each kernel call (_call, from the families' wrappers, by FFI target name) is a platform_dependent over
the backends that have that kernel: the C++ FFI target on cpu and cuda (registered_targets), the
Pallas kernel mhc.tpu.KERNELS has under the same name on tpu. So the custom VJPs and partitioning
rules above them are the same on every platform, and nothing above knows which backend ran.
Each operation runs its own kernels on a platform that has them, its documented fallback's
kernels where only those are (the boundary on a GPU or a TPU without the fused kernel: post then
pre, with a warning once per process unless the caller passed fallback="allow"), and raises an
mhc error otherwise; with D split over devices (tensor parallelism) it needs the split form's
kernels (cpu, cuda and tpu have them), else the mhc error names what works instead. The
platform is only known when XLA lowers the program (it may be lowered or exported for another
machine), so the checks are a primitive whose lowering rule makes the decision.

Test only: mhc.tpu.testing.interpret_on_cpu makes the CPU lowering dispatch as a TPU would (the
TPU kernels in Pallas's interpreter); see mhc.tpu.testing.interpret_params.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from mhc import _ffi
from mhc._config import Config, Params, PreApply
from mhc._jax_internals import check_vma
from mhc._operations import OPERATIONS, output_specs
from mhc.jax._partitioning import Operation, Plan, apply

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
    if not check_vma.value:
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


def _call(target: str, config: Config, *args, slices: int = 1):
    """The kernel ``target`` on ``args``: on each lowering platform, the backend that has it (the
    C++ FFI target on cpu and cuda, mhc.tpu.KERNELS[target] on tpu, see _backend for the test
    switch). A platform without it gets the FFI call, which XLA refuses there when it compiles;
    the platform checks (_check_platform_p) raise the mhc error at lowering before that. The
    results' shapes and dtypes come from the operation's declaration (mhc._operations); one
    result comes back as an array, several as a tuple."""
    declared = output_specs(OPERATIONS[target.removeprefix("mhc_")], args, _F32)
    args, types = _manual_axes_types(args, tuple(_sds(shape, dtype) for shape, dtype in declared))
    single = len(types) == 1

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
            interpret = None if platform == "tpu" else _interpret_params()
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
    from mhc import tpu

    # The split forms' finish kernels need the devices D is split over (the RMS mean is over n D).
    options = {"slices": slices} if target in tpu.TAKES_SLICES else {}

    def kernel(*args):
        results = _tpu_kernels()[target](config, *args, interpret=interpret, **options)
        return (results,) if len(result_types) == 1 else tuple(results)

    # Inside jax.shard_map (check_vma), pallas_call wants each output's varying mesh axes in its
    # out_shape, which the kernels do not give: they see one device's blocks. The primitive's
    # abstract eval has typed the results already (the operands' common manual axes, as the FFI
    # call's), so the kernel is traced and lowered without the check.
    with check_vma(False):
        return mlir.lower_fun(kernel, multiple_results=True)(ctx, *args)


def _elsewhere_lowering(ctx, *args, interpret, **params):
    if interpret is not None:
        return _tpu_kernel_lowering(ctx, *args, interpret=interpret, **params)
    return mlir.lower_fun(_ffi_call, multiple_results=True)(ctx, *args, **params)


mlir.register_lowering(_tpu_kernel_p, _elsewhere_lowering)
mlir.register_lowering(_tpu_kernel_p, functools.partial(_tpu_kernel_lowering, interpret=None), platform="tpu")


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


# DeepSeek-V4.1's kernels (spec: Single-pass schedule) are V4's with one more operand, which the
# families' wrappers take as a keyword: ``carried``, the carried mix f32 [T, n] or [T, 0] for the
# one-hot on stream 0 (the first sublayer), whose dcarried is [T, 0] too; for the boundary
# ``h_pre``, sublayer l's, which the next sublayer's pre-apply reads. None: V4's kernel.


def carried_operand(pre_apply: PreApply, x, carried):
    """The carried operand of the V4.1 pre targets for a mode (CARRIED or ONE_HOT, from
    PreApply.of at the top of the public call): the mix, or for the one-hot an f32 [..., 0] array,
    the form the C++ operations take for it (include/mhc/ops.h). Made here only."""
    if pre_apply is PreApply.CARRIED:
        return carried
    if pre_apply is not PreApply.ONE_HOT:
        raise ValueError(f"pre_apply: expected PreApply.CARRIED or PreApply.ONE_HOT, got {pre_apply!r}")
    return jnp.zeros((*x.shape[:-2], 0), _F32)


def _target(v4_target: str, carried) -> str:
    return v4_target if carried is None else v4_target + "_carried"


def _present(*arrays) -> tuple:
    return tuple(a for a in arrays if a is not None)


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


# The parameters' rows: q (stream) and r (feature, split as x's D), factors apart from x's n and d
# (see _partitioning: a sharding of the parameters alone, FSDP, must not spread to x).
_PARAMS = ("qr", "qrk", "a", "k")


# Dispatch per platform (see the module docstring; README, Support).


_KERNEL_PLATFORMS = ("cpu", "cuda", "tpu")  # the lowering platforms with an mhc backend


def _tpu_kernels() -> dict:
    """mhc.tpu.KERNELS, imported on first use: importing mhc.jax does not load Pallas."""
    from mhc import tpu

    return tpu.KERNELS


def _interpret_params():
    """The test switch (mhc.tpu.testing.interpret_on_cpu): its Pallas interpret parameters, or
    None while it is off, as it is wherever that module (which only tests import) is not loaded."""
    testing = sys.modules.get("mhc.tpu.testing")
    return None if testing is None else testing.interpret_params


def registered_targets(platform: str) -> frozenset:
    """The kernels this process has for a lowering platform ("cpu", "cuda", "tpu"), by FFI target
    name: the C++ FFI targets registered for cpu and cuda, mhc.tpu.KERNELS' keys for tpu."""
    if platform == "tpu":
        return frozenset(_tpu_kernels())
    return frozenset({"cpu": _ffi.TARGET_NAMES, "cuda": _ffi.CUDA_TARGETS}.get(platform, ()))


def _backend(platform: str) -> str:
    """Whose kernels run on a lowering platform: its own, or the TPU's on the CPU under the switch."""
    return "tpu" if platform == "cpu" and _interpret_params() is not None else platform


def _platform_label(platform: str) -> str:
    """The platform as the mhc errors name it."""
    if _backend(platform) != platform:
        return "'tpu' (the TPU kernels interpreted on the CPU: mhc.tpu.testing.interpret_on_cpu)"
    return repr(platform)


def _where_registered(target: str, branch) -> dict:
    """platform_dependent's keywords running ``branch`` on the platforms whose backend has ``target``."""
    return {platform: branch for platform in _KERNEL_PLATFORMS if target in registered_targets(_backend(platform))}


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
    substitutes = () if split else operation.fallback
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

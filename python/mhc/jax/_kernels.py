"""The C++ operations as JAX primitives: ffi_call wrappers and the custom VJPs around them.

Shapes here are flat: x [T, n, D]. The public functions in mhc.jax reshape leading dims.

pre's custom VJP returns x itself as an extra output (the context's copy). post's backward sends
its dx_partial back along that output, so pre's backward receives it as a cotangent and the C++
pre_backward adds it while it writes dx: no separate pass to sum the two paths of dx.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mhc import _ffi  # noqa: F401  (registers the FFI targets)
from mhc.jax._types import Config, Params

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


def _call(target: str, config: Config, result_types, *args, slices: int = 1):
    # "sequential": the calls take parameters, which other vmap methods would batch wrongly.
    call = jax.ffi.ffi_call(target, result_types, vmap_method="sequential")
    return call(*args, **_attributes(config, slices))


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def pre_forward(config: Config, x, params: Params):
    t, n, d = x.shape
    types = (_sds((t, d), x.dtype), _sds((t, n), _F32), _sds((t, n), _F32), _sds((t, n, n), _F32))
    return _call("mhc_pre_forward", config, types, x, *params)


def post_forward(config: Config, x, layer_out, h_post, h_res):
    return _call("mhc_post_forward", config, _sds(x.shape, x.dtype), x, layer_out, h_post, h_res)


def post_backward(config: Config, g, x, layer_out, h_post, h_res):
    t, n, _ = x.shape
    types = (_sds(x.shape, x.dtype), _sds(layer_out.shape, layer_out.dtype), _sds((t, n), _F32), _sds((t, n, n), _F32))
    return _call("mhc_post_backward", config, types, g, x, layer_out, h_post, h_res)


def pre_backward(config: Config, dlayer_in, dx_partial, dh_post, dh_res, x, params: Params):
    types = (_sds(x.shape, x.dtype),) + tuple(_sds(p.shape, _F32) for p in params)
    return _call("mhc_pre_backward", config, types, dlayer_in, dx_partial, dh_post, dh_res, x, *params)


def pre_forward_partials(config: Config, slices: int, x, norm_weight, phi):
    t = x.shape[0]
    types = _sds((t, config.projection_width + 1), _F32)
    return _call("mhc_pre_forward_partials", config, types, x, norm_weight, phi, slices=slices)


def pre_forward_finish(config: Config, slices: int, x, partials, alpha, bias):
    t, n, d = x.shape
    types = (_sds((t, d), x.dtype), _sds((t, n), _F32), _sds((t, n), _F32), _sds((t, n, n), _F32))
    return _call("mhc_pre_forward_finish", config, types, x, partials, alpha, bias, slices=slices)


def pre_backward_partials(config: Config, slices: int, dlayer_in, x):
    types = _sds(x.shape[:2], _F32)
    return _call("mhc_pre_backward_partials", config, types, dlayer_in, x, slices=slices)


def pre_backward_finish(
    config: Config, slices: int, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials, params: Params
):
    types = (_sds(x.shape, x.dtype),) + tuple(_sds(p.shape, _F32) for p in params)
    args = (dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials, *params)
    return _call("mhc_pre_backward_finish", config, types, *args, slices=slices)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def pre(config: Config, x, params: Params):
    """-> layer_in [T, D], x (for the context), h_post [T, n], h_res [T, n, n]."""
    layer_in, _, h_post, h_res = pre_forward(config, x, params)
    return layer_in, x, h_post, h_res


def _pre_fwd(config, x, params):
    return pre(config, x, params), (x, params)


def _pre_bwd(config, residuals, cotangents):
    x, params = residuals
    dlayer_in, dx_partial, dh_post, dh_res = cotangents
    dx, *grads = pre_backward(config, dlayer_in, dx_partial, dh_post, dh_res, x, params)
    return dx, Params(*grads)


pre.defvjp(_pre_fwd, _pre_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def post(config: Config, x, layer_out, h_post, h_res):
    """-> out [T, n, D]."""
    return post_forward(config, x, layer_out, h_post, h_res)


def _post_fwd(config, x, layer_out, h_post, h_res):
    return post(config, x, layer_out, h_post, h_res), (x, layer_out, h_post, h_res)


def _post_bwd(config, residuals, g):
    x, layer_out, h_post, h_res = residuals
    return tuple(post_backward(config, g, x, layer_out, h_post, h_res))


post.defvjp(_post_fwd, _post_bwd)


# Tensor parallelism, inside jax.shard_map over `axis` (`slices` devices, each with D / slices
# features of every stream and the matching rows of norm_weight and phi).
#
# shard_map (check_vma=False) keeps the cotangent of a value that is replicated over `axis` as
# per-device shares that sum to it: it divides a replicated output's cotangent by the axis size
# and sums (psum) the cotangents of replicated inputs. So the backward sums the shares of dh_post
# and dh_res with this slice's part of dh_pre in one all-reduce, and returns shares of the alpha
# and bias gradients, which every slice computes in full.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def pre_sliced(config: Config, axis, slices: int, x, params: Params):
    """-> layer_in [T, D/slices], x, h_post [T, n], h_res [T, n, n]: one all-reduce of [T, N+1]."""
    return _pre_sliced_fwd(config, axis, slices, x, params)[0]


def _pre_sliced_fwd(config, axis, slices, x, params):
    partials = pre_forward_partials(config, slices, x, params.norm_weight, params.phi)
    partials = jax.lax.psum(partials, axis)
    layer_in, _, h_post, h_res = pre_forward_finish(config, slices, x, partials, params.alpha, params.bias)
    return (layer_in, x, h_post, h_res), (x, params, partials)


def _pre_sliced_bwd(config, axis, slices, residuals, cotangents):
    x, params, partials = residuals
    dlayer_in, dx_partial, dh_post, dh_res = cotangents
    t, n, _ = x.shape
    dh_pre = pre_backward_partials(config, slices, dlayer_in, x)
    summed = jax.lax.psum(jnp.concatenate([dh_pre, dh_post, dh_res.reshape(t, n * n)], axis=1), axis)
    dh_pre, dh_post, dh_res = summed[:, :n], summed[:, n : 2 * n], summed[:, 2 * n :].reshape(t, n, n)
    dx, dnorm_weight, dphi, dalpha, dbias = pre_backward_finish(
        config, slices, dlayer_in, dx_partial, dh_pre, dh_post, dh_res, x, partials, params
    )
    return dx, Params(dnorm_weight, dphi, dalpha / slices, dbias / slices)


pre_sliced.defvjp(_pre_sliced_fwd, _pre_sliced_bwd)

"""Flax NNX layers: one mHC-wrapped sublayer, with the kernel switch of the original request, and
DeepSeek-V4's head."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from mhc import jax as mhc_jax


class ManifoldConstrainedHyperConnections(nnx.Module):
    """pre -> norm_fn -> branch_fn -> post around one sublayer (attention or MLP).

    In a stack, ``chain`` leaves each post pending so that it fuses with the next layer's pre:
    ``state = layer.chain(norm_fn, branch_fn, state)`` per sublayer, then
    ``mhc.jax.finish(state)``. ``layer(norm_fn, branch_fn, x)`` is one whole sublayer.

    Args:
      config: ``mhc.jax.Config`` (n, mix, Sinkhorn settings).
      dim: D, the features per stream.
      use_kernel: True runs the fused C++ kernels (custom VJP); False the plain-JAX reference.
      mesh, token_axes, tensor_axis: optional, and not needed to shard: under ``nnx.jit`` with
        sharded inputs the kernels' partitioning rules keep them sharded (README, "Many
        devices"). With a mesh, x and the outputs are also pinned to a layout
        (``mhc.jax.sharded_pre``): the first axis of x split over the mesh axes ``token_axes``
        and, with ``tensor_axis``, D split over that mesh axis.
      feature_axis: optional; a logical (or mesh) axis name for D in the parameters' sharding
        annotation (``out_sharding``, resolved through logical axis rules where set). The layer
        then holds norm_weight as [n, D] and phi as [n, D, N], with D on that axis, so that the
        device holding a slice of x's features holds the matching rows: with x's D on the same
        mesh axis nothing moves, and the gradients come back sharded the same way. Create the
        layer under a mesh (``jax.set_mesh``), as Flax requires for annotated variables. Without
        it the parameters are flat ([n*D], [n*D, N]) and unannotated: replicate them.
      rngs: ``nnx.Rngs`` for the initial phi.
    """

    def __init__(
        self,
        config: mhc_jax.Config,
        dim: int,
        *,
        use_kernel: bool = True,
        mesh=None,
        token_axes=None,
        tensor_axis=None,
        feature_axis: str | None = None,
        rngs: nnx.Rngs,
    ):
        if mesh is None and (token_axes is not None or tensor_axis is not None):
            raise ValueError("token_axes/tensor_axis: name axes of a mesh; pass mesh too")
        if mesh is not None and not use_kernel:
            raise ValueError("mesh: sharding applies to the kernel path; with use_kernel=False use jit shardings")
        initial = mhc_jax.init_params(rngs.params(), config, dim)
        self.config = config
        self.dim = dim
        self.use_kernel = use_kernel
        self.mesh = mesh
        self.token_axes = token_axes
        self.tensor_axis = tensor_axis
        if feature_axis is None:
            self.norm_weight = nnx.Param(initial.norm_weight)
            self.phi = nnx.Param(initial.phi)
        else:
            n, width = config.n, config.projection_width
            self.norm_weight = nnx.Param(initial.norm_weight.reshape(n, dim), out_sharding=(None, feature_axis))
            self.phi = nnx.Param(initial.phi.reshape(n, dim, width), out_sharding=(None, feature_axis, None))
        self.alpha = nnx.Param(initial.alpha)
        self.bias = nnx.Param(initial.bias)
        # Diagnostics hook: when set (outside jit), called with each call's H_res [..., n, n].
        self.on_mix = None

    def params(self) -> mhc_jax.Params:
        norm_weight, phi = self.norm_weight[...], self.phi[...]
        width = self.config.projection_width
        return mhc_jax.Params(norm_weight.reshape(-1), phi.reshape(-1, width), self.alpha[...], self.bias[...])

    def chain(self, norm_fn: Callable, branch_fn: Callable, state) -> mhc_jax.Pending:
        """This sublayer in a stack, its post left pending so that the next sublayer's pre fuses
        with it (``mhc.jax.sublayer``): ``state`` is the streams [..., n, D] or the ``Pending`` of
        the previous layer's ``chain``; end the stack with ``mhc.jax.finish(state)``.

        With ``mesh=`` the layouts are pinned by ``sharded_pre``/``sharded_post``, which do not
        fuse: the pending post is applied first. (Without ``mesh=``, sharded inputs under
        ``nnx.jit`` fuse on each device.)
        """
        if self.mesh is not None:
            return self._pinned_chain(norm_fn, branch_fn, state)
        # The identity branch leaves layer_in where layer_out goes, for the hook to see H_res first.
        opened = mhc_jax.sublayer(state, self.params(), self.config, lambda h: h, use_kernel=self.use_kernel)
        if self.on_mix is not None:
            self.on_mix(opened.ctx.h_res)
        return mhc_jax.Pending(branch_fn(norm_fn(opened.layer_out)), opened.ctx)

    def _pinned_chain(self, norm_fn: Callable, branch_fn: Callable, state) -> mhc_jax.Pending:
        axes = dict(mesh=self.mesh, token_axes=self.token_axes, tensor_axis=self.tensor_axis)
        if isinstance(state, mhc_jax.Pending):
            state = mhc_jax.sharded_post(state.layer_out, state.ctx, **axes)
        layer_in, ctx = mhc_jax.sharded_pre(state, self.params(), self.config, **axes)
        if self.on_mix is not None:
            self.on_mix(ctx.h_res)
        return mhc_jax.Pending(branch_fn(norm_fn(layer_in)), ctx)

    def __call__(self, norm_fn: Callable, branch_fn: Callable, x: jax.Array) -> jax.Array:
        axes = dict(mesh=self.mesh, token_axes=self.token_axes, tensor_axis=self.tensor_axis)
        if self.mesh is not None:
            layer_in, ctx = mhc_jax.sharded_pre(x, self.params(), self.config, **axes)
        else:
            layer_in, ctx = mhc_jax.pre(x, self.params(), self.config, use_kernel=self.use_kernel)
        if self.on_mix is not None:
            self.on_mix(ctx.h_res)
        layer_out = branch_fn(norm_fn(layer_in))
        if self.mesh is not None:
            return mhc_jax.sharded_post(layer_out, ctx, **axes)
        return mhc_jax.post(layer_out, ctx)


class Head(nnx.Module):
    """DeepSeek-V4's head: the learned collapse of the n streams [..., n, D] into one [..., D]
    after the last sublayer (``mhc.jax.head``; spec: Head), in place of ``mhc.jax.reduce``.

    Parameters as V4 stores them: fn [n, n*D], base [n], scale [1] (``mhc.jax.HeadParams``).
    ``use_kernel`` as for ``ManifoldConstrainedHyperConnections``.
    """

    def __init__(self, config: mhc_jax.Config, dim: int, *, use_kernel: bool = True, rngs: nnx.Rngs):
        initial = mhc_jax.init_head_params(rngs.params(), config, dim)
        self.config = config
        self.use_kernel = use_kernel
        self.fn = nnx.Param(initial.fn)
        self.base = nnx.Param(initial.base)
        self.scale = nnx.Param(initial.scale)

    def params(self) -> mhc_jax.HeadParams:
        return mhc_jax.HeadParams(self.fn[...], self.base[...], self.scale[...])

    def __call__(self, x: jax.Array) -> jax.Array:
        return mhc_jax.head(x, self.params(), self.config, use_kernel=self.use_kernel)

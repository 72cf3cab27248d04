"""Flax NNX layers: one mHC-wrapped sublayer, with the kernel switch of the original request, a
stack of them (``stack``: the chain, optionally recomputing the streams in groups), and
DeepSeek-V4's head."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mhc import jax as mhc_jax


class ManifoldConstrainedHyperConnections(nnx.Module):
    """pre -> norm_fn -> branch_fn -> post around one sublayer (attention or MLP).

    In a stack, ``chain`` leaves each post pending so that it fuses with the next layer's pre:
    ``state = layer.chain(norm_fn, branch_fn, state)`` per sublayer, then
    ``mhc.jax.finish(state)``. ``layer(norm_fn, branch_fn, x)`` is one whole sublayer.

    DeepSeek-V4.1 (``config.pre_from_previous``; spec: Single-pass schedule): each sublayer reads
    its input with the previous sublayer's pre gates (the first: stream 0), so the mix is carried
    from layer to layer. ``chain`` carries it in the ``Pending`` (the fused boundary passes it on);
    a whole sublayer takes the streams [..., n, D] (first sublayer) or an ``mhc.jax.Streams`` and
    returns ``mhc.jax.Streams(out, h_pre)``; a V4.1 stack ends with ``mhc.jax.collapse(state)``
    (the sum by the last pre gates, no parameters) instead of a head.

    The parameters are held as norm_weight [n, D], phi [n, D, N], alpha [3] and bias [N] whatever
    the sharding (row k*D + d of the spec's flat [n*D] layout is [k, d]); ``params()`` gives the
    flat ``mhc.jax.Params`` and ``load_params`` sets them from one (e.g. ``mhc.interop``'s).

    Sharding: run the layer under ``nnx.jit`` with sharded inputs; the kernels' partitioning rules
    keep tokens and D where they are (docs/sharding.md). ``feature_axis`` only annotates the
    parameters: a logical (or mesh) axis name for D, recorded as their ``out_sharding`` metadata
    ((None, feature_axis) and (None, feature_axis, None)) and resolved through logical axis rules
    where set. With x's D on the same mesh axis the device holding a slice of x's features holds
    the matching parameter rows: nothing moves, and the gradients come back sharded the same way.
    Flax places annotated variables when they are created, so create the layer under a mesh
    (``jax.set_mesh``); without ``feature_axis`` the parameters are unannotated (replicate them).

    Diagnostics: with ``sow_mixes`` True each call sows its H_res [..., n, n] as the
    ``nnx.Intermediate`` "h_res" (first index input stream i, second output stream j). Turn it on
    for a probe with ``nnx.view(model, sow_mixes=True)`` and collect with ``nnx.capture``, under
    ``nnx.jit`` or not: ``_, mixes = nnx.capture(probe, nnx.Intermediate)(x)``. It is off by
    default, so training steps carry no intermediates.

    Args:
      config: ``mhc.jax.Config`` (n, mix, Sinkhorn settings).
      dim: D, the features per stream.
      use_kernel: True runs the fused C++ kernels (custom VJP); False the plain-JAX reference.
      feature_axis: optional sharding annotation of D, as above.
      sow_mixes: sow each call's H_res, as above.
      rngs: ``nnx.Rngs`` for the initial phi.
    """

    def __init__(
        self,
        config: mhc_jax.Config,
        dim: int,
        *,
        use_kernel: bool = True,
        feature_axis: str | None = None,
        sow_mixes: bool = False,
        rngs: nnx.Rngs,
    ):
        initial = mhc_jax.init_params(rngs.params(), config, dim)
        n, width = config.n, config.projection_width
        self.config = config
        self.dim = dim
        self.use_kernel = use_kernel
        self.sow_mixes = sow_mixes
        self.norm_weight = nnx.Param(initial.norm_weight.reshape(n, dim), **_annotation(feature_axis, ndim=2))
        self.phi = nnx.Param(initial.phi.reshape(n, dim, width), **_annotation(feature_axis, ndim=3))
        self.alpha = nnx.Param(initial.alpha)
        self.bias = nnx.Param(initial.bias)

    def set_view(self, sow_mixes: bool | None = None):
        """For ``nnx.view``: ``sow_mixes`` as in the constructor."""
        if sow_mixes is not None:
            self.sow_mixes = sow_mixes

    def params(self) -> mhc_jax.Params:
        width = self.config.projection_width
        return mhc_jax.Params(
            self.norm_weight[...].reshape(-1), self.phi[...].reshape(-1, width), self.alpha[...], self.bias[...]
        )

    def load_params(self, params: mhc_jax.Params) -> None:
        """Set the parameters from ``mhc.jax.Params`` (flat, f32: what ``mhc.interop`` converts),
        checked against this layer's n, D and mix; each keeps its variable's sharding."""
        if not isinstance(params, mhc_jax.Params):
            raise TypeError(f"params: expected mhc.jax.Params, got {type(params).__name__}")
        m, width = self.config.n * self.dim, self.config.projection_width
        expected = {"norm_weight": (m,), "phi": (m, width), "alpha": (3,), "bias": (width,)}
        context = f"n={self.config.n}, D={self.dim}, mix={self.config.mix!r}"
        _load(self, params, expected, context)

    def _mixed(self, h_res: jax.Array) -> None:
        if self.sow_mixes:
            self.sow(nnx.Intermediate, "h_res", h_res)

    def chain(self, norm_fn: Callable, branch_fn: Callable, state) -> mhc_jax.Pending:
        """This sublayer in a stack, its post left pending so that the next sublayer's pre fuses
        with it (``mhc.jax.sublayer``): ``state`` is the streams [..., n, D] or the ``Pending`` of
        the previous layer's ``chain``; end the stack with ``mhc.jax.finish(state)``.
        """
        # The identity branch leaves layer_in where layer_out goes, so that H_res is sown first.
        opened = mhc_jax.sublayer(state, self.params(), self.config, lambda h: h, use_kernel=self.use_kernel)
        self._mixed(opened.ctx.h_res)
        return mhc_jax.Pending(branch_fn(norm_fn(opened.layer_out)), opened.ctx)

    def __call__(self, norm_fn: Callable, branch_fn: Callable, x):
        """One whole sublayer: the streams [..., n, D] after it. V4.1 (``config.pre_from_previous``):
        x is the streams (the first sublayer, which reads stream 0) or an ``mhc.jax.Streams`` (the
        carried mix with them), and the result is ``mhc.jax.Streams(out, this sublayer's h_pre)``."""
        if not self.config.pre_from_previous:
            if isinstance(x, mhc_jax.Streams):
                raise TypeError(
                    "x: an mhc.jax.Streams carries V4.1's mix, which this layer's config (pre_from_previous=False) "
                    "does not read; pass the streams [..., n, D]"
                )
            layer_in, ctx = mhc_jax.pre(x, self.params(), self.config, use_kernel=self.use_kernel)
            self._mixed(ctx.h_res)
            return mhc_jax.post(branch_fn(norm_fn(layer_in)), ctx)
        streams, carried = (x.x, x.carried) if isinstance(x, mhc_jax.Streams) else (x, None)
        layer_in, ctx = mhc_jax.pre(streams, self.params(), self.config, carried=carried, use_kernel=self.use_kernel)
        self._mixed(ctx.h_res)
        return mhc_jax.Streams(mhc_jax.post(branch_fn(norm_fn(layer_in)), ctx), ctx.h_pre)


def stack(
    state,
    sublayers: Sequence[tuple[ManifoldConstrainedHyperConnections, Callable, Callable]],
    *,
    recompute: int | None = None,
    fuse_boundaries: bool = True,
):
    """The sublayers (layer, norm_fn, branch_fn) in order on the streams ``state`` [..., n, D]
    (or a ``Pending``): each ``layer.chain(norm_fn, branch_fn, state)``, whose result ends with
    ``mhc.jax.finish``; with ``fuse_boundaries=False`` each ``layer(norm_fn, branch_fn, x)`` whole
    (the result is then the streams).

    DeepSeek-V4.1 layers (``config.pre_from_previous``, all of them or none): the carried mix goes
    from each sublayer to the next (state may also be an ``mhc.jax.Streams``; unfused, the result
    is one), and the stack ends with ``mhc.jax.collapse(state)`` instead of a head.

    recompute: as for ``mhc.jax.stack``: None keeps every sublayer's streams for the backward; k
    keeps them only at the start of every group of k sublayers, each group under ``nnx.remat``
    with ``mhc.jax.recompute_policy``, so its backward rebuilds the streams (and each layer_in)
    with the mhc kernels, never re-running norm_fn or branch_fn (the kernels' results are the same
    bits; XLA may round the branches differently across the barrier: docs/jax.md).
    The layers must run the kernels (``use_kernel=True``). Pass modules as norm_fn and branch_fn
    (not functions closing over modules) where they update state (``sow``): nnx.remat carries
    the modules it is given. On the CPU mind the scheduler (``mhc.jax.recompute_streams``).
    """
    sublayers = [tuple(entry) for entry in sublayers]
    for index, (layer, _, _) in enumerate(sublayers):
        if not isinstance(layer, ManifoldConstrainedHyperConnections):
            raise TypeError(
                f"sublayers[{index}]: expected (ManifoldConstrainedHyperConnections, norm_fn, branch_fn), "
                f"got a {type(layer).__name__} first"
            )
        if layer.config.pre_from_previous != sublayers[0][0].config.pre_from_previous:
            raise ValueError(
                f"sublayers[{index}]: config.pre_from_previous={layer.config.pre_from_previous}, but sublayers[0] "
                f"has {sublayers[0][0].config.pre_from_previous}: a stack runs one schedule (V4 or V4.1)"
            )
        if recompute is not None and not layer.use_kernel:
            raise ValueError(
                f"recompute: sublayers[{index}] runs the plain path (use_kernel=False), which has no kernels to "
                "rebuild the streams with; use the kernels, or recompute=None"
            )
    mhc_jax._check_recompute(recompute, use_kernel=True)
    size = recompute or max(1, len(sublayers))
    for start in range(0, len(sublayers), size):
        group = sublayers[start : start + size]
        # nnx.remat passes its arguments through jax.checkpoint: the modules go as arguments (their
        # state is carried in and out), any other callable stays in the closure.
        modules = [[part if isinstance(part, nnx.Module) else None for part in entry] for entry in group]
        callables = [[None if isinstance(part, nnx.Module) else part for part in entry] for entry in group]

        run = _group(callables, fuse_boundaries)
        if recompute:
            mhc_jax._warn_about_the_cpu_scheduler()
            run = nnx.remat(run, policy=mhc_jax.recompute_policy)
        state = run(modules, state)
    return state


def _group(callables: list, fuse_boundaries: bool) -> Callable:
    """A group's run(modules, state), its plain callables in the closure (nnx.remat would pass a
    default or partial argument through jax.checkpoint, which takes arrays only)."""

    def run(modules, state):
        for given, kept in zip(modules, callables, strict=True):
            layer, norm_fn, branch_fn = (m if m is not None else c for m, c in zip(given, kept, strict=True))
            if fuse_boundaries:
                state = layer.chain(norm_fn, branch_fn, state)
            elif layer.config.pre_from_previous:  # Streams (or the first x), the carried mix kept
                state = layer(norm_fn, branch_fn, mhc_jax.streams(state))
            else:
                state = layer(norm_fn, branch_fn, mhc_jax.finish(state))
        return state

    return run


class Head(nnx.Module):
    """DeepSeek-V4's head: the learned collapse of the n streams [..., n, D] into one [..., D]
    after the last sublayer (``mhc.jax.head``; spec: Head), in place of ``mhc.jax.reduce``.

    Parameters as V4 stores them: fn [n, n*D], base [n], scale [1] (``mhc.jax.HeadParams``);
    ``load_params`` sets them from one (e.g. ``mhc.interop.load_v4(...).head``).
    ``use_kernel`` as for ``ManifoldConstrainedHyperConnections``.
    """

    def __init__(self, config: mhc_jax.Config, dim: int, *, use_kernel: bool = True, rngs: nnx.Rngs):
        initial = mhc_jax.init_head_params(rngs.params(), config, dim)
        self.config = config
        self.dim = dim
        self.use_kernel = use_kernel
        self.fn = nnx.Param(initial.fn)
        self.base = nnx.Param(initial.base)
        self.scale = nnx.Param(initial.scale)

    def params(self) -> mhc_jax.HeadParams:
        return mhc_jax.HeadParams(self.fn[...], self.base[...], self.scale[...])

    def load_params(self, params: mhc_jax.HeadParams) -> None:
        """Set fn, base and scale from ``mhc.jax.HeadParams`` (f32), checked against n and D."""
        if not isinstance(params, mhc_jax.HeadParams):
            raise TypeError(f"params: expected mhc.jax.HeadParams, got {type(params).__name__}")
        n = self.config.n
        _load(self, params, {"fn": (n, n * self.dim), "base": (n,), "scale": (1,)}, f"n={n}, D={self.dim}")

    def __call__(self, x: jax.Array) -> jax.Array:
        return mhc_jax.head(x, self.params(), self.config, use_kernel=self.use_kernel)


def _annotation(feature_axis: str | None, *, ndim: int) -> dict:
    """out_sharding metadata of a [n, D, ...] parameter naming D's axis, or none."""
    if feature_axis is None:
        return {}
    return {"out_sharding": (None, feature_axis) + (None,) * (ndim - 2)}


def _load(module: nnx.Module, params, expected: dict, context: str) -> None:
    """Check every field of ``params`` first (shape, f32), then set each variable to it in the
    variable's own shape, and placed as the variable is where that placement is a mesh sharding
    (an annotated parameter); otherwise left uncommitted, free to follow its inputs under jit."""
    for name, shape in expected.items():
        value = getattr(params, name)
        if tuple(np.shape(value)) != shape:
            raise ValueError(f"params.{name}: expected shape {shape} for {context}, got {tuple(np.shape(value))}")
        if jnp.result_type(value) != jnp.float32:
            raise TypeError(f"params.{name}: expected float32, got {jnp.result_type(value)}")
    for name in expected:
        variable = getattr(module, name)
        current = variable[...]
        value = jnp.reshape(jnp.asarray(getattr(params, name)), current.shape)
        if isinstance(current.sharding, jax.sharding.NamedSharding):
            value = jax.device_put(value, current.sharding)
        variable[...] = value

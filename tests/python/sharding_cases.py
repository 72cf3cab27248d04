"""Sharded kernels on 8 forced CPU devices vs one device. Run by test_sharding.py in a subprocess
(XLA_FLAGS must be set before JAX starts). Exits non-zero on the first mismatch."""

import os
import re
import sys

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "run via test_sharding.py"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import mhc.jax as mj  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from conftest import random_params, relative_error  # noqa: E402


def all_reduce_shapes(hlo: str) -> list:
    """The result shapes of the all-reduce ops in compiled HLO text."""
    return re.findall(r"= (\S+\[[\d,]*\])\S* all-reduce(?:-start)?\(", hlo)


def all_gather_shapes(hlo: str) -> list:
    return re.findall(r"= (\S+\[[\d,]*\])\S* all-gather(?:-start)?\(", hlo)


def check(mesh_shape, axis_names, token_axes, mix, seed, tensor_axis=None):
    devices = np.array(jax.devices()[:8]).reshape(mesh_shape)
    mesh = Mesh(devices, axis_names)
    config, d = mj.Config(n=4, mix=mix, sinkhorn_iters=3 if mix == "sinkhorn" else 20, pre_eps=0.1, post_scale=1.3), 40
    kx, kp, kw, kl = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (16, 3, 4, d))
    params = random_params(kp, config, d)
    w = jax.random.normal(kw, x.shape)
    w_in = jax.random.normal(kl, (16, 3, d))
    axes = dict(mesh=mesh, token_axes=token_axes, tensor_axis=tensor_axis)
    name = f"mesh {dict(mesh.shape)} tokens {token_axes} tensor {tensor_axis} {mix}"

    def forward_single(x, params):
        layer_in, ctx = mj.pre(x, params, config)
        return mj.post(jnp.tanh(layer_in), ctx), layer_in

    def forward_sharded(x, params):
        layer_in, ctx = mj.sharded_pre(x, params, config, **axes)
        return mj.sharded_post(jnp.tanh(layer_in), ctx, **axes), layer_in

    def loss(forward):
        # Random weights, so no gradient cancels; the scalar itself is not compared (a sum of
        # thousands of signed terms is ill-conditioned), the forward tensors are.
        def value(x, params):
            out, layer_in = forward(x, params)
            return jnp.sum(out * w) + jnp.sum(layer_in * w_in)

        return value

    loss_single, loss_sharded = loss(forward_single), loss(forward_sharded)
    want = jax.jit(forward_single)(x, params), jax.jit(jax.grad(loss_single, argnums=(0, 1)))(x, params)
    got = jax.jit(forward_sharded)(x, params), jax.jit(jax.grad(loss_sharded, argnums=(0, 1)))(x, params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        error = relative_error(a, b)
        assert error <= 1e-5, f"{name}: {jax.tree_util.keystr(path)} error {error:.3g} (seed {seed})"

    # The forward moves nothing but the [tokens, N+1] partials, and only with a tensor axis.
    x_sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, mj._Layout(mesh, token_axes, tensor_axis, 4, d).x))
    forward_hlo = jax.jit(forward_sharded).lower(x_sharded, params).compile().as_text()
    assert "all-gather" not in forward_hlo, f"{name}: the sharded forward gathers activations"
    local_tokens = 16 * 3 // int(np.prod([mesh.shape[a] for a in mj._axes_tuple(token_axes)]))
    expected = [f"f32[{local_tokens},{config.projection_width + 1}]"] if tensor_axis else []
    assert all_reduce_shapes(forward_hlo) == expected, f"{name}: forward all-reduces {all_reduce_shapes(forward_hlo)}"
    backward_hlo = jax.jit(jax.grad(loss_sharded, argnums=(0, 1))).lower(x_sharded, params).compile().as_text()
    # The replicated parameters get whole gradients: only dnorm_weight and dphi, [n, D(, N)], may
    # be gathered from their slices, never anything with a token axis.
    n, width = config.n, config.projection_width
    gathered = set(all_gather_shapes(backward_hlo))
    assert gathered <= {f"f32[{n},{d}]", f"f32[{n},{d},{width}]"}, f"{name}: the backward gathers {gathered}"
    assert bool(gathered) == bool(tensor_axis), f"{name}: unexpected all-gathers {gathered}"
    if tensor_axis is None:
        # Control: the unsharded kernel call on sharded inputs must gather (the check can fail).
        control = jax.jit(loss_single).lower(x_sharded, params).compile().as_text()
        assert "all-gather" in control, "control: expected an all-gather for the opaque custom call"
    print(f"ok: {name}")


def check_bad_axes():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
    config, d = mj.Config(n=2), 6
    x = jnp.ones((4, 2, d))
    params = mj.init_params(jax.random.key(0), config, d)
    bad = {
        "D = 6": dict(token_axes="data", tensor_axis="tensor"),  # 6 features over 4 devices
        "'model' is not an axis": dict(token_axes="data", tensor_axis="model"),
        "also one of token_axes": dict(token_axes=("data", "tensor"), tensor_axis="tensor"),
    }
    for fragment, axes in bad.items():
        try:
            mj.sharded_pre(x, params, config, mesh=mesh, **axes)
        except ValueError as error:
            assert fragment in str(error), error
            continue
        raise AssertionError(f"expected ValueError with {fragment!r} for {axes}")
    print("ok: bad tensor axes are rejected")


def check_flax_layer(seed):
    from flax import nnx

    from mhc.flax import ManifoldConstrainedHyperConnections

    config, d = mj.Config(n=3, sinkhorn_iters=4, pre_eps=0.1, post_scale=1.3), 16
    x = jax.random.normal(jax.random.key(seed), (8, 5, 3, d))
    # Trained-looking parameters (alpha of order 1, random bias), the same in every layer.
    trained = random_params(jax.random.key(seed + 1), config, d)

    def with_trained(layer):
        for name in mj.Params._fields:
            getattr(layer, name)[...] = getattr(trained, name)
        return layer

    plain = with_trained(ManifoldConstrainedHyperConnections(config, d, rngs=nnx.Rngs(seed)))
    want = plain(lambda h: h, jnp.tanh, x)
    layouts = {"data": ((8,), ("data",), None), "data+tensor": ((2, 4), ("data", "tensor"), "tensor")}
    for label, (shape, names, tensor_axis) in layouts.items():
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names)
        sharded = with_trained(
            ManifoldConstrainedHyperConnections(
                config, d, mesh=mesh, token_axes="data", tensor_axis=tensor_axis, rngs=nnx.Rngs(seed)
            )
        )
        got = sharded(lambda h: h, jnp.tanh, x)
        assert relative_error(got, want) <= 1e-6, f"flax layer with mesh {label} differs from one device"
        print(f"ok: flax layer with mesh {label}")


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    seed = int(sys.argv[1])
    for mix in ("sinkhorn", "permutations"):
        check((8,), ("data",), "data", mix, seed)
        check((4, 2), ("data", "seq"), ("data", "seq"), mix, seed)
        check((4, 2), ("data", "tensor"), "data", mix, seed, tensor_axis="tensor")
        check((2, 4), ("data", "tensor"), "data", mix, seed, tensor_axis="tensor")
        check((8,), ("tensor",), None, mix, seed, tensor_axis="tensor")
    check_bad_axes()
    check_flax_layer(seed)

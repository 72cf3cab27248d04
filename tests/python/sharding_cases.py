"""Sharded kernels on 8 forced CPU devices vs one device. Run by test_sharding.py in a subprocess
(XLA_FLAGS must be set before JAX starts). Exits non-zero on the first mismatch."""

import os
import sys

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "run via test_sharding.py"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import mhc.jax as mj  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from conftest import random_params, relative_error  # noqa: E402


def check(mesh_shape, axis_names, token_axes, mix, seed):
    devices = np.array(jax.devices()[:8]).reshape(mesh_shape)
    mesh = Mesh(devices, axis_names)
    config, d = mj.Config(n=4, mix=mix), 40
    kx, kp, kw, kl = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (16, 3, 4, d))
    params = random_params(kp, config, d)
    w = jax.random.normal(kw, x.shape)
    w_in = jax.random.normal(kl, (16, 3, d))

    def loss_single(x, params):
        layer_in, ctx = mj.pre(x, params, config)
        return jnp.sum(mj.post(jnp.tanh(layer_in), ctx) * w) + jnp.sum(layer_in * w_in)

    def loss_sharded(x, params):
        layer_in, ctx = mj.sharded_pre(x, params, config, mesh=mesh, token_axes=token_axes)
        out = mj.sharded_post(jnp.tanh(layer_in), ctx, mesh=mesh, token_axes=token_axes)
        return jnp.sum(out * w) + jnp.sum(layer_in * w_in)

    want = jax.jit(jax.value_and_grad(loss_single, argnums=(0, 1)))(x, params)
    got = jax.jit(jax.value_and_grad(loss_sharded, argnums=(0, 1)))(x, params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        error = relative_error(a, b)
        assert error <= 1e-5, f"mesh {mesh_shape} {mix}: {jax.tree_util.keystr(path)} error {error:.3g} (seed {seed})"
    hlo = jax.jit(loss_sharded).lower(x, params).compile().as_text()
    assert "all-gather" not in hlo, f"mesh {mesh_shape}: the sharded forward gathers activations"
    # Control: the unsharded kernel call on sharded inputs must gather (the check can fail).
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(token_axes))
    control = jax.jit(loss_single).lower(jax.device_put(x, sharding), params).compile().as_text()
    assert "all-gather" in control, "control: expected an all-gather for the opaque custom call"
    print(f"ok: mesh {mesh_shape} axes {token_axes} {mix}")


def check_flax_layer(seed):
    from flax import nnx

    from mhc.flax import ManifoldConstrainedHyperConnections

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    config, d = mj.Config(n=3), 16
    plain = ManifoldConstrainedHyperConnections(config, d, rngs=nnx.Rngs(seed))
    sharded = ManifoldConstrainedHyperConnections(config, d, mesh=mesh, token_axes="data", rngs=nnx.Rngs(seed))
    x = jax.random.normal(jax.random.key(seed), (8, 5, 3, d))
    want = plain(lambda h: h, jnp.tanh, x)
    got = sharded(lambda h: h, jnp.tanh, x)
    assert relative_error(got, want) <= 1e-6, "flax layer with a mesh differs from one device"
    print("ok: flax layer with mesh")


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    seed = int(sys.argv[1])
    for mix in ("sinkhorn", "permutations"):
        check((8,), ("data",), "data", mix, seed)
        check((4, 2), ("data", "seq"), ("data", "seq"), mix, seed)
    check_flax_layer(seed)

"""DeepSeek-V4.1's chain (pre with the carried mix, the fused V4.1 boundary, collapse) on 2 forced
CPU devices vs one device. Run by test_carried.py in a subprocess (XLA_FLAGS must be set before
JAX starts): ``python carried_sharding_cases.py SEED``. Exits non-zero on the first mismatch and
prints one "ok:" line per passing case.

Tokens sharded under plain jax.jit: the values are one device's bits, the gradients one device's
up to the order of the parameter sums, the forward holds no collective and the gradient only
the all-reduces of the parameter gradients; padded token rows stay out of them. The same inside
jax.shard_map. D split: the split
forms where the kernels have them, else the mhc error that names what works.
"""

import os
import re
import sys

assert "--xla_force_host_platform_device_count=2" in os.environ.get("XLA_FLAGS", ""), "run via test_carried.py"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mhc.jax as mj  # noqa: E402
from mhc.jax import _kernels  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from conftest import random_params, relative_error  # noqa: E402

# (sharding_cases.py names each collective's shapes; it runs on 8 devices only, so not imported.)
_COLLECTIVE = re.compile(r" (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def collectives(hlo: str) -> list:
    """The collective operations in compiled HLO text, in order."""
    return _COLLECTIVE.findall(hlo)


N, D, LAYERS = 4, 16, 3
CONFIG = mj.Config(n=N, pre_from_previous=True, sinkhorn_iters=3)
SPLIT_TARGETS = {"mhc_pre_forward_finish_carried", "mhc_pre_backward_finish_carried"}


def problem(seed):
    keys = jax.random.split(jax.random.key(seed), 2 * LAYERS + 1)
    x = jax.random.normal(keys[0], (4, 6, N, D), jnp.float32)
    params = [random_params(k, CONFIG, D) for k in keys[1 : LAYERS + 1]]
    weights = [jax.random.normal(k, (D, D), jnp.float32) / np.sqrt(D) for k in keys[LAYERS + 1 :]]
    return x, params, weights


def chain(x, params, weights, tensor_axis=None):
    """weights None: an elementwise branch, which runs on a device's D slice as well."""
    if weights is None:
        branches = [lambda h, s=s: jnp.tanh(h) * s for s in (1.5, 0.7, 1.2)[: len(params)]]
    else:
        branches = [lambda h, w=w: jnp.tanh(h @ w) for w in weights]
    sublayers = [(p, CONFIG, b) for p, b in zip(params, branches, strict=True)]
    return mj.collapse(mj.stack(x, sublayers, tensor_axis=tensor_axis), tensor_axis=tensor_axis)


def loss(x, params, weights):
    return jnp.sum(jnp.sin(chain(x, params, weights)))


def check(label, got, want, exact):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(a)), f"{label}: {jax.tree_util.keystr(path)} not finite"
        if exact:
            assert np.array_equal(a, b), f"{label}: {jax.tree_util.keystr(path)} differs from one device"
        else:
            error = relative_error(a, b)
            assert error <= 1e-5, f"{label}: {jax.tree_util.keystr(path)} relative error {error:.3g}"


def main(seed):
    assert len(jax.devices()) == 2
    mesh = Mesh(np.array(jax.devices()), ("tokens",))
    x, params, weights = problem(seed)
    gradient = jax.grad(loss, argnums=(0, 1))
    want_out = jax.jit(chain)(x, params, weights)
    want_grads = jax.jit(gradient)(x, params, weights)

    # Tokens (the batch axis) sharded under plain jit.
    xs = jax.device_put(x, NamedSharding(mesh, P("tokens")))
    forward = jax.jit(chain).lower(xs, params, weights).compile()
    out = forward(xs, params, weights)
    assert out.sharding.spec[0] == "tokens", out.sharding
    check("jit tokens forward", out, want_out, exact=True)
    assert collectives(forward.as_text()) == [], collectives(forward.as_text())
    backward = jax.jit(gradient).lower(xs, params, weights).compile()
    grads = backward(xs, params, weights)
    check("jit tokens dx", grads[0], want_grads[0], exact=True)
    check("jit tokens dparams", grads[1], want_grads[1], exact=False)
    found = collectives(backward.as_text())
    assert found and set(found) == {"all-reduce"}, found
    print("ok: jit, tokens sharded")

    # The same inside shard_map (each device its tokens; shard_map sums the parameter gradients).
    def mapped(x, params, weights):
        return jax.shard_map(
            lambda x: chain(x, params, weights), mesh=mesh, in_specs=P("tokens"), out_specs=P("tokens")
        )(x)

    check("shard_map tokens forward", jax.jit(mapped)(xs, params, weights), want_out, exact=True)
    mapped_grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(mapped(*a))), argnums=(0, 1)))(xs, params, weights)
    check("shard_map tokens dx", mapped_grads[0], want_grads[0], exact=True)
    check("shard_map tokens dparams", mapped_grads[1], want_grads[1], exact=False)
    print("ok: shard_map, tokens split")

    # Padded rows holding values: 3 batch rows over 2 devices, x entering as cos(x) (cos(0) = 1
    # where XLA pads with zeros) and a cotangent nonzero there: the parameter gradients of the V4.1
    # pre and boundary backwards equal one device's only while they mask the padded rows.
    xp = x[:3]
    target = jnp.cos(jnp.arange(D, dtype=jnp.float32))

    def padded_gradient(x, params, constrain):
        if constrain:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("tokens")))

        def padded_loss(x, params):
            return jnp.sum(jnp.square(chain(jnp.cos(x), params, None) - target))

        return jax.grad(padded_loss, argnums=(0, 1))(x, params)

    want_padded = jax.jit(padded_gradient, static_argnums=2)(xp, params[:2], False)
    got_padded = jax.jit(padded_gradient, static_argnums=2)(xp, params[:2], True)
    check("padded rows", got_padded, want_padded, exact=False)
    print("ok: padded rows with values")

    # D split (an elementwise branch): the split forms where the CPU has them, else the error
    # naming what works.
    split = _kernels.registered_targets("cpu") >= SPLIT_TARGETS
    want_split = jax.jit(gradient)(x, params, None)
    xd = jax.device_put(x, NamedSharding(mesh, P(None, None, None, "tokens")))
    if split:
        check("jit D split", jax.jit(gradient)(xd, params, None), want_split, exact=False)
    else:
        try:
            jax.jit(gradient).lower(xd, params, None).compile()
        except Exception as error:  # raised from XLA's partitioner callback: the type may be wrapped
            assert "is split over devices" in str(error) and "use_kernel=False" in str(error), error
        else:
            raise AssertionError("D split without the split-form kernels compiled")
    print(f"ok: jit, D split ({'split forms' if split else 'named error'})")

    def tensor_parallel(x, params):
        return jax.shard_map(
            lambda x, params: chain(x, params, None, tensor_axis="tokens"),
            mesh=mesh,
            in_specs=(P(None, None, None, "tokens"), P()),
            out_specs=P(None, None, "tokens"),
        )(x, params)

    tp_gradient = jax.jit(jax.grad(lambda x, params: jnp.sum(jnp.sin(tensor_parallel(x, params))), argnums=(0, 1)))
    if split:
        check("shard_map D split", tp_gradient(xd, params), want_split, exact=False)
    else:
        try:
            tp_gradient.lower(xd, params)
        except NotImplementedError as error:
            assert re.search(r"mhc\.jax\.\w+: D .* is split over devices", str(error)), error
        else:
            raise AssertionError("tensor_axis without the split-form kernels lowered")
    print(f"ok: shard_map, D split ({'split forms' if split else 'named error'})")


if __name__ == "__main__":
    main(int(sys.argv[1]))

"""DeepSeek-V4.1's chain (pre with the carried mix, the fused V4.1 boundary, collapse) on 2 forced
CPU devices, against one device's bits or the float64 oracle. Run by test_carried.py in a
subprocess (XLA_FLAGS must be set before JAX starts): ``python carried_sharding_cases.py SEED``.
Exits non-zero on the first mismatch and prints one "ok:" line per passing case.

Tokens sharded under plain jax.jit: the values and dx are one device's bits, the gradients
match the float64 V4.1 chain (conftest.assert_chain_matches; the parameter sums over devices
are another f32 rounding), the forward holds no collective and the gradient only
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
from conftest import (  # noqa: E402
    assert_chain_matches,
    assert_matches,
    carried_chain_values,  # noqa: E402
    perturbed_chain_values,
    random_params,
)

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


def oracle_sublayers(params, weights):
    """chain's sublayers for conftest's float64 V4.1 chain (carried_chain_values)."""
    if weights is None:
        return [(p, CONFIG, lambda h, s=s: jnp.tanh(h) * s) for p, s in zip(params, (1.5, 0.7, 1.2), strict=False)]
    return [(p, CONFIG, lambda h, w: jnp.tanh(h @ w), (w,)) for p, w in zip(params, weights, strict=True)]


def check_same_bits(label, got, want):
    """A forward or dx that runs the same kernels on each token as one device: the same bits."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(a)), f"{label}: {jax.tree_util.keystr(path)} not finite"
        assert np.array_equal(a, b), f"{label}: {jax.tree_util.keystr(path)} differs from one device"


def check_loss_gradients(label, grads, x, params, weights, seed):
    """grads = (dx, [dparams]) of loss (sum(sin(chain))) or one of its parts against the float64
    V4.1 chain with the one accuracy rule (conftest.assert_chain_matches): a sum over the tokens
    split across devices is another f32 rounding, never compared with one device's."""
    got = {"dx": grads[0], "dparams": grads[1]}
    assert_chain_matches(got, x, oracle_sublayers(params, weights), np.cos, f"{label} (seed {seed})")


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
    check_same_bits("jit tokens forward", out, want_out)
    assert collectives(forward.as_text()) == [], collectives(forward.as_text())
    backward = jax.jit(gradient).lower(xs, params, weights).compile()
    grads = backward(xs, params, weights)
    check_same_bits("jit tokens dx", grads[0], want_grads[0])
    check_loss_gradients("jit tokens", grads, x, params, weights, seed)
    found = collectives(backward.as_text())
    assert found and set(found) == {"all-reduce"}, found
    print("ok: jit, tokens sharded")

    # The same inside shard_map (each device its tokens; shard_map sums the parameter gradients).
    def mapped(x, params, weights):
        return jax.shard_map(
            lambda x: chain(x, params, weights), mesh=mesh, in_specs=P("tokens"), out_specs=P("tokens")
        )(x)

    check_same_bits("shard_map tokens forward", jax.jit(mapped)(xs, params, weights), want_out)
    mapped_grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(mapped(*a))), argnums=(0, 1)))(xs, params, weights)
    check_same_bits("shard_map tokens dx", mapped_grads[0], want_grads[0])
    check_loss_gradients("shard_map tokens", mapped_grads, x, params, weights, seed)
    print("ok: shard_map, tokens split")

    # Padded rows holding values: 3 batch rows over 2 devices, x entering as cos(x) (cos(0) = 1
    # where XLA pads with zeros) and a cotangent nonzero there: the parameter gradients of the V4.1
    # pre and boundary backwards match the float64 chain only while they mask the padded rows.
    xp = x[:3]
    target = jnp.cos(jnp.arange(D, dtype=jnp.float32))

    def padded_gradient(x, params, constrain):
        if constrain:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("tokens")))

        def padded_loss(x, params):
            return jnp.sum(jnp.square(chain(jnp.cos(x), params, None) - target))

        return jax.grad(padded_loss, argnums=(0, 1))(x, params)

    dx, dparams = jax.jit(padded_gradient, static_argnums=2)(xp, params[:2], True)
    inner = np.cos(np.asarray(xp, np.float64))  # the chain's input; dx = its gradient * -sin(x)
    sublayers = oracle_sublayers(params[:2], None)
    target64 = np.asarray(target, np.float64)

    def dout(out):
        return 2.0 * (out - target64)

    context = f"padded rows (seed {seed})"
    assert_chain_matches({"dparams": dparams}, inner, sublayers, dout, context)
    outer = -np.sin(np.asarray(xp, np.float64))
    want_dx = carried_chain_values(inner, sublayers, dout)[1] * outer
    perturbed = lambda rng: perturbed_chain_values(rng, inner, sublayers, dout)[1] * outer  # noqa: E731
    assert_matches("padded rows dx", dx, want_dx, 1e-5, perturbed, context)
    print("ok: padded rows with values")

    # D split (an elementwise branch): the split forms where the CPU has them, else the error
    # naming what works.
    split = _kernels.registered_targets("cpu") >= SPLIT_TARGETS
    xd = jax.device_put(x, NamedSharding(mesh, P(None, None, None, "tokens")))
    if split:
        check_loss_gradients("jit D split", jax.jit(gradient)(xd, params, None), x, params, None, seed)
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
        check_loss_gradients("shard_map D split", tp_gradient(xd, params), x, params, None, seed)
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

"""The TPU path under plain jax.jit with the tokens sharded over two CPU devices, against the
float64 oracle (conftest.assert_matches): ``python tpu_dispatch_cases.py SEED``, run by
test_tpu_dispatch.py in a subprocess (XLA_FLAGS must be set before JAX starts). Prints one "ok:" line per passing case.

Under mhc.tpu.testing.interpret_on_cpu the partitioning rules run the TPU kernels on each
device's tokens: the forward holds no collective, the gradient only the parameter gradients'
all-reduce; the same inside jax.shard_map; D split over the devices raises the mhc error (the
TPU has no split form).
"""

import functools
import os
import re
import sys

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "run via test_tpu_dispatch.py"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mhc.jax as mj  # noqa: E402
import mhc.tpu  # noqa: E402
from mhc.tpu.testing import interpret_on_cpu  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from conftest import assert_matches, random_params, round_by_one_unit, tanh_sublayer_values  # noqa: E402
from sharding_cases import collectives  # noqa: E402

CONFIG = mj.Config(n=4, sinkhorn_iters=5, pre_eps=0.1, post_scale=1.3)
SHAPE = (4, 6, 4, 130)  # [batch, seq, n, D]: 12 tokens per device


def compare(name, got, oracle, seed):
    """Each leaf of got against the same leaf of oracle() (float64) with the one accuracy rule
    (conftest.assert_matches); oracle(rng): on inputs moved by one f32 unit, noise=rng."""
    wanted = jax.tree.leaves(oracle())
    for index, (value, want) in enumerate(zip(jax.tree.leaves(got), wanted, strict=True)):

        def perturbed(rng, index=index):
            return jax.tree.leaves(oracle(rng))[index]

        assert_matches(f"{name}[{index}]", value, want, 1e-5, perturbed, f"(seed {seed})")


def main(seed: int) -> None:
    kx, kp, kw = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, SHAPE)
    params = random_params(kp, CONFIG, SHAPE[-1])
    w = jax.random.normal(kw, SHAPE)

    def forward(x, params):
        layer_in, ctx = mj.pre(x, params, CONFIG)
        return mj.post(jnp.tanh(layer_in), ctx)

    def gradient(x, params):
        return jax.grad(lambda x, params: jnp.sum(forward(x, params) * w), argnums=(0, 1))(x, params)

    def oracle_values(rng=None):
        move = (lambda v: v) if rng is None else functools.partial(round_by_one_unit, rng)
        return tanh_sublayer_values(move(x), move(params), CONFIG, 0.0, w, np.zeros(SHAPE[:-2] + SHAPE[-1:]), rng)

    def want(rng=None):
        return oracle_values(rng)["out"]

    def want_grads(rng=None):
        values = oracle_values(rng)
        return values["dx"], values["dparams"]

    mesh = Mesh(jax.devices()[:2], ("tokens",))
    x_tokens = jax.device_put(x, NamedSharding(mesh, P("tokens")))
    x_features = jax.device_put(x, NamedSharding(mesh, P(None, None, None, "tokens")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    with interpret_on_cpu():
        compiled = jax.jit(forward).lower(x_tokens, params).compile()
        # mhc's CPU kernels are custom calls with mhc_ targets; the TPU kernels run in the
        # interpreter here, named mhc_<operation>_tile<tile> but no custom call.
        cpu_kernels = set(re.findall(r'custom_call_target="(mhc_\w+)"', compiled.as_text())) - {"mhc_check_platform"}
        assert not cpu_kernels, f"CPU kernels on the TPU path: {sorted(cpu_kernels)}"
        assert collectives(compiled.as_text()) == [], collectives(compiled.as_text())
        got = compiled(x_tokens, params)
        assert got.sharding.spec == P("tokens"), got.sharding
        compare("forward", got, want, seed)
        print("ok: forward, tokens sharded, no collective")

        if {"mhc_pre_backward", "mhc_post_backward"} <= set(mhc.tpu.KERNELS):
            compiled = jax.jit(gradient).lower(x_tokens, params).compile()
            found = collectives(compiled.as_text())
            # One all-reduce of the parameter gradients (however XLA groups them), nothing x-sized.
            assert found and all(op == "all-reduce" for op, _ in found), found
            activation = re.compile(rf"\[{SHAPE[0] // 2},")
            assert not [shape for _, shape in found if activation.search(shape)], found
            compare("gradient", compiled(x_tokens, params), want_grads, seed)
            print("ok: gradient, tokens sharded, only the parameter all-reduce")
        else:
            try:
                jax.jit(gradient)(x_tokens, params)
            except NotImplementedError as error:
                assert "mhc.jax.pre: mhc has no kernel for platform 'tpu'" in str(error), error
            else:
                raise AssertionError("the gradient ran without a TPU pre backward kernel")
            print("ok: gradient raises the mhc error (no TPU pre backward kernel)")

        if {"mhc_pre_backward", "mhc_post_backward"} <= set(mhc.tpu.KERNELS):
            # The same inside jax.shard_map over the tokens (each device's kernels, check_vma on).
            by_tokens = jax.shard_map(forward, mesh=mesh, in_specs=(P("tokens"), P()), out_specs=P("tokens"))
            compare("shard_map forward", jax.jit(by_tokens)(x_tokens, params), want, seed)

            def shard_map_gradient(x, params):
                return jax.grad(lambda x, params: jnp.sum(by_tokens(x, params) * w), argnums=(0, 1))(x, params)

            compare("shard_map gradient", jax.jit(shard_map_gradient)(x_tokens, params), want_grads, seed)
            print("ok: shard_map over the tokens, forward and gradient")
        else:
            print("ok: shard_map skipped (no TPU pre backward kernel)")

        try:
            jax.jit(forward)(x_features, params)
        except Exception as error:  # raised inside XLA's partitioner callback, which wraps it
            message = "mhc.jax.pre: D (x's last axis) is split over devices (tensor parallelism)"
            assert message in str(error) and "platform 'tpu'" in str(error), error
            assert "Shard only the tokens" in str(error) and "use_kernel=False" in str(error), error
        else:
            raise AssertionError("D split over devices ran on the TPU path")
        print("ok: D split raises the mhc error")


if __name__ == "__main__":
    main(int(sys.argv[1]))

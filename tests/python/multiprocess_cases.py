"""One process of a 2-process run, as on a cluster: ``python multiprocess_cases.py PORT PROCESS SEED``.

Each process has 4 CPU devices; jax.distributed (coordinator on 127.0.0.1, CPU collectives
through gloo) joins them into one global mesh of 8. The same program as on one host (plain
jax.jit on sharded arrays) runs the kernels on each device's tokens and features; the forward and
the gradient match the float64 oracle (conftest.assert_matches). Started by test_sharding.py.
"""

import functools
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mhc.jax as mj  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from conftest import assert_matches, random_params, round_by_one_unit, tanh_sublayer_values  # noqa: E402


def global_array(value, sharding):
    """One global array from the same host value in every process (each takes its shards)."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def main(port: int, process: int, seed: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
    assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()

    config = mj.Config(n=4, sinkhorn_iters=3, pre_eps=0.1, post_scale=1.3)
    d = 32
    kx, kp, kw = jax.random.split(jax.random.key(seed), 3)
    x = np.asarray(jax.random.normal(kx, (8, 6, 4, d)))  # the same in both processes
    params = random_params(kp, config, d)
    w = np.asarray(jax.random.normal(kw, x.shape))

    def forward(x, params):
        layer_in, ctx = mj.pre(x, params, config)
        return mj.post(jnp.tanh(layer_in), ctx), layer_in

    def loss(x, params):
        out, layer_in = forward(x, params)
        return jnp.sum(out * w) + jnp.sum(jnp.exp(layer_in / 4))

    gradient = jax.grad(loss, argnums=(0, 1))

    # The float64 oracle, each result against it with the one accuracy rule (conftest.assert_matches).
    def oracle(rng=None):
        move = (lambda v: v) if rng is None else functools.partial(round_by_one_unit, rng)
        v = tanh_sublayer_values(move(x), move(params), config, 0.0, w, lambda li: np.exp(li / 4) / 4, rng)
        return (v["out"], v["layer_in"]), (v["dx"], v["dparams"])

    want = jax.tree.leaves(oracle())

    # The devices of both processes: (data=4 across the processes, tensor=2), then tokens only.
    layouts = {
        "tokens+D": ((4, 2), ("data", "tensor"), P("data", None, None, "tensor")),
        "batch+seq": ((4, 2), ("data", "seq"), P("data", "seq")),
    }
    for label, (shape, names, spec) in layouts.items():
        mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
        sharding = NamedSharding(mesh, spec)
        xs = global_array(x, sharding)
        ps = jax.tree.map(functools.partial(global_array, sharding=NamedSharding(mesh, P())), params)
        got = jax.jit(forward)(xs, ps), jax.jit(gradient)(xs, ps)
        assert got[0][0].sharding.spec == sharding.spec, f"{label}: output sharded {got[0][0].sharding.spec}"
        got = multihost_utils.process_allgather(got, tiled=True)
        for index, ((path, a), b) in enumerate(zip(jax.tree_util.tree_leaves_with_path(got), want, strict=True)):

            def perturbed(rng, index=index):
                return jax.tree.leaves(oracle(rng))[index]

            name = f"process {process} {label}: {jax.tree_util.keystr(path)}"
            assert_matches(name, np.asarray(a), b, 1e-5, perturbed, f"(seed {seed})")
        print(f"ok: process {process} {label}")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))

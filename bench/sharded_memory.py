"""Per-device memory of the mHC sublayer (pre -> tanh -> post) under plain ``jax.jit`` with x's
tokens sharded over 8 virtual CPU devices: XLA's memory analysis of the compiled forward and
forward+backward, kernel path and plain path (docs/performance.md, issue: automatic sharding).

    .venv/bin/python bench/sharded_memory.py
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mhc.jax as mj  # noqa: E402


def main():
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    config, d = mj.Config(n=4), 1024
    x = jax.device_put(jnp.ones((8, 512, config.n, d)), NamedSharding(mesh, P("data")))
    params = mj.init_params(jax.random.key(0), config, d)
    print(f"x {x.shape} f32, tokens over {mesh.shape['data']} devices; per device, MiB")
    for use_kernel in (True, False):

        def forward(x, p, use_kernel=use_kernel):
            layer_in, ctx = mj.pre(x, p, config, use_kernel=use_kernel)
            return mj.post(jnp.tanh(layer_in), ctx)

        def loss(p, x, forward=forward):
            return forward(x, p).sum()

        for name, fn, args in (("forward", forward, (x, params)), ("forward+backward", jax.grad(loss), (params, x))):
            memory = jax.jit(fn).lower(*args).compile().memory_analysis()
            path = "kernel" if use_kernel else "plain"
            temp, out = memory.temp_size_in_bytes / 2**20, memory.output_size_in_bytes / 2**20
            print(f"{path:6s} {name:17s} temp {temp:7.1f}  output {out:7.1f}")


if __name__ == "__main__":
    main()

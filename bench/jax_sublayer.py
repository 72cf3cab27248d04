"""Times one mHC sublayer (pre -> identity branch -> post) under jax.jit, kernel path vs the plain
JAX path, forward and forward+backward, side by side in one run. Medians of --repeats runs.

    .venv/bin/python bench/jax_sublayer.py --tokens 4096 --n 4 --dim 1024
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import mhc.jax as mj


def median_seconds(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--mix", default="sinkhorn")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = mj.Config(n=args.n, mix=args.mix)
    params = mj.init_params(jax.random.key(0), config, args.dim)
    params = params._replace(alpha=jnp.ones(3), bias=jax.random.normal(jax.random.key(1), params.bias.shape))
    print(f"T={args.tokens} n={args.n} D={args.dim} mix={args.mix} devices={jax.devices()}")
    print(f"{'dtype':6} {'pass':14} {'kernel ms':>10} {'plain ms':>10} {'speedup':>8}")
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(jax.random.key(2), (args.tokens, args.n, args.dim)).astype(dtype)

        def forward(x, params, use_kernel):
            layer_in, ctx = mj.pre(x, params, config, use_kernel=use_kernel)
            return mj.post(layer_in, ctx)

        def loss(x, params, use_kernel):
            return jnp.sum(forward(x, params, use_kernel).astype(jnp.float32))

        passes = {
            "forward": jax.jit(forward, static_argnums=2),
            "forward+back": jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2),
        }
        for name, fn in passes.items():
            kernel = median_seconds(fn, x, params, True, repeats=args.repeats)
            plain = median_seconds(fn, x, params, False, repeats=args.repeats)
            print(f"{jnp.dtype(dtype).name:6} {name:14} {kernel * 1e3:10.1f} {plain * 1e3:10.1f} {plain / kernel:8.2f}")


if __name__ == "__main__":
    main()

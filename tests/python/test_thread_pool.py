"""Whose threads the CPU kernels use inside JAX (src/cpu/thread_pool.h): by default XLA's own
intra-op pool, lent to each FFI call, with mhc's pool kept for the C++ API and for measuring. Both
give the same bits as one thread; mhc starts no threads of its own until its pool is used; an idle
process spends no CPU in either pool."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc
import mhc.jax as mj
from mhc import _mhc_cpu


def _sublayer_outputs_and_gradients(tokens, dim, dtype):
    config = mj.Config(n=4)
    params = mj.init_params(jax.random.key(0), config, dim)
    x = jax.random.normal(jax.random.key(1), (tokens, 4, dim), jnp.float32).astype(dtype)

    def sublayer(x, params):
        layer_in, ctx = mj.pre(x, params, config)
        return mj.post(jnp.tanh(layer_in), ctx)

    out, vjp = jax.vjp(sublayer, x, params)
    return jax.tree.leaves((out, vjp(jnp.cos(out.astype(jnp.float32)).astype(dtype))))


@pytest.mark.parametrize(
    "tokens, dim, dtype",
    [(300, 1024, jnp.float32), (300, 1024, jnp.bfloat16), (3, 4096, jnp.float32)],
)
def test_xla_pool_mhc_pool_and_one_thread_give_the_same_bits(tokens, dim, dtype):
    # T = 300 at D = 1024: several token tiles in every operation; T = 3 at D = 4096: the
    # projection's rows split over threads.
    assert _mhc_cpu.uses_xla_thread_pool()
    results = {}
    try:
        for label, xla_pool, threads in (("xla", True, 0), ("mhc", False, 0), ("one thread", True, 1)):
            _mhc_cpu.use_xla_thread_pool(xla_pool)
            mhc.set_num_threads(threads)
            results[label] = [np.asarray(leaf) for leaf in _sublayer_outputs_and_gradients(tokens, dim, dtype)]
    finally:
        _mhc_cpu.use_xla_thread_pool(True)
        mhc.set_num_threads(0)
    for label in ("mhc", "one thread"):
        for got, want in zip(results[label], results["xla"], strict=True):
            assert np.array_equal(got, want), label


PROBE = """
import os, time
import jax, jax.numpy as jnp
import mhc.jax as mj
from mhc import _mhc_cpu

def threads():
    return len(os.listdir("/proc/self/task"))

def idle_cpu_seconds():
    time.sleep(0.2)  # past every spin
    start = time.process_time()
    time.sleep(0.5)
    return time.process_time() - start

config = mj.Config(n=4)
params = mj.init_params(jax.random.key(0), config, 1024)
x = jax.random.normal(jax.random.key(1), (256, 4, 1024), jnp.float32)
step = jax.jit(lambda x: mj.post(*mj.pre(x, params, config)))
jax.block_until_ready(step(x))  # compiles; XLA starts its threads
before = threads()
for _ in range(3):
    jax.block_until_ready(step(x))
on_xla = threads()
xla_idle = idle_cpu_seconds()
_mhc_cpu.use_xla_thread_pool(False)
for _ in range(3):
    jax.block_until_ready(step(x))
print(on_xla - before, threads() - before, xla_idle, idle_cpu_seconds())
"""


def test_mhc_starts_no_threads_on_xla_pool_and_idle_pools_cost_no_cpu():
    env = dict(os.environ, MHC_NUM_THREADS="4")
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    added_on_xla, added_on_mhc, xla_idle, mhc_idle = result.stdout.split()
    assert int(added_on_xla) == 0  # the calls ran on XLA's threads and the caller's
    assert int(added_on_mhc) == 3  # mhc's pool started MHC_NUM_THREADS - 1 workers when first used
    # Idle, both pools sleep: well under 1% of a core over half a second.
    assert float(xla_idle) < 0.005 and float(mhc_idle) < 0.005, (xla_idle, mhc_idle)

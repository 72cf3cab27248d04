"""The allocator setting `import mhc.jax` makes (docs/jax.md: "Large activations on the CPU"): on by
default under glibc, off with MHC_KEEP_MALLOC_DEFAULTS=1, and outputs are still correct either way."""

import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import jax, jax.numpy as jnp, numpy as np
import mhc.jax as mj
from mhc import _ffi
config = mj.Config(n=4)
params = mj.init_params(jax.random.key(0), config, 4096)
x = jax.random.normal(jax.random.key(1), (640, 4, 4096), jnp.float32)  # 40 MiB: over the mmap threshold
layer_in, ctx = mj.pre(x, params, config)
out = mj.post(layer_in, ctx)
ref_in, ref_ctx = mj.pre(x, params, config, use_kernel=False)
ref = mj.post(ref_in, ref_ctx)
assert np.allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
print(_ffi.MALLOC_TUNED)
"""


def _tuned(env_value):
    env = dict(os.environ)
    env.pop("MHC_KEEP_MALLOC_DEFAULTS", None)
    if env_value is not None:
        env["MHC_KEEP_MALLOC_DEFAULTS"] = env_value
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_large_blocks_stay_in_the_heap_by_default_and_the_opt_out_works():
    assert _tuned(None) == "True"
    assert _tuned("1") == "False"

"""The allocator (mhc.tune_allocator, docs/jax.md "Large activations on the CPU"): importing mhc and
running its kernels leaves glibc's malloc settings alone; the explicit call makes large blocks come
from the heap and stay there; outputs are correct either way."""

import os
import platform
import subprocess
import sys

import pytest

# glibc's mallinfo2().hblks counts the blocks it serves by mmap: a 64 MiB malloc is one of them
# under the default settings (the dynamic mmap threshold never passes 32 MiB) and none once mmap
# is off. Each probe prints whether such a block was mapped before and after tune_allocator().
PROBE = """
import ctypes, sys
sys.path.insert(0, sys.argv[2])  # tests/python: conftest's accuracy rule and numpy_reference
import jax, jax.numpy as jnp, numpy as np
import mhc, mhc.jax as mj
import numpy_reference
from conftest import assert_matches, round_by_one_unit

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                     "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def large_block_is_mapped():
    before = libc.mallinfo2().hblks
    block = libc.malloc(64 << 20)
    mapped = libc.mallinfo2().hblks > before
    libc.free(block)
    return mapped

def sublayer_matches_reference():
    # The kernels' out against the float64 oracle with the one accuracy rule (the kernels' own
    # layer_in as the layer_out); a failure is printed and answers False.
    config = mj.Config(n=4)
    params = mj.init_params(jax.random.key(0), config, 2048)
    x = jax.random.normal(jax.random.key(1), (640, 4, 2048), jnp.float32)  # 20 MiB in, 20 MiB out
    layer_in, ctx = mj.pre(x, params, config)
    out = mj.post(layer_in, ctx)

    def perturbed(rng):
        moved = [round_by_one_unit(rng, value) for value in (x, layer_in, params)]
        return numpy_reference.forward(*moved, config, noise=rng)[1]

    try:
        assert_matches("out", out, numpy_reference.forward(x, layer_in, params, config)[1], 1e-5, perturbed)
    except AssertionError as error:
        print(error, file=sys.stderr)
        return False
    return True

print("default", large_block_is_mapped(), sublayer_matches_reference())
if sys.argv[1] == "tune":
    print("tuned", mhc.tune_allocator(), large_block_is_mapped(), sublayer_matches_reference())
"""


def _probe(mode):
    result = subprocess.run(
        [sys.executable, "-c", PROBE, mode, os.path.dirname(os.path.abspath(__file__))],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.slow  # a fresh JAX process per allocator mode: 14 s of CPU (pyproject.toml, markers)
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_import_leaves_malloc_alone_and_tune_allocator_keeps_large_blocks_in_the_heap():
    # Importing mhc.jax and running pre and post: glibc still maps the large block.
    assert _probe("import") == ["default", "True", "True"]
    # The explicit call applies, and from then on large blocks come from the heap.
    assert _probe("tune") == ["default", "True", "True", "tuned", "True", "False", "True"]

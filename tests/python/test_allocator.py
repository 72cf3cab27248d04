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


def _advised_onto_huge_pages(address: int) -> bool:
    """Whether /proc/self/smaps lists the mapping holding ``address`` with VM_HUGEPAGE ("hg"), which
    madvise(MADV_HUGEPAGE) sets whether or not huge pages are free at the time."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                begin, end = (int(bound, 16) for bound in first.split("-"))
                inside = begin <= address < end
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    return False


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="no transparent huge pages"
)
def test_large_outputs_are_advised_onto_huge_pages_before_the_kernel_writes_them():
    # The output in a fresh anonymous mapping of our own (nothing advised it before); run() shares
    # the path into the kernels with the XLA handlers (cpu_handlers.cc, call_declared).
    import mmap

    import numpy as np

    from mhc import _mhc_cpu

    tokens, n, dim, huge = 128, 4, 4096, 2 << 20
    rng = np.random.default_rng()
    x = rng.standard_normal((tokens, n, dim)).astype(np.float32)
    layer_out = rng.standard_normal((tokens, dim)).astype(np.float32)
    h_post = rng.random((tokens, n)).astype(np.float32)
    h_res = (rng.random((tokens, n, n)) / n).astype(np.float32)
    mapping = mmap.mmap(-1, x.nbytes + huge)
    out = np.frombuffer(mapping, np.float32, x.size).reshape(x.shape)
    address = out.ctypes.data
    first_whole_page = -(-address // huge) * huge
    assert not _advised_onto_huge_pages(first_whole_page)
    _mhc_cpu.run("post_forward", [x, layer_out, h_post, h_res], [out], n, 0, 20, 1e-6, 1e-6, 0.0, 2.0, 1)
    assert _advised_onto_huge_pages(first_whole_page)
    assert not _advised_onto_huge_pages(address + x.nbytes + huge // 2)  # past the output
    # The kernel's result is untouched by the advice: out = h_res^T x + h_post layer_out per token.
    want = np.einsum("tij,tid->tjd", h_res, x) + h_post[:, :, None] * layer_out[:, None, :]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    del out
    mapping.close()

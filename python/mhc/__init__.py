"""mhc: fused Manifold-Constrained Hyper-Connections for JAX and PyTorch.

Submodules: ``mhc.jax`` (functional API, custom VJP over the C++ kernels, plain-JAX reference),
``mhc.flax`` (a Flax NNX layer), ``mhc.torch`` (the same API as torch custom ops; imports no jax;
``mhc.torch.hf``: the Hugging Face DeepSeek-V4 drop-in), ``mhc.bench`` (``python -m mhc.bench``).

``set_num_threads(k)`` / ``num_threads()``: at most k threads per CPU kernel call
(``MHC_NUM_THREADS`` sets the default, else every hardware thread; ``k < 1`` restores it). Inside
JAX the helper threads are XLA's own intra-op threads, lent to each call, so mhc starts no
threads of its own there (and uses at most as many as XLA's pool has); the C++ API runs on mhc's
pool, whose workers spin at most 50 us (``MHC_SPIN_US``) after a job before they sleep.

``tune_allocator()``: an explicit, process-wide opt-in that makes large CPU buffers cheaper to
allocate; importing mhc changes nothing in the process's allocator.
"""

from importlib.metadata import version as _distribution_version

__all__ = ["num_threads", "set_num_threads", "tune_allocator"]
# The installed distribution's version, which the build took from include/mhc/version.h.
__version__ = _distribution_version("mhc")


def __getattr__(name: str):
    """num_threads and set_num_threads, from the C++ extension on first use: importing mhc (and
    so mhc._config or mhc.tpu) does not need the compiled extension."""
    if name in ("num_threads", "set_num_threads"):
        from mhc import _mhc_cpu

        return getattr(_mhc_cpu, name)
    raise AttributeError(f"module 'mhc' has no attribute {name!r}")


def tune_allocator() -> bool:
    """Tells glibc's malloc to serve large blocks from the heap and keep freed ones for reuse
    (``mallopt(M_MMAP_MAX, 0)``, ``mallopt(M_TRIM_THRESHOLD, 1 GiB)``), for the whole process.

    Why: XLA allocates every output afresh, and glibc maps each block over 32 MiB anew and frees
    it back to the system, so every call first-touches its large outputs page by page; that costs
    about as much as the post kernels themselves at T = 8192, D = 4096. The price: the heap keeps
    its high-water mark, so the resident size after a peak stays at the peak. ``mhc.bench`` measures
    with and without it; a program that owns its process may call it, a library importing mhc
    should leave the choice to the application.

    Returns True where it applied (glibc), False elsewhere (nothing changed). Call it once, early;
    it cannot be undone within the process.
    """
    from mhc import _mhc_cpu

    return bool(_mhc_cpu.keep_large_blocks_in_heap())

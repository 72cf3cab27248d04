"""mhc: fused Manifold-Constrained Hyper-Connections for JAX.

Submodules: ``mhc.jax`` (functional API, custom VJP over the C++ kernels, plain-JAX reference),
``mhc.flax`` (a Flax NNX layer), ``mhc.bench`` (``python -m mhc.bench``).

``set_num_threads(k)`` / ``num_threads()``: the CPU kernels' thread pool (its own, not XLA's;
``MHC_NUM_THREADS`` sets the default, else every hardware thread; ``k < 1`` restores it).
"""

from importlib.metadata import version as _distribution_version

from mhc._mhc_cpu import num_threads, set_num_threads

__all__ = ["num_threads", "set_num_threads"]
# The installed distribution's version, which the build took from include/mhc/version.h.
__version__ = _distribution_version("mhc")

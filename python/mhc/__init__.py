"""mhc: fused Manifold-Constrained Hyper-Connections for JAX.

Submodules: ``mhc.jax`` (functional API, custom VJP over the C++ kernels, plain-JAX reference),
``mhc.flax`` (a Flax NNX layer).
"""

__version__ = "0.1.0"

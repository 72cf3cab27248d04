"""Registers the C++ XLA FFI handlers with JAX, once per process, at import.

The CPU handlers always; the CUDA handlers (the _mhc_cuda module, built where nvcc was found)
under the same target names for platform "CUDA", so mhc.jax runs on GPU arrays unchanged.
"""

import jax

from mhc import _mhc_cpu

_TARGETS = _mhc_cpu.registrations()
for _name, _capsule in _TARGETS.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

try:
    from mhc import _mhc_cuda
except ImportError:  # built without CUDA
    _mhc_cuda = None

CUDA_TARGETS: tuple = ()
if _mhc_cuda is not None:
    _CUDA = _mhc_cuda.registrations()
    for _name, _capsule in _CUDA.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
    CUDA_TARGETS = tuple(sorted(_CUDA))

TARGET_NAMES = tuple(sorted(_TARGETS))

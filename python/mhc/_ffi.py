"""Registers the C++ XLA FFI handlers with JAX, once per process, at import."""

import jax

from mhc import _mhc_cpu

_TARGETS = _mhc_cpu.registrations()
for _name, _capsule in _TARGETS.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

# A CUDA module, when built, registers the same names for platform="CUDA" here.
TARGET_NAMES = tuple(sorted(_TARGETS))

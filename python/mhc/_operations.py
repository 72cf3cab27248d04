"""The declared operations (src/ffi/operations.h) as Python sees them, and their output rules.

``OPERATIONS`` maps each operation's name (``pre_forward``; FFI target ``mhc_pre_forward``) to
its declaration from ``mhc._mhc_cpu.operations()``: ``inputs`` and ``outputs`` (argument names in
order), ``output_shapes`` and ``output_dtypes`` (one rule per output), ``platforms``.
``output_specs`` evaluates the rules for given inputs, so every binding (the JAX result types,
torch's fake implementations, preallocated outputs for ``mhc._mhc_cpu.run``) allocates what the
C++ operation writes from the one declaration.
"""

from __future__ import annotations

from collections.abc import Sequence

from mhc import _mhc_cpu

OPERATIONS: dict[str, dict] = {operation["name"]: operation for operation in _mhc_cpu.operations()}


def _dims(by_name: dict) -> dict[str, int]:
    """The shape symbols of the rules: T, n, D from x [T, n, D]; N, the projection's width (2n + n^2
    with Sinkhorn, 2n + n! with permutations), from phi [M, N] where the operation takes phi."""
    t, n, d = (int(size) for size in by_name["x"].shape)
    dims = {"T": t, "n": n, "D": d}
    if "phi" in by_name:
        dims["N"] = int(by_name["phi"].shape[-1])
    return dims


def _size(term: str, dims: dict[str, int]) -> int:
    """One dimension of a "[...]" rule: a sum of symbols and integers, e.g. "N + 1"."""
    return sum(int(part) if part.strip().isdigit() else dims[part.strip()] for part in term.split("+"))


def output_specs(operation: dict, inputs: Sequence, float32) -> list[tuple[tuple[int, ...], object]]:
    """Each output's (shape, dtype) for ``inputs`` (arrays with .shape and .dtype, in the declared
    order), with ``float32`` the caller's float32 dtype (np.float32, jnp.float32, torch.float32)
    for the rule "f32"; "dtype of <input>" is that input's own dtype object."""
    names = operation["inputs"]
    if len(inputs) != len(names):
        raise ValueError(f"mhc::{operation['name']}: inputs: expected {len(names)} arrays, got {len(inputs)}")
    by_name = dict(zip(names, inputs, strict=True))
    dims = _dims(by_name)
    specs = []
    for shape_rule, dtype_rule in zip(operation["output_shapes"], operation["output_dtypes"], strict=True):
        if shape_rule.startswith("shape of "):
            shape = tuple(int(size) for size in by_name[shape_rule.removeprefix("shape of ")].shape)
        else:
            shape = tuple(_size(term, dims) for term in shape_rule.strip("[]").split(","))
        dtype = float32 if dtype_rule == "f32" else by_name[dtype_rule.removeprefix("dtype of ")].dtype
        specs.append((shape, dtype))
    return specs

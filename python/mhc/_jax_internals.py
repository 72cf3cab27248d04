"""The private JAX APIs mhc uses, in one place (no other module imports ``jax._src``).

JAX has no public form of these in the supported range (pyproject.toml: jax >= 0.10, < 0.13; CI
tests 0.10): a scoped switch of shard_map's varying-axes check, and a config state that enters
the jit and trace cache keys. Each is looked up once, here, and a JAX without it fails at import
with a message that names what is missing, instead of deep inside a trace.
tests/python/test_jax_internals.py holds the installed JAX to what mhc uses of each.
"""

from __future__ import annotations

import jax
from jax._src import config as _config


def _require(name: str):
    try:
        return getattr(_config, name)
    except AttributeError as error:
        raise ImportError(
            f"mhc needs jax._src.config.{name} (present in jax 0.10 to 0.12); jax {jax.__version__} has "
            "none: install a jax in mhc's supported range (pyproject.toml)"
        ) from error


# shard_map's check of the varying mesh axes (check_vma): `.value` reads it, `check_vma(False)`
# turns it off for a block. mhc.jax reads it (which axes a value varies over) and lowers the TPU
# kernels inside shard_map without it (pallas_call's out_shape carries no varying axes).
check_vma = _require("_check_vma")
# A config state of one's own, optionally in the jit and trace cache keys (mhc.tpu.testing's
# interpret switch).
State = _require("State")

"""For tests only: run mhc.jax's TPU dispatch on a machine without a TPU.

``interpret_on_cpu()`` is a context manager under which the CPU lowering dispatches exactly as a
TPU's would: every operation called with ``use_kernel=True`` runs the kernel mhc.tpu.KERNELS has
for it in Pallas's interpreter, and an operation without a TPU kernel raises the TPU's
NotImplementedError at lowering instead of running the CPU kernels. It is off unless entered, and
it is not a way to run anything on a TPU or to speed up a CPU: the interpreter is orders of
magnitude slower than the CPU kernels. It checks, without a TPU, that the dispatch, the custom
VJPs and the partitioning rules drive the TPU kernels correctly; speed and hardware numerics stay
unverified.

The interpreter is Pallas's plain one (``interpret=True``: the kernels' grid, BlockSpecs and TPU
primitives, as ordinary XLA operations), not ``pltpu.InterpretParams``: the dispatch runs every
kernel inside a custom_partitioning call, whose lowering cannot carry the ordered host callbacks
of that mode. So the checks the plain interpreter lacks (race detection, out-of-bounds blocks,
NaN-filled uninitialized memory) are made per kernel in tests/python/test_tpu_kernels.py.

The switch is part of JAX's jit and trace cache keys, so no function compiled outside it runs
inside it, nor the reverse, and the caches are kept (clearing them on entry and exit, as before,
made every later test of a pytest worker compile again). It is one process-wide setting (XLA calls
the partitioning rules back while it compiles, outside any thread-local context): do not enter it
in one thread while another compiles mhc code.
"""

from __future__ import annotations

import contextlib

from mhc._jax_internals import State  # the switch in JAX's jit and trace cache keys

# The switch, read by mhc.jax's dispatch (never on by default): while it holds Pallas interpret
# parameters, the CPU lowering dispatches as a TPU would, to mhc.tpu.KERNELS run in the TPU
# interpreter with these parameters, and raises the TPU's errors for what has no TPU kernel. It
# lives here, not in mhc.jax, so that mhc.tpu never imports mhc.jax (mhc.jax imports mhc.tpu).
# A module global, not a thread-local: XLA calls the partitioning rules back while it compiles.
interpret_params = None
# The same value as a JAX config state in the jit and trace cache keys (the global value, which
# every thread reads): a function compiled with the switch off is traced and compiled again with
# it on, and the reverse, so neither runs the other's kernels; JAX keeps both compilations, and
# nothing else is recompiled (tests/python/test_tpu_dispatch.py holds it to both directions).
_interpret_params_key = State(
    "mhc_interpret_on_cpu",
    None,
    "mhc.tpu.testing.interpret_on_cpu's switch, in JAX's cache keys",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


def _set_interpret_params(interpret) -> None:
    global interpret_params
    interpret_params = interpret
    _interpret_params_key.set_global(interpret)


@contextlib.contextmanager
def interpret_on_cpu():
    """Test only: the CPU lowering runs the TPU kernels in Pallas's interpreter (module docstring)."""
    if interpret_params is not None:
        raise RuntimeError("interpret_on_cpu: already on (it does not nest)")
    _set_interpret_params(True)
    try:
        yield
    finally:
        _set_interpret_params(None)

"""The private JAX APIs mhc uses (mhc._jax_internals, the one module that imports jax._src) hold
for the installed JAX: what mhc reads and does with each, so a JAX that changes them fails here
and not deep in a trace."""

import jax
import pytest

from mhc import _jax_internals


def test_check_vma_reads_and_turns_off_for_a_block():
    before = _jax_internals.check_vma.value
    assert isinstance(before, bool)
    with _jax_internals.check_vma(False):
        assert _jax_internals.check_vma.value is False
    assert _jax_internals.check_vma.value == before


def test_a_state_enters_the_jit_cache_key():
    state = _jax_internals.State(
        "mhc_test_jax_internals_key", None, "test_jax_internals", include_in_jit_key=True, include_in_trace_context=True
    )
    traces = []

    @jax.jit
    def traced(x):
        traces.append(state.value)
        return x + 1

    try:
        traced(1.0)
        traced(1.0)
        state.set_global("on")
        traced(1.0)
    finally:
        state.set_global(None)
    assert traces == [None, "on"], "a change of the state must retrace, and only then"


def test_a_missing_internal_names_itself():
    with pytest.raises(ImportError, match=r"jax\._src\.config\.no_such_state .*supported range"):
        _jax_internals._require("no_such_state")

"""DeepSeek-V4's head on the TPU (mhc.tpu.head_forward, head_backward), checked without a TPU as
test_tpu_kernels.py checks the other kernels: in TPU interpret mode with race detection against
the float64 reference (numpy_reference.head_values; the gates from numpy_reference's forward with
the head put in the pre layout, as the C++ head does), lowered to Mosaic at every token tile, and
the MXU precision of every matmul read back from the lowered module."""

import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
import mhc.tpu
import numpy_reference
from conftest import assert_mixed_in_f32_and_rounded_once, round_by_one_unit
from test_head import random_head
from test_tpu_kernels import (
    CUSTOM,
    INTERPRET,
    ONE_TOKEN,
    TILE,
    _assert_a_token_alone_is_bitwise_equal,
    _case_id,
    _export,
    _mosaic_modules,
    _no_races,
    assert_outputs_match,
    assert_pre_forward_matmuls_f32_accurate,
)
from test_tpu_pre_backward import assert_pre_backward_matmuls_f32_accurate

# The TPU kernels in Pallas's interpreter: slow (pyproject.toml, markers); make check skips this file.
pytestmark = pytest.mark.slow

# (n, D, T, dtype, config scalars).
# One shape set: a single token is the three-tile case's token alone (batch invariance).
CASES = [
    (4, 130, 300, jnp.float32, {}),  # three token tiles: also batch invariance
    (3, 1, 37, jnp.bfloat16, {}),
    (8, 1, 37, jnp.float32, CUSTOM),
    (1, 600, 37, jnp.float32, CUSTOM),  # Dp = 640: the backward's five feature chunks
    (4, 1024, 37, jnp.bfloat16, CUSTOM),
    (3, 130, 0, jnp.float32, {}),
]
NAMES = ("out", "gates", "dx", "dfn", "dbase", "dscale")


def _oracle(config, x, head, dout, noise=None):
    """(out, gates, dx, dfn, dbase, dscale) in float64: numpy_reference.head_values, and the gates
    as the pre forward's h_pre with phi = [fn^T | 0], alpha = (scale, 0, 0), bias = [base | 0] and
    no norm weight (spec: Head, steps 1-4 with only the pre columns)."""
    n, d = x.shape[1:]
    fn, base, scale = (np.asarray(p, np.float64) for p in head)
    pre = mj.Config(n=n, rms_eps=config.rms_eps, pre_eps=config.pre_eps)
    zeros = np.zeros(pre.projection_width - n)
    params = mj.Params(
        np.ones(n * d),
        np.concatenate([fn.T, np.zeros((n * d, len(zeros)))], axis=1),
        np.array([scale[0], 0.0, 0.0]),
        np.concatenate([base, zeros]),
    )
    gates = numpy_reference._forward(x, np.zeros((len(x), d)), params, pre, noise)["h_pre"]
    out, dx, dfn, dbase, dscale = numpy_reference.head_values(x, head, config, dout, noise)
    return out, gates, dx, dfn, dbase, dscale


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_head_forward_and_backward_match_reference(seed, case):
    n, d, t, dtype, scalars = case
    config = mj.Config(n=n, **scalars)
    rng = np.random.default_rng(seed)
    head = random_head(rng, n, d)
    x = rng.standard_normal((t, n, d))
    if t > 1:
        x[t // 3] = 0.0  # an all-zero token: r = 1 / sqrt(rms_eps) (not ONE_TOKEN, checked alone below)
    x = jnp.asarray(x, dtype)
    dout = jnp.asarray(rng.standard_normal((t, d)), dtype)
    got = mhc.tpu.head_forward(config, x, head, tile=TILE, interpret=INTERPRET)
    _no_races()
    got += mhc.tpu.head_backward(config, dout, x, head, tile=TILE, interpret=INTERPRET)
    _no_races()
    as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    x64, dout64 = as64(x), as64(dout)
    want = _oracle(config, x64, head, dout64)
    dtypes = (dtype, jnp.float32, dtype, jnp.float32, jnp.float32, jnp.float32)
    perturbed = lambda rng, i: _oracle(config, *(round_by_one_unit(rng, v) for v in (x64, head, dout64)), rng)[i]  # noqa: E731
    assert_outputs_match(NAMES, got, want, dtypes, perturbed, seed)
    if dtype == jnp.bfloat16:
        # out mixes x with the kernel's own f32 gates (spec: Accuracy, the precision policy).
        assert_mixed_in_f32_and_rounded_once("out", got[0], got[1], x, f"(seed {seed})")
    if t > 2 * TILE:
        # Batch invariance: out, gates and dx of a token alone, bit for bit.
        alone = mhc.tpu.head_forward(config, x[ONE_TOKEN], head, tile=TILE, interpret=INTERPRET)
        alone += mhc.tpu.head_backward(config, dout[ONE_TOKEN], x[ONE_TOKEN], head, tile=TILE, interpret=INTERPRET)[:1]
        _assert_a_token_alone_is_bitwise_equal(("out", "gates", "dx"), got[:3], alone)
        _no_races()


def _arguments(n, d, t, dtype):
    head = random_head(np.random.default_rng(0), n, d)
    return jnp.zeros((t, d), dtype), jnp.zeros((t, n, d), dtype), head


def test_head_dots_carry_full_f32_precision():
    """Every matmul of both kernels is f32-accurate on the MXU: the forward's as the pre forward's
    (assert_pre_forward_matmuls_f32_accurate: the streamed projection, the selection, the sum of
    squares; no table); the backward's as the pre backward's
    (assert_pre_backward_matmuls_f32_accurate, the gate rows only)."""
    config = mj.Config(n=3, mix="sinkhorn")
    dout, x, head = _arguments(3, 130, 37, jnp.bfloat16)
    (forward,) = _mosaic_modules(_export(lambda x, h: mhc.tpu.head_forward(config, x, h), x, head))
    assert_pre_forward_matmuls_f32_accurate(forward, config, jnp.dtype(jnp.bfloat16), padded=256)
    (backward,) = _mosaic_modules(_export(lambda *a: mhc.tpu.head_backward(config, *a), dout, x, head))
    assert_pre_backward_matmuls_f32_accurate(backward, config.n, mhc.tpu._layout.group_rows(config.n))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_tile_lowers_for_tpu(dtype):
    """Every token tile the wrappers can choose passes the Pallas -> Mosaic lowering, at a D that
    pads and takes two feature chunks in the backward and a ragged T."""
    config = mj.Config(n=4)
    dout, x, head = _arguments(4, 600, 300, dtype)
    for tile in mhc.tpu.TOKEN_TILES:
        forward = lambda x, h, tile=tile: mhc.tpu.head_forward(config, x, h, tile=tile)  # noqa: E731
        backward = lambda *a, tile=tile: mhc.tpu.head_backward(config, *a, tile=tile)  # noqa: E731
        assert "tpu_custom_call" in _export(forward, x, head)
        assert "tpu_custom_call" in _export(backward, dout, x, head)


def test_tiles_follow_the_vmem_plan():
    config = mj.Config(n=4)
    assert mhc.tpu._head.forward_tile(config, 130, jnp.float32) == max(mhc.tpu.TOKEN_TILES)
    assert mhc.tpu._head.backward_tile(config, 7168, jnp.bfloat16) in mhc.tpu.TOKEN_TILES
    with pytest.raises(ValueError, match=r"mhc.tpu.head_backward: .*MiB of VMEM, over the .*MiB budget"):
        mhc.tpu._head.backward_tile(mj.Config(n=8), 65536, jnp.float32)


def test_bad_arguments_are_named():
    config = mj.Config(n=4)
    dout, x, head = _arguments(4, 8, 5, jnp.float32)
    with pytest.raises(ValueError, match=r"head_forward: x: expected \[T, n = 4, D\]"):
        mhc.tpu.head_forward(config, jnp.zeros((5, 3, 8)), head)
    with pytest.raises(ValueError, match=r"head_forward: x: expected float32 or bfloat16"):
        mhc.tpu.head_forward(config, x.astype(jnp.float16), head)
    with pytest.raises(ValueError, match=r"head_forward: head.fn: expected shape \(4, 32\)"):
        mhc.tpu.head_forward(config, x, head._replace(fn=head.fn[:, :30]))
    with pytest.raises(ValueError, match=r"head_backward: head.scale: expected shape \(1,\)"):
        mhc.tpu.head_backward(config, dout, x, head._replace(scale=np.ones(2, np.float32)))
    with pytest.raises(ValueError, match=r"head_backward: dout: expected shape \(5, 8\) and dtype float32"):
        mhc.tpu.head_backward(config, dout.astype(jnp.bfloat16), x, head)
    with pytest.raises(ValueError, match=r"tile: expected one of"):
        mhc.tpu.head_forward(config, x, head, tile=100)

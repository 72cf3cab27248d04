"""The TPU kernels of the fused boundary (mhc.tpu.boundary_forward, boundary_backward), checked
without a TPU (docs/tpu.md): in TPU interpret mode with race detection against the float64
reference, bit for bit against the separate post and pre kernels, batch invariant, and exported
for TPU at every token tile. Interpret mode costs ~50 ms per grid step and 1-3 s of tracing per shape: a sample of the
CPU suite's families, each case a few grid steps."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import mhc.jax as mj
import mhc.tpu
import numpy_reference
from conftest import (
    assert_mixed_in_f32_and_rounded_once,
    assert_post_mixed_in_f32_and_rounded_once,
    random_numpy_params,
    round_by_one_unit,
)
from test_tpu_kernels import (
    CUSTOM,
    INTERPRET,
    _case_id,
    _export,
    _mosaic_modules,
    _no_races,
    _post_problem,
    _tolerance,
    assert_outputs_match,
    assert_pre_forward_matmuls_f32_accurate,
)
from test_tpu_pre_backward import _oracle as _pre_backward_oracle
from test_tpu_pre_backward import assert_pre_backward_matmuls_f32_accurate

# The TPU kernels in Pallas's interpreter: slow (pyproject.toml, markers); make check skips this file.
pytestmark = pytest.mark.slow

# (n, D, T, mix, x dtype, layer_out dtype, config scalars, token tile): a sample of the product,
# with a ragged last tile in each case of more than one token.
# One shape set: each mix of dtypes once (f32 x with a bf16 layer_out in the first case).
CASES = [
    (4, 130, 45, "sinkhorn", jnp.float32, jnp.bfloat16, {}, 32),
    (3, 1, 37, "permutations", jnp.bfloat16, jnp.bfloat16, CUSTOM, 32),
    (1, 130, 1, "sinkhorn", jnp.bfloat16, jnp.float32, {}, 128),
    (8, 1, 37, "sinkhorn", jnp.float32, jnp.float32, CUSTOM, 64),
    (3, 130, 0, "sinkhorn", jnp.float32, jnp.float32, {}, 128),
]
# The bit-for-bit comparisons run the TPU interpreter without race detection (half the cost); the
# reference tests above run the same kernels with it.
NO_RACE_CHECK = pltpu.InterpretParams()
NAMES = ("x_next", "layer_in", "h_pre", "h_post", "h_res")
# (n, D, T, mix, x dtype, layer_out dtype, config scalars, token tile) of the backward, whose grid
# is token tiles x feature chunks. n = 8 only in the forward: the backward's two halves are the
# post and pre backward kernels' bodies, each checked at n = 8 in its own file, and an n = 8 pre
# backward costs ~40 s here.
BACKWARD_CASES = [
    (4, 130, 37, "sinkhorn", jnp.bfloat16, jnp.bfloat16, {}, 32),  # the bit-for-bit test's problem
    (3, 600, 20, "permutations", jnp.float32, jnp.float32, CUSTOM, 128),  # Dp = 640: five chunks
    (1, 1, 1, "sinkhorn", jnp.bfloat16, jnp.float32, {}, 128),
    (3, 130, 0, "permutations", jnp.float32, jnp.float32, {}, 128),
]
BACKWARD_NAMES = ("dx_partial", "dlayer_out", "dh_post", "dh_res", "dnorm_weight", "dphi", "dalpha", "dbias")


def _problem(rng, config, d, t, dtype, layer_out_dtype):
    x, layer_out, _, h_post, h_res = _post_problem(rng, config.n, d, t, dtype)
    return x, layer_out.astype(layer_out_dtype), h_post, h_res, random_numpy_params(rng, config, d)


def _post_oracle(x, layer_out, h_post, h_res):
    """x_next in float64 (spec: Forward step 8)."""
    return np.einsum("tij,tid->tjd", h_res, x) + h_post[:, :, None] * layer_out[:, None, :]


def _pre_oracle(config, x_next, params, noise=None):
    f = numpy_reference._forward(x_next, np.zeros((len(x_next), x_next.shape[2])), params, config, noise)
    return f["layer_in"], f["h_pre"], f["h_post"], f["h_res"]


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_boundary_forward_matches_reference(seed, case):
    """x_next against the post in float64; the pre of l+1 against the reference's pre of the
    x_next the kernel stored (its dtype's rounding is the contract: mhc.jax's separate post and
    pre calls hand the stored x_next over, and the fused call equals them bit for bit)."""
    n, d, t, mix, dtype, layer_out_dtype, scalars, tile = case
    config = mj.Config(n=n, mix=mix, **scalars)
    rng = np.random.default_rng(seed)
    x, layer_out, h_post, h_res, params = _problem(rng, config, d, t, dtype, layer_out_dtype)
    got = mhc.tpu.boundary_forward(config, x, layer_out, h_post, h_res, params, tile=tile, interpret=INTERPRET)
    _no_races()
    post_inputs = tuple(_f64(a) for a in (x, layer_out, h_post, h_res))
    stored = _f64(got[0])
    want = (_post_oracle(*post_inputs), *_pre_oracle(config, stored, params))

    def perturbed(rng, index):
        if index == 0:
            return _post_oracle(*(round_by_one_unit(rng, a) for a in post_inputs))
        return _pre_oracle(config, round_by_one_unit(rng, stored), round_by_one_unit(rng, params), rng)[index - 1]

    dtypes = [dtype if index < 2 else jnp.float32 for index in range(len(NAMES))]
    assert_outputs_match(NAMES, got, want, dtypes, perturbed, seed)
    if dtype == jnp.bfloat16:
        # x_next is the post's mix; layer_in mixes the stored x_next with the kernel's own gates.
        assert_post_mixed_in_f32_and_rounded_once(got[0], x, layer_out, h_post, h_res, f"(seed {seed})")
        assert_mixed_in_f32_and_rounded_once("layer_in", got[1], got[2], got[0], f"(seed {seed})")


def test_boundary_forward_equals_post_then_pre_and_is_batch_invariant(seed):
    """The fused kernel runs the post and pre kernels' own bodies: the same bits as post_forward
    then pre_forward at the same tile (bf16, three tiles of 32 with a ragged last, D padded). And
    token 40 (the middle of the second tile) equals the same token alone, bit for bit (spec:
    Accuracy, batch invariance)."""
    config = mj.Config(n=4)
    rng = np.random.default_rng(seed)
    x, layer_out, h_post, h_res, params = _problem(rng, config, 130, 80, jnp.bfloat16, jnp.bfloat16)
    fused = mhc.tpu.boundary_forward(config, x, layer_out, h_post, h_res, params, tile=32, interpret=NO_RACE_CHECK)
    x_next = mhc.tpu.post_forward(config, x, layer_out, h_post, h_res, tile=32, interpret=NO_RACE_CHECK)
    separate = (x_next, *mhc.tpu.pre_forward(config, x_next, params, tile=32, interpret=NO_RACE_CHECK))
    one = slice(40, 41)
    alone = mhc.tpu.boundary_forward(
        config, x[one], layer_out[one], h_post[one], h_res[one], params, tile=32, interpret=NO_RACE_CHECK
    )
    for name, a, b, c in zip(NAMES, fused, separate, alone, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
        np.testing.assert_array_equal(np.asarray(a[one], np.float32), np.asarray(c, np.float32), err_msg=name)


@pytest.mark.parametrize(("mix", "dtype"), [("sinkhorn", jnp.float32), ("permutations", jnp.bfloat16)])
def test_every_tile_lowers_for_tpu(mix, dtype):
    """Every token tile the wrappers can choose passes the Pallas -> Mosaic lowering, forward and
    backward, at a D that pads and takes two feature chunks (Dp = 768) and a ragged T; every matmul
    is f32-accurate on the MXU (the forward: assert_pre_forward_matmuls_f32_accurate; the backward:
    assert_pre_backward_matmuls_f32_accurate)."""
    n, d, t = 4, 700, 300
    config = mj.Config(n=n, mix=mix)
    x, layer_out, h_post, h_res, params = _problem(np.random.default_rng(0), config, d, t, dtype, dtype)
    cotangents = (layer_out, x, h_post, h_res)
    for tile in mhc.tpu.TOKEN_TILES:

        def forward(*a, tile=tile):
            return mhc.tpu.boundary_forward(config, *a, tile=tile)

        def backward(*a, tile=tile):
            return mhc.tpu.boundary_backward(config, *a, tile=tile)

        (kernel,) = _mosaic_modules(_export(forward, x, layer_out, h_post, h_res, params))
        assert_pre_forward_matmuls_f32_accurate(kernel, config, jnp.dtype(dtype), padded=768)
        (kernel,) = _mosaic_modules(_export(backward, *cotangents, x, layer_out, h_post, h_res, params))
        rows = mhc.tpu._layout.logit_rows(n, mix)
        tables = int(mix == "permutations")
        assert_pre_backward_matmuls_f32_accurate(kernel, n, rows, tables, dtype, padded=768)


def test_vmem_plan_and_bad_arguments():
    """The V4 shapes fit a v5e/v6e's VMEM at a smaller tile; past the budget, a clear error; bad
    arguments named."""
    config = mj.Config(n=4)
    big = mhc.tpu._layout.VMEM_BY_DEVICE_KIND["TPU v6 lite"]
    for d in (4096, 5120, 7168):
        for dtype in (jnp.bfloat16, jnp.float32):
            assert mhc.tpu._boundary.forward_tile(config, d, dtype, dtype, big) in mhc.tpu.TOKEN_TILES
            assert mhc.tpu._boundary.backward_tile(config, d, dtype, dtype, big) in mhc.tpu.TOKEN_TILES
    with pytest.raises(ValueError, match=r"mhc.tpu.boundary_forward: .*VMEM.*budget"):
        mhc.tpu._boundary.forward_tile(mj.Config(n=8), 65536, jnp.float32, jnp.float32, big)
    with pytest.raises(ValueError, match=r"mhc.tpu.boundary_backward: .*VMEM.*budget"):
        mhc.tpu._boundary.backward_tile(mj.Config(n=8), 65536, jnp.float32, jnp.float32, big)
    params = random_numpy_params(np.random.default_rng(0), config, 8)
    x, layer_out, h_post, h_res = jnp.zeros((5, 4, 8)), jnp.zeros((5, 8)), jnp.zeros((5, 4)), jnp.zeros((5, 4, 4))
    with pytest.raises(ValueError, match=r"boundary_forward: layer_out: expected shape \(5, 8\)"):
        mhc.tpu.boundary_forward(config, x, jnp.zeros((5, 9)), h_post, h_res, params)
    with pytest.raises(ValueError, match=r"boundary_forward: params.phi: expected shape \(32, 24\)"):
        mhc.tpu.boundary_forward(config, x, layer_out, h_post, h_res, params._replace(phi=params.phi[:, :20]))
    with pytest.raises(ValueError, match=r"boundary_forward: tile: expected one of"):
        mhc.tpu.boundary_forward(config, x, layer_out, h_post, h_res, params, tile=100)
    cotangents = (layer_out, x, h_post, h_res)
    with pytest.raises(ValueError, match=r"boundary_backward: dx_partial_next: expected shape \(5, 4, 8\) and dtype"):
        mhc.tpu.boundary_backward(
            config, layer_out, x.astype(jnp.bfloat16), h_post, h_res, x, layer_out, h_post, h_res, params
        )
    with pytest.raises(ValueError, match=r"boundary_backward: h_res: expected shape \(5, 4, 4\)"):
        mhc.tpu.boundary_backward(config, *cotangents, x, layer_out, h_post, jnp.zeros((5, 16)), params)


def _backward_oracle(config, x, layer_out, h_post, h_res, params, dli, g_next, layer_out_next, dtype, noise=None):
    """The boundary backward in float64 and the kernel's cotangent inputs. x_next is the post of
    (x, layer_out, h_post, h_res) rounded to x's dtype, as the forward stores it; its cotangents
    come from a cotangent g_next of the next post's output and a next layer_out (as in
    test_tpu_pre_backward), so the reference's full backward of l+1 gives dx_next, the g of
    post l's backward (spec: Backward, Post)."""
    x_next = _f64(jnp.asarray(_post_oracle(x, layer_out, h_post, h_res), dtype))
    (dx_next, *dparams), cotangents, _ = _pre_backward_oracle(
        config, x_next, layer_out_next, params, dli, g_next, noise
    )
    # The kernel gets dx_partial of l+1 in x's dtype; it enters dx_{l+1} as a plain summand, so
    # the reference takes the rounded value too (where dx_{l+1} cancels, the rounding would be
    # amplified past the bound).
    dx_partial_next = cotangents[0]
    dx_next = dx_next - dx_partial_next + _f64(jnp.asarray(dx_partial_next, dtype))
    post = (
        np.einsum("tij,tjd->tid", h_res, dx_next),
        np.einsum("tj,tjd->td", h_post, dx_next),
        np.einsum("td,tjd->tj", layer_out, dx_next),
        np.einsum("tid,tjd->tij", x, dx_next),
    )
    return (*post, *dparams), cotangents


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=_case_id)
def test_boundary_backward_matches_reference(seed, case):
    """Every output against the float64 reference. With bf16 x, dx_{l+1} is rounded to bf16 on its
    way from the pre backward of l+1 to the post backward of l (as the separate calls store it):
    every output then carries a bf16 rounding and is held to the bf16 bound."""
    _check_backward_against_reference(seed, case)


def test_boundary_backward_split_over_two_cores(seed):
    """The token tiles split over two TensorCores (mhc.tpu._layout.CoreSplit, as
    test_tpu_pre_backward's test): T = 150 in five tiles of 32, D = 700 in two feature chunks;
    core 1 has one trailing tile of steps, which must write nothing (dh_post and dh_res
    accumulate over the chunks in their blocks) and add nothing to its partial sums."""
    _check_backward_against_reference(seed, (4, 700, 150, "sinkhorn", jnp.float32, jnp.float32, CUSTOM, 32), cores=2)


def _check_backward_against_reference(seed, case, cores=None):
    n, d, t, mix, dtype, layer_out_dtype, scalars, tile = case
    config = mj.Config(n=n, mix=mix, **scalars)
    rng = np.random.default_rng(seed)
    x, layer_out, h_post, h_res, params = _problem(rng, config, d, t, dtype, layer_out_dtype)
    dli = jnp.asarray(rng.standard_normal((t, d)), dtype)
    g_next, layer_out_next = rng.standard_normal((t, n, d)), rng.standard_normal((t, d))
    inputs = tuple(_f64(a) for a in (x, layer_out, h_post, h_res)) + (params, _f64(dli), g_next, layer_out_next)
    want, (dx_partial_next, dh_post_next, dh_res_next) = _backward_oracle(config, *inputs, dtype)
    cotangents = (
        dli,
        jnp.asarray(dx_partial_next, dtype),
        jnp.asarray(dh_post_next, jnp.float32),
        jnp.asarray(dh_res_next, jnp.float32),
    )
    got = mhc.tpu.boundary_backward(
        config, *cotangents, x, layer_out, h_post, h_res, params, tile=tile, interpret=INTERPRET, cores=cores
    )
    _no_races()
    dtypes = (dtype, layer_out_dtype) + (jnp.float32,) * 6

    def perturbed(rng, index):
        return _backward_oracle(config, *(round_by_one_unit(rng, a) for a in inputs), dtype, rng)[0][index]

    tolerances = [max(_tolerance(dtype), _tolerance(output_dtype)) for output_dtype in dtypes]
    assert_outputs_match(BACKWARD_NAMES, got, want, dtypes, perturbed, seed, tolerances)


def test_boundary_backward_equals_separate_kernels_bit_for_bit(seed):
    """post_forward (x_next), pre_backward of l+1, then post_backward of l with its dx: the same
    bits as the fused kernel (bf16: dx_{l+1} rounded alike; two tiles of 32 with a ragged last: the
    parameter gradients' sums over tiles in the same order)."""
    config = mj.Config(n=4)
    n, d, t = 4, 130, 37
    rng = np.random.default_rng(seed)
    x, layer_out, h_post, h_res, params = _problem(rng, config, d, t, jnp.bfloat16, jnp.bfloat16)
    cotangents = (
        jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((t, n, d)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((t, n)), jnp.float32),
        jnp.asarray(rng.standard_normal((t, n, n)), jnp.float32),
    )
    kw = dict(tile=32, interpret=NO_RACE_CHECK)
    fused = mhc.tpu.boundary_backward(config, *cotangents, x, layer_out, h_post, h_res, params, **kw)
    x_next = mhc.tpu.post_forward(config, x, layer_out, h_post, h_res, **kw)
    dx_next, *parameter_grads = mhc.tpu.pre_backward(config, *cotangents, x_next, params, **kw)
    separate = (*mhc.tpu.post_backward(config, dx_next, x, layer_out, h_post, h_res, **kw), *parameter_grads)
    for name, a, b in zip(BACKWARD_NAMES, fused, separate, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)

"""The Pallas TPU kernels (mhc.tpu), checked without a TPU (docs/tpu.md): run in TPU interpret mode
with race detection against the float64 reference (numpy_reference), lowered to Mosaic for every
token tile the wrappers can choose, and the projection's MXU precision read back from the lowered
Mosaic module. Compiling for real chips is slow and lives outside this file (make tpu-compile).

Interpret mode costs ~50 ms per grid step and 1-3 s of tracing per shape, and more per unrolled
stream (an n = 8 post case cost 14 s of CPU): one shape set per kernel, a sample of the CPU suite's
families (n in {1, 3, 4, 8}, D in {1, 130, 600}, T in {0, 1, 37, 300}, both mixes, f32 and bf16,
non-default config scalars), each with a ragged last token tile. The case of three token tiles
also checks batch invariance (a token alone, bit for bit).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu

import mhc.jax as mj
import mhc.tpu
import numpy_reference
from conftest import (
    assert_matches,
    assert_mixed_in_f32_and_rounded_once,
    assert_post_mixed_in_f32_and_rounded_once,
    random_numpy_params,
    round_by_one_unit,
)
from mhc.tpu._schedule import mosaic_modules as _mosaic_modules  # the other TPU test files import it from here

# The TPU kernels in Pallas's interpreter: slow (pyproject.toml, markers); make check skips this file.
pytestmark = pytest.mark.slow

# Two simulated cores share the "parallel" token grid, so a race between them is detected; memory
# read before it is written holds NaN, and an out-of-bounds access raises.
INTERPRET = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
# Half the cost, for bit-for-bit comparisons of kernels whose reference test runs with INTERPRET.
NO_RACE_CHECK = pltpu.InterpretParams()
TILE = 128  # the smallest tile: T = 300 is three grid steps with a ragged last one
CUSTOM = dict(sinkhorn_iters=7, sinkhorn_eps=1e-4, rms_eps=1e-3, pre_eps=0.1, post_scale=1.5)

# (n, D, T, mix, dtype, config scalars): a sample of the product.
PRE_CASES = [
    (4, 130, 300, "sinkhorn", jnp.float32, {}),
    (3, 1, 37, "permutations", jnp.bfloat16, CUSTOM),
    (1, 130, 1, "sinkhorn", jnp.bfloat16, {}),
    (8, 1, 37, "sinkhorn", jnp.float32, CUSTOM),
    (3, 130, 0, "sinkhorn", jnp.float32, {}),
    # bf16 at n = 4 (MaxText's configuration): the projection's (tile n, chunk) rows view of x, three
    # 128-lane chunks (Dp = 384), a ragged last tile
    (4, 300, 300, "permutations", jnp.bfloat16, {}),
]
# n = 8 only in the pre forward (its Sinkhorn groups of 8 rows): the post kernels have no
# n-dependent layout, only n unrolled streams (an n = 8 post case cost 14 s of CPU).
POST_CASES = [
    (4, 130, 300, jnp.float32),
    (4, 130, 300, jnp.bfloat16),  # post_forward's bf16 n = 4 kernel (_bf16_pairs_forward_kernel)
    (3, 1, 37, jnp.bfloat16),
    (4, 130, 0, jnp.float32),
    (1, 600, 37, jnp.float32),  # Dp = 640: five feature chunks, the backward's sums over D across them
]
# Token 150 of a three-tile call (the middle of the second tile), alone: batch invariance.
ONE_TOKEN = slice(150, 151)


def _tolerance(dtype) -> float:
    """The spec's bound for a tensor of this dtype (spec: Accuracy)."""
    return 1e-2 if dtype == jnp.bfloat16 else 1e-5


def assert_outputs_match(names, got, want, dtypes, perturbed, seed, tolerances=None):
    """Each output of a kernel against the float64 oracle's: its shape, its dtype (dtypes), then its
    values by assert_matches within tolerances (default: the bound of its dtype); perturbed(rng, i)
    is the oracle's output i on inputs moved by round_by_one_unit(rng, ...)."""
    for index, (name, value) in enumerate(zip(names, got, strict=True)):
        assert value.shape == want[index].shape, f"{name}: shape {value.shape}, expected {want[index].shape}"
        assert value.dtype == dtypes[index], f"{name}: dtype {value.dtype}"
        tolerance = _tolerance(value.dtype) if tolerances is None else tolerances[index]
        assert_matches(name, value, want[index], tolerance, lambda rng, i=index: perturbed(rng, i), f"(seed {seed})")


def _no_races():
    state = interpret_pallas_call.races
    assert state is None or not state.races_found, "the TPU interpreter found a race (printed above)"


def _case_id(case):
    return "-".join(
        str(getattr(v, "__name__", v)) if not isinstance(v, dict) else ("custom" if v else "default") for v in case
    )


def _assert_a_token_alone_is_bitwise_equal(names, many, alone):
    """Batch invariance (spec: Accuracy): a token's outputs do not depend on the other tokens of the
    call or its place in the tile, bit for bit. In the interpreter, whose dots are the CPU's: the
    kernels' structure (per-token sums in a fixed order), not the TPU's arithmetic."""
    for name, in_call, on_its_own in zip(names, many, alone, strict=True):
        np.testing.assert_array_equal(
            np.asarray(in_call[ONE_TOKEN], np.float32), np.asarray(on_its_own, np.float32), err_msg=name
        )


@pytest.mark.parametrize("case", PRE_CASES, ids=_case_id)
def test_pre_forward_matches_reference(seed, case):
    n, d, t, mix, dtype, scalars = case
    config = mj.Config(n=n, mix=mix, **scalars)
    rng = np.random.default_rng(seed)
    params = random_numpy_params(rng, config, d)
    x = jnp.asarray(rng.standard_normal((t, n, d)), dtype)
    got = mhc.tpu.pre_forward(config, x, params, tile=TILE, interpret=INTERPRET)
    _no_races()
    x64 = np.asarray(x.astype(jnp.float32), np.float64)

    def oracle(x, params, noise=None):
        f = numpy_reference._forward(x, np.zeros((t, d)), params, config, noise)
        return f["layer_in"], f["h_pre"], f["h_post"], f["h_res"]

    want = oracle(x64, params)
    assert_outputs_match(
        ("layer_in", "h_pre", "h_post", "h_res"),
        got,
        want,
        (dtype, jnp.float32, jnp.float32, jnp.float32),
        lambda rng, i: oracle(round_by_one_unit(rng, x64), round_by_one_unit(rng, params), rng)[i],
        seed,
    )
    if dtype == jnp.bfloat16:
        # layer_in mixes x with the kernel's own f32 gates (spec: Accuracy, the precision policy).
        assert_mixed_in_f32_and_rounded_once("layer_in", got[0], got[1], x, f"(seed {seed})")
    if t > 2 * TILE:
        alone = mhc.tpu.pre_forward(config, x[ONE_TOKEN], params, tile=TILE, interpret=INTERPRET)
        _assert_a_token_alone_is_bitwise_equal(("layer_in", "h_pre", "h_post", "h_res"), got, alone)
        _no_races()


def _post_problem(rng, n, d, t, dtype):
    x = jnp.asarray(rng.standard_normal((t, n, d)), dtype)
    layer_out = jnp.asarray(rng.standard_normal((t, d)), dtype)
    g = jnp.asarray(rng.standard_normal((t, n, d)), dtype)
    # Coefficients as pre gives them: positive gates, a column-stochastic mix.
    h_post = jnp.asarray(2.0 * rng.uniform(size=(t, n)), jnp.float32)
    h_res = rng.uniform(size=(t, n, n))
    h_res = jnp.asarray(h_res / h_res.sum(axis=1, keepdims=True), jnp.float32)
    return x, layer_out, g, h_post, h_res


def _post_oracle(x, layer_out, g, h_post, h_res):
    """out and the post backward (spec: Forward step 8, Backward: Post) in float64."""
    x, layer_out, g, h_post, h_res = (
        np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, layer_out, g, h_post, h_res)
    )
    out = np.einsum("tij,tid->tjd", h_res, x) + h_post[:, :, None] * layer_out[:, None, :]
    dx = np.einsum("tij,tjd->tid", h_res, g)
    dlayer_out = np.einsum("tj,tjd->td", h_post, g)
    dh_post = np.einsum("td,tjd->tj", layer_out, g)
    dh_res = np.einsum("tid,tjd->tij", x, g)
    return out, dx, dlayer_out, dh_post, dh_res


@pytest.mark.parametrize("case", POST_CASES, ids=_case_id)
def test_post_forward_and_backward_match_reference(seed, case):
    n, d, t, dtype = case
    config = mj.Config(n=n)
    rng = np.random.default_rng(seed)
    x, layer_out, g, h_post, h_res = _post_problem(rng, n, d, t, dtype)
    out = mhc.tpu.post_forward(config, x, layer_out, h_post, h_res, tile=TILE, interpret=INTERPRET)
    _no_races()
    backward = mhc.tpu.post_backward(config, g, x, layer_out, h_post, h_res, tile=TILE, interpret=INTERPRET)
    _no_races()
    names = ("out", "dx_partial", "dlayer_out", "dh_post", "dh_res")
    dtypes = (dtype, dtype, dtype, jnp.float32, jnp.float32)
    want = _post_oracle(x, layer_out, g, h_post, h_res)
    inputs = (x, layer_out, g, h_post, h_res)
    perturbed = lambda rng, i: _post_oracle(*(round_by_one_unit(rng, a) for a in inputs))[i]  # noqa: E731
    assert_outputs_match(names, (out, *backward), want, dtypes, perturbed, seed)
    if dtype == jnp.bfloat16:
        assert_post_mixed_in_f32_and_rounded_once(out, x, layer_out, h_post, h_res, f"(seed {seed})")
    if t > 2 * TILE:
        one = (a[ONE_TOKEN] for a in (x, layer_out, h_post, h_res))
        alone = mhc.tpu.post_forward(config, *one, tile=TILE, interpret=INTERPRET)
        _assert_a_token_alone_is_bitwise_equal(("out",), (out,), (alone,))
        _no_races()


def test_post_backward_pairs_kernel_gives_the_general_kernels_dx_and_dlayer_out(seed, monkeypatch):
    """bf16 at n = 4 runs _post._bf16_pairs_backward_kernel (x's own layout): its dx and dlayer_out
    are the general kernel's bits (the same f32 products and sums in the same order, rounded to
    nearest even; a NaN in g stays a NaN), its dh_post and dh_res the same sums in another order.
    Two tiles of 32 with a ragged last, D = 600: five feature chunks."""
    n, d, t = 4, 600, 50
    config = mj.Config(n=n)
    rng = np.random.default_rng(seed)
    x, layer_out, g, h_post, h_res = _post_problem(rng, n, d, t, jnp.bfloat16)
    g = g.at[3, 1, 7].set(jnp.nan)
    kw = dict(tile=32, interpret=NO_RACE_CHECK)
    pairs = mhc.tpu.post_backward(config, g, x, layer_out, h_post, h_res, **kw)
    monkeypatch.setattr(mhc.tpu._post, "pairs", lambda *args: False)
    general = mhc.tpu._post.post_backward.__wrapped__(config, g, x, layer_out, h_post, h_res, **kw)
    for name, a, b in zip(("dx_partial", "dlayer_out"), pairs[:2], general[:2], strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    assert (
        np.isnan(np.asarray(pairs[0], np.float32)[3]).any() and not np.isnan(np.asarray(pairs[0][4:], np.float32)).any()
    )
    for name, a, b in zip(("dh_post", "dh_res"), pairs[2:], general[2:], strict=True):
        finite = np.arange(t) != 3
        np.testing.assert_allclose(np.asarray(a)[finite], np.asarray(b)[finite], rtol=1e-5, atol=1e-5, err_msg=name)


def _export(function, *args):
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
    return jax.export.export(jax.jit(function), platforms=["tpu"])(*shapes).mlir_module()


@pytest.mark.parametrize("n", [4, 3])
def test_post_forward_rounds_ties_to_even(n):
    """bf16 out at exact ties (spec: Accuracy, round once to nearest even): x = 1 or 1 + 2^-7,
    H_res = I, H_post = 2^-8, layer_out = 1 give 1 + 2^-8 (a tie: 1) and 1 + 2^-7 + 2^-8 (a tie:
    1 + 2^-6), exact in f32. n = 4 is the packed-pairs kernel with its own rounding, n = 3 the
    general one (astype)."""
    t, d = 40, 256
    odd = np.arange(d) % 2
    x = jnp.asarray(np.broadcast_to(1.0 + odd * 2.0**-7, (t, n, d)), jnp.bfloat16)
    layer_out = jnp.ones((t, d), jnp.bfloat16)
    h_post = jnp.full((t, n), 2.0**-8, jnp.float32)
    h_res = jnp.asarray(np.broadcast_to(np.eye(n), (t, n, n)), jnp.float32)
    out = mhc.tpu.post_forward(mj.Config(n=n), x, layer_out, h_post, h_res, tile=32, interpret=INTERPRET)
    _no_races()
    want = np.broadcast_to(np.where(odd == 1, 1.0 + 2.0**-6, 1.0), (t, n, d))
    np.testing.assert_array_equal(np.asarray(out, np.float64), want)


PRECISION_CASES = [(3, "sinkhorn", "float32"), (3, "permutations", "bfloat16"), (4, "permutations", "bfloat16")]


@pytest.mark.parametrize(("n", "mix", "dtype"), PRECISION_CASES)
def test_projection_dots_carry_full_f32_precision(n, mix, dtype):
    """Every matmul of the pre kernel (projection, selection, sum of squares, permutation table) is
    f32-accurate on the MXU: f32 operands ask for fp32 contraction precision, and bf16 x meets the
    weight's three bf16 terms (exact products, f32 accumulation): one product per stream (n = 3)
    or one for every stream (n = 4, the (tile n, chunk) rows view), its contraction three times the
    chunk of x. The interpreter computes in f32 whatever was asked: only the lowered Mosaic module
    shows it."""
    config = mj.Config(n=n, mix=mix)
    params = random_numpy_params(np.random.default_rng(0), config, 130)
    x = jnp.zeros((37, n, 130), dtype)
    kernels = _mosaic_modules(_export(lambda x, p: mhc.tpu.pre_forward(config, x, p), x, params))
    assert len(kernels) == 1
    assert_pre_forward_matmuls_f32_accurate(kernels[0], config, jnp.dtype(dtype), padded=256)


@pytest.mark.parametrize(("n", "d", "mix"), [(4, 300, "permutations"), (3, 130, "sinkhorn")])
def test_stacked_projection_carries_the_weights_24_bits(seed, n, d, mix):
    """The bf16 terms of the pre forward's weight (hi + mid + lo, stacked per chunk of the
    projection's loop) add up to the folded f32 weight norm_weight * phi within 2^-24 of each
    value (spec: Precision policy: a third term left out leaves about 2^-17), the padded features
    zero; the selection under them puts each column of each stream on its coefficient row."""
    config = mj.Config(n=n, mix=mix)
    params = random_numpy_params(np.random.default_rng(seed), config, d)
    padded, width = mhc.tpu._layout.padded_features(d), config.projection_width
    chunk = mhc.tpu._pre._projection_chunk(padded)
    stacked = np.asarray(mhc.tpu._pre.stacked_projection(config, params, d, padded).astype(jnp.float32), np.float64)
    terms = stacked[: 3 * padded].reshape(padded // chunk, 3, chunk, n * width).sum(axis=1).reshape(padded, n * width)
    # the f32 product the wrapper folds (one rounding, as numpy's f32 multiply)
    folded = np.asarray(params.norm_weight, np.float32)[:, None] * np.asarray(params.phi, np.float32)
    folded = np.asarray(folded, np.float64).reshape(n, d, width)
    want = np.zeros((padded, n, width))
    want[:d] = np.transpose(folded, (1, 0, 2))
    want = want.reshape(padded, n * width)
    assert np.all(np.abs(terms - want) <= 2.0**-24 * np.abs(want)), np.max(np.abs(terms - want) / np.abs(want + 1e-300))
    selection = stacked[3 * padded :]
    rows = mhc.tpu._pre._destinations(config)
    for k in range(n):
        np.testing.assert_array_equal(selection[:, k * width : (k + 1) * width], np.eye(selection.shape[0])[:, rows])


def assert_pre_forward_matmuls_f32_accurate(kernel: str, config, dtype, padded: int):
    """The matmuls of a kernel that runs the pre forward's body (pre, boundary, V4.1's carried
    forms): f32 operands at fp32 contraction precision (the f32 projection per stream, the
    selection, the sum of squares, the permutation table); bf16 x against the weight's three bf16
    terms, one product per stream (at n = 4 one for every stream, the (tile n, chunk) rows view, in
    a loop unrolled by 2), its contraction three times the chunk of x (Dp = `padded`)."""
    matmuls = [line for line in kernel.splitlines() if "tpu.matmul" in line]
    contractions = []
    for line in matmuls:
        (_, lhs_k, lhs), (rhs_k, _, rhs) = re.findall(r"vector<(\d+)x(\d+)x(\w+)>", line.rsplit(" : ", 1)[1])[:2]
        if (lhs, rhs) == ("bf16", "bf16"):
            contractions.append((int(lhs_k), int(rhs_k)))
        else:
            assert "precision = #tpu.contract_precision<fp32>" in line, line
    n = config.n
    chunk = 256 if padded % 256 == 0 else 128
    bf16 = dtype == jnp.bfloat16
    assert set(contractions) == ({(3 * chunk, 3 * chunk)} if bf16 else set()), matmuls
    if bf16 and n != 4:  # (n = 4: the rows view's loop is unrolled by 2, one or more copies of its product)
        assert len(contractions) == n, matmuls
    f32_products = (0 if bf16 else n) + 2 + (config.mix == "permutations")
    assert len(matmuls) - len(contractions) == f32_products, matmuls


@pytest.mark.parametrize("tile", mhc.tpu.TOKEN_TILES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_tile_lowers_for_tpu(tile, dtype):
    """Every token tile the wrappers can choose passes the Pallas -> Mosaic lowering (block shapes
    the TPU can tile), for each kernel and mix, at a D that pads and a T that is ragged."""
    n, d, t = 4, 130, 300
    rng = np.random.default_rng(0)
    for mix in ("sinkhorn", "permutations"):
        config = mj.Config(n=n, mix=mix)
        params = random_numpy_params(rng, config, d)
        x = jnp.zeros((t, n, d), dtype)
        assert "tpu_custom_call" in _export(lambda x, p, c=config: mhc.tpu.pre_forward(c, x, p, tile=tile), x, params)
    x, layer_out, g, h_post, h_res = _post_problem(rng, n, d, t, dtype)
    post = lambda *a: mhc.tpu.post_forward(config, *a, tile=tile)  # noqa: E731
    assert "tpu_custom_call" in _export(post, x, layer_out, h_post, h_res)
    post_backward = lambda *a: mhc.tpu.post_backward(config, *a, tile=tile)  # noqa: E731
    assert "tpu_custom_call" in _export(post_backward, g, x, layer_out, h_post, h_res)


def test_default_tiles_follow_the_vmem_plan():
    """Small problems get the largest tile; DeepSeek-V4's widths (n = 4, D = 4096, V4.1's 5120,
    7168) fit every chip's budget at some tile, a v5e/v6e's 128 MiB at a tile of 128 or more; a
    token of every stream too large for the budget is a clear error naming it, not a kernel that
    fails to compile."""
    config = mj.Config(n=4)
    layout = mhc.tpu._layout
    assert mhc.tpu._pre.token_tile(config, 130, jnp.float32) == mhc.tpu.TOKEN_TILES[0]
    assert layout.chip_vmem() == layout.DEFAULT_VMEM  # no TPU here: the 64 MiB default
    for d in (4096, 5120, 7168):
        for dtype in (jnp.bfloat16, jnp.float32):
            for capacity in (layout.DEFAULT_VMEM, layout.VMEM_BY_DEVICE_KIND["TPU v5 lite"]):
                tile = mhc.tpu._pre.token_tile(config, d, dtype, capacity)
                assert tile in mhc.tpu.TOKEN_TILES
                assert capacity == layout.DEFAULT_VMEM or tile >= 128, (d, dtype, tile)
    with pytest.raises(ValueError, match=r"mhc.tpu.pre_forward: .*VMEM.*48 MiB budget.*n \* D is too large"):
        mhc.tpu._pre.token_tile(mj.Config(n=8), 65536, jnp.float32)


def test_bad_arguments_are_named():
    config = mj.Config(n=4)
    params = random_numpy_params(np.random.default_rng(0), config, 8)
    x = jnp.zeros((5, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"x: expected n = 4"):
        mhc.tpu.pre_forward(config, jnp.zeros((5, 3, 8)), params)
    with pytest.raises(ValueError, match=r"x: expected float32 or bfloat16"):
        mhc.tpu.pre_forward(config, x.astype(jnp.float16), params)
    with pytest.raises(ValueError, match=r"tile: expected one of"):
        mhc.tpu.pre_forward(config, x, params, tile=100)
    with pytest.raises(ValueError, match=r"params.phi: expected shape \(32, 24\)"):
        mhc.tpu.pre_forward(config, x, params._replace(phi=params.phi[:, :20]))
    h_post, h_res = jnp.zeros((5, 4)), jnp.zeros((5, 4, 4))
    with pytest.raises(ValueError, match=r"layer_out: expected shape \(5, 8\)"):
        mhc.tpu.post_forward(config, x, jnp.zeros((5, 9)), h_post, h_res)
    with pytest.raises(ValueError, match=r"h_res: expected shape \(5, 4, 4\)"):
        mhc.tpu.post_forward(config, x, jnp.zeros((5, 8)), h_post, jnp.zeros((5, 16)))
    with pytest.raises(ValueError, match=r"g: expected x's shape and dtype"):
        mhc.tpu.post_backward(config, x.astype(jnp.bfloat16), x, jnp.zeros((5, 8)), h_post, h_res)

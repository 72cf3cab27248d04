"""The TPU pre backward (mhc.tpu.pre_backward), checked without a TPU as test_tpu_kernels.py checks
the forwards: in TPU interpret mode with race detection against the float64 reference
(numpy_reference.backward), lowered to Mosaic at every token tile, and the MXU precision of every
matmul read back from the lowered module.

The kernel's inputs dx_partial, dh_post and dh_res are what the post backward hands it; here the
reference computes them (float64, then rounded to the kernel's dtypes) from a cotangent g of out
and a layer_out, so that the reference's full backward is the expected result. Cases: a sample of
the CPU suite's families, each with a ragged last token tile; D = 600 and 1024 take several
feature chunks.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
import mhc.tpu
import numpy_reference
from conftest import assert_matches, random_numpy_params, round_by_one_unit
from test_tpu_kernels import (
    CUSTOM,
    INTERPRET,
    NO_RACE_CHECK,
    ONE_TOKEN,
    TILE,
    _assert_a_token_alone_is_bitwise_equal,
    _case_id,
    _export,
    _mosaic_modules,
    _no_races,
    _tolerance,
    assert_outputs_match,
)

# The TPU kernels in Pallas's interpreter: slow (pyproject.toml, markers); make check skips this file.
pytestmark = pytest.mark.slow

# (n, D, T, mix, dtype, config scalars).
# One shape set: each case carries several of the families (an n = 8 case costs ~18 s of CPU).
CASES = [
    (4, 130, 300, "sinkhorn", jnp.float32, {}),  # three token tiles: also batch invariance
    (3, 1, 37, "permutations", jnp.bfloat16, CUSTOM),
    # sinkhorn_eps = 0: the padding rows of the Sinkhorn groups (n < 8) must not divide 0 by 0.
    (1, 130, 1, "sinkhorn", jnp.bfloat16, {"sinkhorn_eps": 0.0, "sinkhorn_iters": 30}),
    # n = 8 (no padding rows) with a large sinkhorn_eps: the softmax start's backward must use S,
    # not the first step's S + eps (at the default 1e-6 that bug moves dalpha by about the bound only).
    (8, 1, 37, "sinkhorn", jnp.float32, {"sinkhorn_eps": 0.05, "sinkhorn_iters": 5}),
    (3, 600, 37, "sinkhorn", jnp.float32, CUSTOM),  # Dp = 640: five feature chunks
    (4, 1024, 37, "sinkhorn", jnp.bfloat16, {}),  # two chunks of 512
    (3, 130, 0, "sinkhorn", jnp.float32, {}),
]
NAMES = ("dx", "dnorm_weight", "dphi", "dalpha", "dbias")


def _oracle(config, x, layer_out, params, dli, g, noise=None):
    """The reference's dx and parameter gradients, the pre backward's inputs (dx_partial = H_res g,
    dh_post, dh_res) and dx's part through the coefficients (dx - dx_partial), all float64."""
    dx, _, dparams = numpy_reference.backward(x, layer_out, params, config, dli, g, noise)
    h_res = numpy_reference._forward(x, layer_out, params, config)["h_res"]
    dx_partial = np.einsum("tij,tjd->tid", h_res, g)
    inputs = (dx_partial, np.einsum("td,tjd->tj", layer_out, g), np.einsum("tid,tjd->tij", x, g))
    return (dx, *dparams), inputs, dx - dx_partial


def _problem(rng, config, d, t, dtype):
    n = config.n
    params = random_numpy_params(rng, config, d)
    x = jnp.asarray(rng.standard_normal((t, n, d)), dtype)
    dli = jnp.asarray(rng.standard_normal((t, d)), dtype)
    as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    return params, x, dli, as64(x), as64(dli), rng.standard_normal((t, d)), rng.standard_normal((t, n, d))


def _kernel_inputs(inputs, dtype):
    dx_partial, dh_post, dh_res = inputs
    return jnp.asarray(dx_partial, dtype), jnp.asarray(dh_post, jnp.float32), jnp.asarray(dh_res, jnp.float32)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_pre_backward_matches_reference(seed, case):
    n, d, t, mix, dtype, scalars = case
    config = mj.Config(n=n, mix=mix, **scalars)
    rng = np.random.default_rng(seed)
    params, x, dli, x64, dli64, layer_out, g = _problem(rng, config, d, t, dtype)
    want, inputs, want_through_coefficients = _oracle(config, x64, layer_out, params, dli64, g)
    dx_partial, dh_post, dh_res = _kernel_inputs(inputs, dtype)
    got = mhc.tpu.pre_backward(config, dli, dx_partial, dh_post, dh_res, x, params, tile=TILE, interpret=INTERPRET)
    _no_races()
    if t > 2 * TILE:
        # Batch invariance: a token's dx depends only on its own inputs (the other outputs are sums
        # over the tokens), alone bit for bit.
        one = (a[ONE_TOKEN] for a in (dli, dx_partial, dh_post, dh_res, x))
        alone = mhc.tpu.pre_backward(config, *one, params, tile=TILE, interpret=INTERPRET)
        _assert_a_token_alone_is_bitwise_equal(("dx",), got[:1], alone[:1])
        _no_races()

    perturbed = _perturbed_oracle(config, x64, layer_out, params, dli64, g)
    _assert_each_output_matches(seed, got, want, dtype, perturbed)
    if dtype == jnp.float32 and t > 0:
        # dx is mostly dx_partial: its part through the coefficients (the gates, Sinkhorn, the
        # projection and the RMS statistic) held to the bound on its own.
        through_coefficients = np.asarray(got[0], np.float64) - np.asarray(dx_partial, np.float64)
        assert_matches(
            "dx through the coefficients",
            through_coefficients,
            want_through_coefficients,
            _tolerance(dtype),
            lambda r: perturbed(r, len(NAMES)),
            f"(seed {seed})",
        )


def _perturbed_oracle(config, x64, layer_out, params, dli64, g):
    """perturbed(rng, index) for assert_matches: output `index` of _oracle (dx through the
    coefficients at len(NAMES)) on the inputs moved by one unit."""

    def perturbed(rng, index):
        values = (x64, layer_out, params, dli64, g)
        result, _, through_coefficients = _oracle(config, *(round_by_one_unit(rng, v) for v in values), rng)
        return (*result, through_coefficients)[index]

    return perturbed


def _assert_each_output_matches(seed, got, want, dtype, perturbed):
    dtypes = [dtype if name == "dx" else jnp.float32 for name in NAMES]
    assert_outputs_match(NAMES, got, want, dtypes, perturbed, seed)


def test_pre_backward_split_over_two_cores(seed):
    """The token tiles split over two TensorCores (the grid's leading "parallel" axis,
    mhc.tpu._layout.CoreSplit): T = 150 in five tiles of 32, the last ragged, D = 700 in two
    feature chunks; core 0 takes tiles 0-2, core 1 tiles 3-4 and one trailing tile of steps that
    must neither write nor add anything (the interpreter fills uninitialized memory with NaN).
    The parameter gradients (each core's partial sums added in core order: a different summation
    order from one core's) against the float64 reference; dx, a per-token output, bit for bit the
    one-core result; the split deterministic; a call of one tile uses one core: every output bit
    for bit the one-core result."""
    config = mj.Config(n=4, **CUSTOM)
    d, t, dtype, tile = 700, 150, jnp.float32, 32
    rng = np.random.default_rng(seed)
    params, x, dli, x64, dli64, layer_out, g = _problem(rng, config, d, t, dtype)
    want, inputs, _ = _oracle(config, x64, layer_out, params, dli64, g)
    operands = (dli, *_kernel_inputs(inputs, dtype), x, params)

    def call(operands, cores, interpret=NO_RACE_CHECK):
        return mhc.tpu.pre_backward(config, *operands, tile=tile, interpret=interpret, cores=cores)

    split = call(operands, 2, INTERPRET)
    _no_races()
    _assert_each_output_matches(seed, split, want, dtype, _perturbed_oracle(config, x64, layer_out, params, dli64, g))
    np.testing.assert_array_equal(split[0], call(operands, 1)[0], err_msg="dx: two cores against one")
    for name, first, again in zip(NAMES, split, call(operands, 2), strict=True):
        np.testing.assert_array_equal(first, again, err_msg=f"{name}: two calls on two cores")
    one_tile = [a[:20] for a in operands[:5]] + [params]
    for name, one_core, two_cores in zip(NAMES, call(one_tile, 1), call(one_tile, 2), strict=True):
        np.testing.assert_array_equal(one_core, two_cores, err_msg=f"{name}: one tile, two cores asked for")


def test_core_split_covers_every_tile_once_with_no_empty_core():
    """_layout.CoreSplit.plan for 1-12 tiles over 1-4 cores asked for: the used cores' tiles are
    the tiles in order, each once; no used core is empty; never more cores than asked; trailing
    steps only on the last core."""
    for tiles in range(1, 13):
        for asked in range(1, 5):
            split = mhc.tpu._layout.CoreSplit.plan("pre_backward", tiles * 32 - 5, 32, 2, asked)
            assert 1 <= split.cores <= min(asked, tiles), (tiles, asked, split)
            held = [
                [split.token_tile(core, step) for step in range(split.tiles_per_core)] for core in range(split.cores)
            ]
            in_range = [[tile for tile in core if tile < tiles] for core in held]
            assert sum(in_range, []) == list(range(tiles)), (tiles, asked, held)
            assert all(in_range), (tiles, asked, held)
            assert all(len(core) == split.tiles_per_core for core in in_range[:-1]), (tiles, asked, held)


def _arguments(config, n, d, t, dtype):
    params = random_numpy_params(np.random.default_rng(0), config, d)
    x = jnp.zeros((t, n, d), dtype)
    return jnp.zeros((t, d), dtype), x, jnp.zeros((t, n)), jnp.zeros((t, n, n)), x, params


@pytest.mark.parametrize("mix", ["sinkhorn", "permutations"])
def test_pre_backward_dots_carry_full_f32_precision(mix):
    """Every matmul of the kernel is f32-accurate on the MXU: f32 operands (the projection's
    selection, dH_pre's and the sum of squares' ones products, the permutation table's) ask for
    fp32 contraction precision; the bf16 ones are the exact three-term forms (the recomputed
    projection: x against the weight's three terms, a contraction of three chunks of x; the
    projection gradient: dP's three terms stacked on the sublanes against bf16 x; dx's product:
    dP's and the weight's terms in the six-term contraction), one per stream each (n = 3)."""
    config = mj.Config(n=3, mix=mix)
    arguments = _arguments(config, 3, 130, 37, jnp.bfloat16)
    kernels = _mosaic_modules(_export(lambda *a: mhc.tpu.pre_backward(config, *a), *arguments))
    assert len(kernels) == 1
    assert_pre_backward_matmuls_f32_accurate(
        kernels[0], config.n, mhc.tpu._layout.logit_rows(config.n, mix), tables=int(mix == "permutations")
    )


def assert_pre_backward_matmuls_f32_accurate(
    kernel: str, n: int, rows: int, tables: int = 0, dtype=jnp.bfloat16, padded: int = 256, dots: bool = True
):
    """The matmuls of a kernel that runs the pre backward's body (pre, head, boundary, V4.1's) with
    `rows` logit rows and x of `dtype` padded to Dp = `padded`: f32 operands at fp32 contraction
    precision (the projection's selection and sum of squares, with `dots` dH_pre's or dcarried's n
    sums, `tables` permutation tables; f32 x: the projection and its gradient per stream); the
    bf16 ones the exact three-term forms: the recomputed projection (bf16 x: a contraction of three
    chunks of x, one per stream, or at n = 4 one or more copies of the rows view's product), the
    projection gradient (bf16 x: dP's three terms on the sublanes, 3 `rows`, one per stream), dx's
    dP W (a contraction of six terms, 6 `rows`, one per stream)."""
    chunk = 256 if padded % 256 == 0 else 128
    bf16 = jnp.dtype(dtype) == jnp.bfloat16
    matmuls = [line for line in kernel.splitlines() if "tpu.matmul" in line]
    exact = {"projection": 0, "gram": 0, "dx": 0}
    for line in matmuls:
        (lhs_m, lhs_k, lhs), (rhs_k, _, rhs) = re.findall(r"vector<(\d+)x(\d+)x(\w+)>", line.rsplit(" : ", 1)[1])[:2]
        if (lhs, rhs) != ("bf16", "bf16"):
            assert "precision = #tpu.contract_precision<fp32>" in line, line
        elif int(lhs_k) == int(rhs_k) == 3 * chunk:
            exact["projection"] += 1
        elif int(lhs_m) == 3 * rows:
            exact["gram"] += 1
        else:
            assert int(lhs_k) == int(rhs_k) == 6 * rows, line
            exact["dx"] += 1
    rows_view = bf16 and n == 4
    assert exact["dx"] == n and exact["gram"] == (n if bf16 else 0), matmuls
    assert exact["projection"] >= 1 if rows_view else exact["projection"] == (n if bf16 else 0), matmuls
    f32_products = 2 + (n if dots else 0) + tables + (0 if bf16 else 2 * n)
    assert len(matmuls) - sum(exact.values()) == f32_products, matmuls


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_tile_lowers_for_tpu(dtype):
    """Every token tile the wrapper can choose passes the Pallas -> Mosaic lowering, for both mixes,
    at a D that pads and takes two feature chunks (dynamic lane offsets) and a ragged T."""
    n, d, t = 4, 600, 300
    for tile in mhc.tpu.TOKEN_TILES:
        for mix in ("sinkhorn", "permutations"):
            config = mj.Config(n=n, mix=mix)
            function = lambda *a, c=config, tile=tile: mhc.tpu.pre_backward(c, *a, tile=tile)  # noqa: E731
            assert "tpu_custom_call" in _export(function, *_arguments(config, n, d, t, dtype))


def test_tile_follows_the_vmem_plan():
    """Small problems get the largest tile; n D too large for the budget is a clear error naming
    the budget."""
    rows = mhc.tpu._layout.logit_rows(4, "sinkhorn")

    def tile(n, d, dtype):
        return mhc.tpu._pre_backward.backward_tile(
            mj.Config(n=n), d, dtype, rows=rows, gates_only=False, operation="pre_backward"
        )

    assert tile(4, 130, jnp.float32) == max(mhc.tpu.TOKEN_TILES)
    assert tile(4, 2048, jnp.bfloat16) in mhc.tpu.TOKEN_TILES
    with pytest.raises(ValueError, match=r"mhc.tpu.pre_backward: .*MiB of VMEM, over the .*MiB budget"):
        tile(8, 65536, jnp.float32)
    many_steps = mj.Config(n=4, sinkhorn_iters=10000)
    with pytest.raises(ValueError, match=r"pre_backward: config.sinkhorn_iters = 10000 is too many .* VMEM plan"):
        mhc.tpu._pre_backward.backward_tile(
            many_steps, 130, jnp.float32, rows=rows, gates_only=False, operation="pre_backward"
        )


def test_bad_arguments_are_named():
    config = mj.Config(n=4)
    dli, dx_partial, dh_post, dh_res, x, params = _arguments(config, 4, 8, 5, jnp.float32)
    call = mhc.tpu.pre_backward
    with pytest.raises(ValueError, match=r"x: expected \[T, n = 4, D\]"):
        call(config, dli, dx_partial, dh_post, dh_res, jnp.zeros((5, 3, 8)), params)
    with pytest.raises(ValueError, match=r"x: expected float32 or bfloat16"):
        call(config, dli, dx_partial, dh_post, dh_res, x.astype(jnp.float16), params)
    with pytest.raises(ValueError, match=r"dlayer_in: expected shape \(5, 8\) and dtype float32"):
        call(config, dli.astype(jnp.bfloat16), dx_partial, dh_post, dh_res, x, params)
    with pytest.raises(ValueError, match=r"dx_partial: expected shape \(5, 4, 8\)"):
        call(config, dli, dx_partial[:, :, :7], dh_post, dh_res, x, params)
    with pytest.raises(ValueError, match=r"dh_res: expected shape \(5, 4, 4\) and dtype float32"):
        call(config, dli, dx_partial, dh_post, dh_res.reshape(5, 16), x, params)
    with pytest.raises(ValueError, match=r"params.phi: expected shape \(32, 24\)"):
        call(config, dli, dx_partial, dh_post, dh_res, x, params._replace(phi=params.phi[:, :20]))
    with pytest.raises(ValueError, match=r"tile: expected one of"):
        call(config, dli, dx_partial, dh_post, dh_res, x, params, tile=100)
    with pytest.raises(ValueError, match=r"mhc.tpu.pre_backward: cores: expected a positive int or None, got 0"):
        call(config, dli, dx_partial, dh_post, dh_res, x, params, cores=0)

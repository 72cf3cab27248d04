"""The TPU kernel of the fused boundary forward (mhc.tpu.boundary_forward), checked without a TPU
(docs/tpu.md): in TPU interpret mode with race detection against the float64 reference, bit for
bit against post_forward then pre_forward, batch invariant, and exported for TPU at every token
tile. Interpret mode costs ~50 ms per grid step and 1-3 s of tracing per shape: a sample of the
CPU suite's families, each case a few grid steps."""

import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
import mhc.tpu
import numpy_reference
from conftest import assert_matches, random_numpy_params, round_by_one_unit
from test_tpu_kernels import INTERPRET, _case_id, _export, _mosaic_modules, _no_races, _post_problem, _tolerance

CUSTOM = dict(sinkhorn_iters=7, sinkhorn_eps=1e-4, rms_eps=1e-3, pre_eps=0.1, post_scale=1.5)

# (n, D, T, mix, x dtype, layer_out dtype, config scalars, token tile): a sample of the product,
# with a ragged last tile in each case of more than one token.
CASES = [
    (4, 130, 300, "sinkhorn", jnp.float32, jnp.float32, {}, 128),
    (3, 1, 37, "permutations", jnp.bfloat16, jnp.bfloat16, CUSTOM, 32),
    (1, 130, 1, "sinkhorn", jnp.bfloat16, jnp.float32, {}, 128),
    (8, 1, 37, "sinkhorn", jnp.float32, jnp.float32, CUSTOM, 64),
    (4, 1, 37, "permutations", jnp.float32, jnp.bfloat16, {}, 32),
    (3, 130, 0, "sinkhorn", jnp.float32, jnp.float32, {}, 128),
]
NAMES = ("x_next", "layer_in", "h_pre", "h_post", "h_res")


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

    for index, (name, value) in enumerate(zip(NAMES, got, strict=True)):
        assert value.shape == want[index].shape, f"{name}: shape {value.shape}, expected {want[index].shape}"
        assert value.dtype == (dtype if index < 2 else jnp.float32), f"{name}: dtype {value.dtype}"
        assert_matches(
            name,
            value,
            want[index],
            _tolerance(value.dtype),
            lambda rng, i=index: perturbed(rng, i),
            f"(seed {seed})",
        )


@pytest.mark.parametrize("mix", ["sinkhorn", "permutations"])
def test_boundary_forward_equals_post_then_pre_bit_for_bit(seed, mix):
    """The fused kernel runs the post and pre kernels' own bodies: the same bits as post_forward
    then pre_forward at the same tile (bf16, a ragged tile of 32, D padded)."""
    config = mj.Config(n=4, mix=mix)
    rng = np.random.default_rng(seed)
    x, layer_out, h_post, h_res, params = _problem(rng, config, 130, 45, jnp.bfloat16, jnp.bfloat16)
    fused = mhc.tpu.boundary_forward(config, x, layer_out, h_post, h_res, params, tile=32, interpret=INTERPRET)
    x_next = mhc.tpu.post_forward(config, x, layer_out, h_post, h_res, tile=32, interpret=INTERPRET)
    separate = (x_next, *mhc.tpu.pre_forward(config, x_next, params, tile=32, interpret=INTERPRET))
    _no_races()
    for name, a, b in zip(NAMES, fused, separate, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


def test_boundary_forward_is_batch_invariant(seed):
    """Token 150 of a three-tile call equals the same token alone, bit for bit (spec: Accuracy)."""
    config = mj.Config(n=4)
    rng = np.random.default_rng(seed)
    x, layer_out, h_post, h_res, params = _problem(rng, config, 130, 300, jnp.bfloat16, jnp.bfloat16)
    one = slice(150, 151)
    many = mhc.tpu.boundary_forward(config, x, layer_out, h_post, h_res, params, tile=128, interpret=INTERPRET)
    alone = mhc.tpu.boundary_forward(
        config, x[one], layer_out[one], h_post[one], h_res[one], params, tile=128, interpret=INTERPRET
    )
    _no_races()
    for name, a, b in zip(NAMES, many, alone, strict=True):
        np.testing.assert_array_equal(np.asarray(a[one], np.float32), np.asarray(b, np.float32), err_msg=name)


@pytest.mark.parametrize(("mix", "dtype"), [("sinkhorn", jnp.float32), ("permutations", jnp.bfloat16)])
def test_every_tile_lowers_for_tpu(mix, dtype):
    """Every token tile the wrapper can choose passes the Pallas -> Mosaic lowering, at a D that
    pads and a ragged T; every matmul asks the MXU for fp32 contraction precision."""
    n, d, t = 4, 130, 300
    config = mj.Config(n=n, mix=mix)
    x, layer_out, h_post, h_res, params = _problem(np.random.default_rng(0), config, d, t, dtype, dtype)
    for tile in mhc.tpu.TOKEN_TILES:

        def boundary(*a, tile=tile):
            return mhc.tpu.boundary_forward(config, *a, tile=tile)

        (kernel,) = _mosaic_modules(_export(boundary, x, layer_out, h_post, h_res, params))
        matmuls = [line for line in kernel.splitlines() if "tpu.matmul" in line]
        assert len(matmuls) == 2 * n + (mix == "permutations"), (tile, matmuls)
        assert all("precision = #tpu.contract_precision<fp32>" in line for line in matmuls), (tile, matmuls)


def test_vmem_plan_and_bad_arguments():
    """The V4 shapes fit a v5e/v6e's VMEM at a smaller tile; past the budget, a clear error; bad
    arguments named."""
    config = mj.Config(n=4)
    big = mhc.tpu._layout.VMEM_BY_DEVICE_KIND["TPU v6 lite"]
    for d in (4096, 5120, 7168):
        for dtype in (jnp.bfloat16, jnp.float32):
            assert mhc.tpu._boundary.forward_tile(config, d, dtype, dtype, big) in mhc.tpu.TOKEN_TILES
    with pytest.raises(ValueError, match=r"mhc.tpu.boundary_forward: .*VMEM.*budget"):
        mhc.tpu._boundary.forward_tile(mj.Config(n=8), 65536, jnp.float32, jnp.float32, big)
    params = random_numpy_params(np.random.default_rng(0), config, 8)
    x, layer_out, h_post, h_res = jnp.zeros((5, 4, 8)), jnp.zeros((5, 8)), jnp.zeros((5, 4)), jnp.zeros((5, 4, 4))
    with pytest.raises(ValueError, match=r"boundary_forward: layer_out: expected shape \(5, 8\)"):
        mhc.tpu.boundary_forward(config, x, jnp.zeros((5, 9)), h_post, h_res, params)
    with pytest.raises(ValueError, match=r"boundary_forward: params.phi: expected shape \(32, 24\)"):
        mhc.tpu.boundary_forward(config, x, layer_out, h_post, h_res, params._replace(phi=params.phi[:, :20]))
    with pytest.raises(ValueError, match=r"boundary_forward: tile: expected one of"):
        mhc.tpu.boundary_forward(config, x, layer_out, h_post, h_res, params, tile=100)

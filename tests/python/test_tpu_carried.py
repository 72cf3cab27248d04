"""The TPU kernels of DeepSeek-V4.1's carried mix (spec: Single-pass schedule; mhc.tpu's
pre_forward_carried, pre_backward_carried, collapse_forward/backward, boundary_forward_carried,
boundary_backward_carried), checked without a TPU as test_tpu_kernels.py checks V4's: in TPU
interpret mode with race detection against the float64 reference (numpy_reference.carried_values,
collapse_values), the fused boundary bit for bit against the separate kernels, exported for TPU
(the Mosaic lowering, fp32 MXU precision), and the public mhc.jax API on the TPU path (the test
switch interpret_on_cpu) against the CPU kernels over a short V4.1 chain.

The interpreter is slow (~50 ms per grid step, seconds of tracing per shape): few cases, each
one covering several of n 1/3/4, D 1/130/256/600, T 0/1/37, both mixes, f32 and bf16, the carried
mix present and absent ([T, 0]: the one-hot on stream 0), with a ragged last token tile.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import mhc.jax as mj
import mhc.tpu
import numpy_reference
from conftest import (
    assert_chain_matches,
    assert_mixed_in_f32_and_rounded_once,
    random_numpy_params,
    random_params,
    relative_error,
    round_by_one_unit,
)
from mhc.tpu.testing import interpret_on_cpu
from test_tpu_kernels import (
    CUSTOM,
    INTERPRET,
    _case_id,
    _export,
    _mosaic_modules,
    _no_races,
    _tolerance,
    assert_outputs_match,
    assert_pre_forward_matmuls_f32_accurate,
)
from test_tpu_pre_backward import assert_pre_backward_matmuls_f32_accurate

# The TPU kernels in Pallas's interpreter: slow (pyproject.toml, markers); make check skips this file.
pytestmark = pytest.mark.slow

# The bit-for-bit comparison runs without race detection (half the cost).
NO_RACE_CHECK = pltpu.InterpretParams()
TILE = 32  # T = 37: two token tiles, the last ragged

# (n, D, T, mix, dtype, carried present, config scalars).
PRE_CASES = [
    (4, 130, 37, "sinkhorn", jnp.float32, True, CUSTOM),
    (3, 256, 37, "permutations", jnp.bfloat16, False, {}),
    (3, 130, 0, "sinkhorn", jnp.float32, True, {}),
]
PRE_NAMES = ("layer_in", "h_pre", "h_post", "h_res", "dx", "dcarried", "dnorm_weight", "dphi", "dalpha", "dbias")
# (n, D, T, dtype, carried present): D = 600 pads to five feature chunks (dcarried adds over them).
COLLAPSE_CASES = [
    (3, 600, 37, jnp.float32, True),
    (1, 1, 1, jnp.bfloat16, False),
    (4, 256, 0, jnp.float32, True),
    (3, 130, 37, jnp.bfloat16, True),  # the pre-apply's bf16 mix, held element by element
    # The one-hot at n > 1: dx of streams 1..n-1 is zero (an unwritten block holds NaN).
    (3, 1, 37, jnp.float32, False),
    (4, 130, 5, jnp.bfloat16, False),
]


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _carried(rng, t, n, present):
    """A carried mix as a previous sublayer's h_pre (positive gates), or [T, 0] for the one-hot."""
    if not present:
        return jnp.zeros((t, 0), jnp.float32)
    return jnp.asarray(rng.uniform(0.05, 1.0, size=(t, n)), jnp.float32)


def _pre_oracle(config, x, layer_out, params, carried, dli, dh_pre, g, noise=None):
    """(layer_in, h_pre, h_post, h_res, dx, dcarried, *dparams) of V4.1's sublayer in float64 and
    the pre backward's inputs from the post's cotangent g (dx_partial = H_res g, dh_post, dh_res),
    as test_tpu_pre_backward builds them."""
    v = numpy_reference.carried_values(x, layer_out, params, config, carried, dli, dh_pre, g, noise)
    f = numpy_reference._forward(x, layer_out, params, config, noise)
    inputs = (
        np.einsum("tij,tjd->tid", f["h_res"], g),
        np.einsum("td,tjd->tj", layer_out, g),
        np.einsum("tid,tjd->tij", x, g),
    )
    dcarried = np.zeros((len(x), 0)) if carried is None else v["dcarried"]
    want = (v["layer_in"], v["h_pre"], f["h_post"], f["h_res"], v["dx"], dcarried)
    return want + tuple(v[name] for name in ("dnorm_weight", "dphi", "dalpha", "dbias")), inputs


@pytest.mark.parametrize("case", PRE_CASES, ids=_case_id)
def test_pre_carried_matches_reference(seed, case):
    """pre_forward_carried and pre_backward_carried: every output against the float64 reference
    (dh_pre an input, dcarried = sum_d x dlayer_in, [T, 0] for the one-hot)."""
    n, d, t, mix, dtype, present, scalars = case
    config = mj.Config(n=n, mix=mix, **scalars)
    rng = np.random.default_rng(seed)
    params = random_numpy_params(rng, config, d)
    x = jnp.asarray(rng.standard_normal((t, n, d)), dtype)
    carried = _carried(rng, t, n, present)
    dli = jnp.asarray(rng.standard_normal((t, d)), dtype)
    dh_pre = jnp.asarray(rng.standard_normal((t, n)), jnp.float32)
    layer_out, g = rng.standard_normal((t, d)), rng.standard_normal((t, n, d))
    inputs64 = (_f64(x), layer_out, params, _f64(carried) if present else None, _f64(dli), _f64(dh_pre), g)
    want, (dx_partial, dh_post, dh_res) = _pre_oracle(config, *inputs64)
    forward = mhc.tpu.pre_forward_carried(config, x, carried, params, tile=TILE, interpret=INTERPRET)
    _no_races()
    cotangents = (dli, jnp.asarray(dx_partial, dtype), dh_pre, jnp.asarray(dh_post), jnp.asarray(dh_res))
    backward = mhc.tpu.pre_backward_carried(config, *cotangents, x, carried, params, tile=TILE, interpret=INTERPRET)
    _no_races()

    def perturbed(rng, index):
        moved = [None if v is None else round_by_one_unit(rng, v) for v in inputs64]
        return _pre_oracle(config, *moved, rng)[0][index]

    dtypes = [dtype if name in ("layer_in", "dx") else jnp.float32 for name in PRE_NAMES]
    # dcarried (f32) sums products of x: x's dtype's bound. An empty output (the one-hot's) passes.
    tolerances = [_tolerance(dtype if name == "dcarried" else d) for name, d in zip(PRE_NAMES, dtypes, strict=True)]
    assert_outputs_match(PRE_NAMES, (*forward, *backward), want, dtypes, perturbed, seed, tolerances)
    if dtype == jnp.bfloat16 and present:
        # layer_in mixes x with the carried mix (an input), summed in f32 and rounded once.
        assert_mixed_in_f32_and_rounded_once("layer_in", forward[0], carried, x, f"(seed {seed})")
    if not present and t:
        # The one-hot's layer_in is stream 0 itself.
        np.testing.assert_array_equal(np.asarray(forward[0], np.float32), np.asarray(x[:, 0], np.float32))


@pytest.mark.parametrize("case", COLLAPSE_CASES, ids=_case_id)
def test_collapse_matches_reference(seed, case):
    n, d, t, dtype, present = case
    config = mj.Config(n=n)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, n, d)), dtype)
    carried = _carried(rng, t, n, present)
    dout = jnp.asarray(rng.standard_normal((t, d)), dtype)
    mix = _f64(carried) if present else np.eye(n)[np.zeros(t, int)]
    out = mhc.tpu.collapse_forward(config, x, carried, tile=TILE, interpret=INTERPRET)
    _no_races()
    dx, dcarried = mhc.tpu.collapse_backward(config, dout, x, carried, tile=TILE, interpret=INTERPRET)
    _no_races()
    inputs = (_f64(x), mix, _f64(dout))
    want = numpy_reference.collapse_values(*inputs)
    want = want if present else (*want[:2], np.zeros((t, 0)))
    perturbed = lambda rng, i: numpy_reference.collapse_values(*(round_by_one_unit(rng, a) for a in inputs))[i]  # noqa: E731
    # An empty output (the one-hot's dcarried) passes.
    outputs, names = (out, dx, dcarried), ("out", "dx", "dcarried")
    assert_outputs_match(names, outputs, want, (dtype, dtype, jnp.float32), perturbed, seed, [_tolerance(dtype)] * 3)
    if dtype == jnp.bfloat16:
        # The collapse's out is the pre-apply's mix (the one-hot: x_0 itself, one term).
        assert_mixed_in_f32_and_rounded_once("out", out, mix, x, f"(seed {seed})")


def test_boundary_carried_equals_separate_kernels_bit_for_bit(seed):
    """boundary_forward_carried = post_forward then pre_forward_carried (carried = h_pre of l), and
    boundary_backward_carried = pre_backward_carried of l+1 then post_backward of l with its dx,
    bit for bit (bf16, D = 130 padded, two tiles with a ragged last: the parameter gradients' sums
    in the same order). Each half is checked against the float64 reference, with race detection,
    in its own test (test_tpu_kernels: post; above: pre carried). One case, without race detection
    (half the cost; the carried mix is one more read-only block per token tile, as in
    pre_forward_carried): the bodies are V4's, checked at every mix and n in test_tpu_boundary;
    this is the carried mix's plumbing."""
    config = mj.Config(n=3, **CUSTOM)
    n, d, t, dtype = 3, 130, 37, jnp.bfloat16
    rng = np.random.default_rng(seed)
    params = random_numpy_params(rng, config, d)
    x = jnp.asarray(rng.standard_normal((t, n, d)), dtype)
    layer_out = jnp.asarray(rng.standard_normal((t, d)), dtype)
    h_pre = _carried(rng, t, n, True)
    h_post = jnp.asarray(2.0 * rng.uniform(size=(t, n)), jnp.float32)
    h_res = rng.uniform(size=(t, n, n))
    h_res = jnp.asarray(h_res / h_res.sum(axis=1, keepdims=True), jnp.float32)
    kw = dict(tile=TILE, interpret=NO_RACE_CHECK)
    fused = mhc.tpu.boundary_forward_carried(config, x, layer_out, h_pre, h_post, h_res, params, **kw)
    x_next = mhc.tpu.post_forward(config, x, layer_out, h_post, h_res, **kw)
    separate = (x_next, *mhc.tpu.pre_forward_carried(config, x_next, h_pre, params, **kw))
    names = ("x_next", "layer_in", "h_pre", "h_post", "h_res")
    for name, a, b in zip(names, fused, separate, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)

    cotangents = (
        jnp.asarray(rng.standard_normal((t, d)), dtype),
        jnp.asarray(rng.standard_normal((t, n, d)), dtype),
        jnp.asarray(rng.standard_normal((t, n)), jnp.float32),
        jnp.asarray(rng.standard_normal((t, n)), jnp.float32),
        jnp.asarray(rng.standard_normal((t, n, n)), jnp.float32),
    )
    fused = mhc.tpu.boundary_backward_carried(config, *cotangents, x, layer_out, h_pre, h_post, h_res, params, **kw)
    dx_next, dh_pre, *parameter_grads = mhc.tpu.pre_backward_carried(config, *cotangents, x_next, h_pre, params, **kw)
    separate = (*mhc.tpu.post_backward(config, dx_next, x, layer_out, h_post, h_res, **kw), dh_pre, *parameter_grads)
    names = ("dx_partial", "dlayer_out", "dh_post", "dh_res", "dh_pre", "dnorm_weight", "dphi", "dalpha", "dbias")
    for name, a, b in zip(names, fused, separate, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    # Not vacuous: dh_pre (the carried mix's cotangent) is a sum over D of x_next and dlayer_in.
    assert relative_error(fused[4], np.einsum("tkd,td->tk", _f64(x_next), _f64(cotangents[0]))) < _tolerance(dtype)


def _v41_operands(config, n, d, t, dtype, present=True):
    params = random_numpy_params(np.random.default_rng(0), config, d)
    x, features = jnp.zeros((t, n, d), dtype), jnp.zeros((t, d), dtype)
    gates, mix = jnp.zeros((t, n)), jnp.zeros((t, n, n))
    carried = gates if present else jnp.zeros((t, 0))
    return {
        "mhc_pre_forward_carried": (x, carried, *params),
        "mhc_pre_backward_carried": (features, x, gates, gates, mix, x, carried, *params),
        "mhc_collapse_forward": (x, carried),
        "mhc_collapse_backward": (features, x, carried),
        "mhc_boundary_forward_carried": (x, features, gates, gates, mix, *params),
        "mhc_boundary_backward_carried": (features, x, gates, gates, mix, x, features, gates, gates, mix, *params),
    }


# Matmuls per stream of the collapse (the forwards that run the pre body:
# assert_pre_forward_matmuls_f32_accurate; the backwards that run the pre backward's:
# assert_pre_backward_matmuls_f32_accurate): the collapse backward's sums over D.
MATMULS_PER_STREAM = {
    "mhc_collapse_forward": 0,
    "mhc_collapse_backward": 1,
}


@pytest.mark.parametrize(("mix", "dtype"), [("sinkhorn", jnp.bfloat16), ("permutations", jnp.float32)])
def test_every_v41_kernel_lowers_for_tpu(mix, dtype):
    """Each V4.1 entry of mhc.tpu.KERNELS passes the Pallas -> Mosaic lowering (jax.export for TPU)
    at a D that pads and takes two feature chunks and a ragged T, and every matmul asks the MXU
    for fp32 contraction precision; the one-hot forms too (bf16 case)."""
    n, d, t = 4, 700, 300
    config = mj.Config(n=n, mix=mix)
    permutations = mix == "permutations"
    for present in (True, False) if mix == "sinkhorn" else (True,):
        operands = _v41_operands(config, n, d, t, dtype, present)
        for target, arguments in operands.items():
            if not present and target.startswith("mhc_boundary"):
                continue  # the boundary's carried mix is h_pre of l: always present

            def function(*a, target=target):
                return mhc.tpu.KERNELS[target](config, *a)

            (kernel,) = _mosaic_modules(_export(function, *arguments))
            if target in ("mhc_pre_forward_carried", "mhc_boundary_forward_carried"):
                assert_pre_forward_matmuls_f32_accurate(kernel, config, jnp.dtype(dtype), padded=768)
                continue
            if target in ("mhc_pre_backward_carried", "mhc_boundary_backward_carried"):
                rows = mhc.tpu._layout.logit_rows(n, mix)
                assert_pre_backward_matmuls_f32_accurate(
                    kernel, n, rows, int(permutations), dtype, padded=768, dots=present
                )
                continue
            matmuls = [line for line in kernel.splitlines() if "tpu.matmul" in line]
            per_stream = MATMULS_PER_STREAM[target]
            if target == "mhc_collapse_backward" and not present:
                per_stream = 0
            table = permutations and "collapse" not in target
            assert len(matmuls) == per_stream * n + table, (target, present, matmuls)
            assert all("precision = #tpu.contract_precision<fp32>" in line for line in matmuls), (target, matmuls)


def test_bad_arguments_are_named():
    config = mj.Config(n=4)
    operands = _v41_operands(config, 4, 8, 5, jnp.float32)
    x, carried, *params = operands["mhc_pre_forward_carried"]
    params = mj.Params(*params)
    with pytest.raises(ValueError, match=r"pre_forward_carried: carried: expected float32 \[T, n\] = \[5, 4\]"):
        mhc.tpu.pre_forward_carried(config, x, jnp.zeros((5, 3)), params)
    with pytest.raises(ValueError, match=r"pre_backward_carried: carried: expected float32"):
        mhc.tpu.pre_backward_carried(config, *operands["mhc_pre_backward_carried"][:6], carried[:, :2], params)
    cotangents = list(operands["mhc_pre_backward_carried"][:5])
    cotangents[2] = jnp.zeros((5, 3))
    with pytest.raises(ValueError, match=r"pre_backward_carried: dh_pre: expected shape \(5, 4\) and dtype float32"):
        mhc.tpu.pre_backward_carried(config, *cotangents, x, carried, params)
    with pytest.raises(ValueError, match=r"collapse_forward: carried: expected float32"):
        mhc.tpu.collapse_forward(config, x, carried.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"collapse_backward: dout: expected shape \(5, 8\) and dtype float32"):
        mhc.tpu.collapse_backward(config, jnp.zeros((5, 7)), x, carried)
    boundary = operands["mhc_boundary_forward_carried"]
    with pytest.raises(ValueError, match=r"boundary_forward_carried: h_pre: expected float32 \(5, 4\)"):
        mhc.tpu.boundary_forward_carried(config, boundary[0], boundary[1], jnp.zeros((5, 0)), *boundary[3:5], params)
    backward = list(operands["mhc_boundary_backward_carried"][:10])
    backward[2] = backward[2].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match=r"boundary_backward_carried: next_dh_pre: expected shape \(5, 4\)"):
        mhc.tpu.boundary_backward_carried(config, *backward, params)


def test_a_v41_chain_on_the_tpu_path_matches_float64(seed):
    """The public API on the TPU path (interpret_on_cpu: mhc.tpu.KERNELS in Pallas's interpreter)
    against the float64 V4.1 chain: stack over two V4.1 sublayers (the first pre with the one-hot,
    the fused boundary, the last post) and the collapse, the value and the gradients wrt x and
    every parameter. A V4.1 chain on the CPU kernels is test_carried's
    (test_kernel_path_agrees_with_the_plain_path), not repeated here: its compilations cost seconds
    of CPU, and without them nothing compiled outside interpret_on_cpu could be reused inside."""
    n, d, t = 3, 130, 5
    config = mj.Config(n=n, pre_from_previous=True, sinkhorn_iters=7, pre_eps=0.1, post_scale=1.3)
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (t, n, d))
    layers = [random_params(k, config, d) for k in keys[1:3]]
    w = jax.random.normal(keys[3], (t, d))

    def loss(x, layers):
        state = mj.stack(x, [(p, config, jnp.tanh) for p in layers], fallback="error")
        return jnp.sum(mj.collapse(state) * w)

    gradients = jax.jit(jax.grad(loss, argnums=(0, 1)))
    collapsed = jax.jit(lambda x, layers: mj.collapse(mj.stack(x, [(p, config, jnp.tanh) for p in layers])))
    sublayers = [(p, config, jnp.tanh) for p in layers]

    with interpret_on_cpu():
        dx, dlayers = gradients(x, layers)
        got = {"out": collapsed(x, layers), "dx": dx, "dparams": dlayers}
    assert_chain_matches(got, x, sublayers, w, f"(TPU path, seed {seed})")


def test_the_v41_api_exports_for_tpu_with_mosaic_kernels_only():
    """The public V4.1 API (stack with the fused boundaries, the collapse), value and gradient,
    exported for a TPU: every mhc operation lowers to a Mosaic kernel and no C++ FFI call
    remains."""
    n, d, t = 4, 256, 64
    config = mj.Config(n=n, pre_from_previous=True)
    layers = [random_params(jax.random.key(i), config, d) for i in range(2)]

    def loss(x, layers):
        state = mj.stack(x, [(p, config, jnp.tanh) for p in layers], fallback="error")
        return jnp.sum(mj.collapse(state))

    shapes = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (jnp.zeros((t, n, d), jnp.bfloat16), layers)
    )
    text = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), platforms=["tpu"])(
        *shapes
    ).mlir_module()
    assert "tpu_custom_call" in text
    assert "@mhc_" not in text

"""The TPU split forms (D split over devices, tensor parallelism: mhc.tpu's pre_forward_partials,
pre_forward_finish(_carried), pre_backward_partials, pre_backward_finish(_carried)), checked without
a TPU: in TPU interpret mode (race detection on) against the float64 reference, and end to end,
the sharded sublayer with D split over 2 and 4 forced virtual CPU devices running the TPU path in
the interpreter (mhc.tpu.testing.interpret_on_cpu), against one device.

The kernel test runs the contract by hand over the slices of D: each slice's partials, their sum
(the all-reduce), then each slice's finish; the partials themselves and the reassembled results
(layer_in and dx concatenated over D, the parameter gradients by rows) are held to the spec's
bounds of numpy_reference.pre_values. Small shapes (n in {3, 4}, D = 130 split in 2 (65 features a
slice: a padded lane tile each), T = 37 ragged): the interpreter is slow.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
import mhc.tpu
import numpy_reference
from conftest import random_numpy_params, round_by_one_unit
from test_tpu_kernels import CUSTOM, INTERPRET, _case_id, _no_races, assert_outputs_match

# The TPU kernels in Pallas's interpreter: slow (pyproject.toml, markers); make check skips this file.
pytestmark = pytest.mark.slow

TILE = 32  # T = 37: two token tiles, the last ragged
SLICES = 2
# (n, D, T, mix, dtype, config scalars, carried): carried None for V4, "mix" for V4.1's carried
# mix [T, n], "one-hot" for its [T, 0].
CASES = [
    (4, 130, 37, "sinkhorn", jnp.float32, {}, None),
    (3, 130, 37, "permutations", jnp.bfloat16, CUSTOM, None),
    (4, 130, 37, "sinkhorn", jnp.bfloat16, {}, "mix"),
    (3, 130, 37, "sinkhorn", jnp.float32, CUSTOM, "one-hot"),
]


def _slices(a, axis: int, count: int):
    return np.split(np.asarray(a), count, axis=axis)


def _param_slices(params: mj.Params, n: int, d: int, count: int):
    """Each slice's rows of norm_weight [n D] and phi [n D, N] (stream k, features of the slice)."""
    norm_weight = _slices(np.reshape(params.norm_weight, (n, d)), 1, count)
    phi = _slices(np.reshape(params.phi, (n, d, -1)), 1, count)
    return [
        mj.Params(w.reshape(-1), p.reshape(-1, p.shape[-1]), params.alpha, params.bias)
        for w, p in zip(norm_weight, phi, strict=True)
    ]


def _joined_rows(parts, n: int):
    """Per-slice gradients of [n Dl, ...] rows back to [n D, ...]."""
    return np.concatenate([np.reshape(p, (n, -1, *np.shape(p)[1:])) for p in parts], axis=1).reshape(
        -1, *np.shape(parts[0])[1:]
    )


def _split_run(config, x, params, carried, dli, dx_partial, dh_pre, dh_post, dh_res):
    """The split contract over SLICES slices of D, the all-reduces as sums: (partials summed,
    forward outputs, dcarried (V4.1) or None, backward outputs), reassembled over D."""
    n, d = x.shape[1], x.shape[2]
    xs, dlis, dxps = _slices(x, 2, SLICES), _slices(dli, 1, SLICES), _slices(dx_partial, 2, SLICES)
    slice_params = _param_slices(params, n, d, SLICES)
    options = dict(tile=TILE, interpret=INTERPRET)
    partials = [
        mhc.tpu.pre_forward_partials(config, jnp.asarray(xs[s]), p.norm_weight, p.phi, **options)
        for s, p in enumerate(slice_params)
    ]
    _no_races()
    summed = sum(np.asarray(p, np.float64) for p in partials).astype(np.float32)
    forwards = []
    for s in range(SLICES):
        if carried is None:
            args = (config, jnp.asarray(xs[s]), summed, params.alpha, params.bias)
            forwards.append(mhc.tpu.pre_forward_finish(*args, slices=SLICES, **options))
        else:
            args = (config, jnp.asarray(xs[s]), summed, carried, params.alpha, params.bias)
            forwards.append(mhc.tpu.pre_forward_finish_carried(*args, slices=SLICES, **options))
        _no_races()
    for later in forwards[1:]:  # the coefficients: the same bits on every slice
        for name, a, b in zip(("h_pre", "h_post", "h_res"), forwards[0][1:], later[1:], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    layer_in = np.concatenate([np.asarray(f[0].astype(jnp.float32)) for f in forwards], axis=1)
    dots = [
        np.asarray(mhc.tpu.pre_backward_partials(config, jnp.asarray(dlis[s]), jnp.asarray(xs[s]), **options))
        for s in range(SLICES)
    ]
    _no_races()
    dots = sum(d.astype(np.float64) for d in dots).astype(np.float32)
    dcarried = None
    if carried is None:
        dh_pre = dots  # V4: dH_pre is sum_d x dli, all-reduced
    elif carried.shape[1]:
        dcarried = dots
    backwards = []
    for s, p in enumerate(slice_params):
        cotangents = (jnp.asarray(dlis[s]), jnp.asarray(dxps[s]), dh_pre, dh_post, dh_res, jnp.asarray(xs[s]), summed)
        if carried is None:
            got = mhc.tpu.pre_backward_finish(config, *cotangents, p, slices=SLICES, **options)
        else:
            got = mhc.tpu.pre_backward_finish_carried(config, *cotangents, carried, p, slices=SLICES, **options)
        backwards.append(got)
        _no_races()
    for later in backwards[1:]:  # dalpha, dbias: the same on every slice
        np.testing.assert_array_equal(np.asarray(backwards[0][3]), np.asarray(later[3]))
        np.testing.assert_array_equal(np.asarray(backwards[0][4]), np.asarray(later[4]))
    dx = np.concatenate([np.asarray(b[0].astype(jnp.float32)) for b in backwards], axis=2)
    dnorm_weight = _joined_rows([np.asarray(b[1]) for b in backwards], n)
    dphi = _joined_rows([np.asarray(b[2]) for b in backwards], n)
    backward = (dx, dnorm_weight, dphi, np.asarray(backwards[0][3]), np.asarray(backwards[0][4]))
    return summed, (layer_in, *(np.asarray(a) for a in forwards[0][1:])), dcarried, backward, forwards, backwards


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_split_forms_match_reference(seed, case):
    n, d, t, mix, dtype, scalars, carried_kind = case
    config = mj.Config(n=n, mix=mix, **scalars)
    rng = np.random.default_rng(seed)
    params = random_numpy_params(rng, config, d)
    x = jnp.asarray(rng.standard_normal((t, n, d)), dtype)
    dli = jnp.asarray(rng.standard_normal((t, d)), dtype)
    dx_partial = jnp.asarray(rng.standard_normal((t, n, d)), dtype)
    dh_pre = jnp.asarray(rng.standard_normal((t, n)), jnp.float32)
    dh_post = jnp.asarray(rng.standard_normal((t, n)), jnp.float32)
    dh_res = jnp.asarray(rng.standard_normal((t, n, n)), jnp.float32)
    if carried_kind == "mix":
        carried = jnp.asarray(rng.uniform(0.5, 1.5, size=(t, n)), jnp.float32)
    elif carried_kind == "one-hot":
        carried = jnp.zeros((t, 0), jnp.float32)
    else:
        carried = None
    summed, forward, dcarried, backward, _, _ = _split_run(
        config, np.asarray(x), params, carried, np.asarray(dli), np.asarray(dx_partial), dh_pre, dh_post, dh_res
    )

    as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    x64, dli64, dxp64 = as64(x), as64(dli), as64(dx_partial)
    one_hot = np.zeros((t, n))
    one_hot[:, 0] = 1.0
    carried64 = None if carried is None else (one_hot if carried_kind == "one-hot" else as64(carried))
    # V4: the kernel's dH_pre input is the all-reduced sum_d x dli alone (V4's pre has no h_pre output).
    dh_pre64 = np.zeros((t, n)) if carried is None else as64(dh_pre)

    def oracle(x64, params, dli64, noise=None):
        folded = (np.asarray(params.norm_weight, np.float64)[:, None] * np.asarray(params.phi, np.float64)).reshape(
            n, d, -1
        )
        partials = np.concatenate(
            [np.einsum("tkd,kdc->tc", x64, folded), np.sum(x64 * x64, axis=(1, 2))[:, None]], axis=1
        )
        values = numpy_reference.pre_values(
            x64, params, config, dli64, dh_pre64, as64(dh_post), as64(dh_res), carried64, noise
        )
        (layer_in, h_pre, h_post, h_res), (dx, dparams, dmix) = values
        return (partials, layer_in, h_pre, h_post, h_res, dx + dxp64, *dparams, dmix)

    want = oracle(x64, params, dli64)

    def perturbed(rng, i):
        moved = (round_by_one_unit(rng, v) for v in (x64, params, dli64))
        return oracle(*moved, rng)[i]

    names = ("partials", "layer_in", "h_pre", "h_post", "h_res", "dx", "dnorm_weight", "dphi", "dalpha", "dbias")
    got = (summed, *forward, *backward)
    dtypes = (np.float32, np.float32, np.float32, np.float32, np.float32, np.float32) + (np.float32,) * 4
    # The bf16 outputs were widened to compare: held to bf16's bound.
    tolerances = [1e-2 if dtype == jnp.bfloat16 and name in ("layer_in", "dx") else 1e-5 for name in names]
    assert_outputs_match(names, got, want[: len(names)], dtypes, perturbed, seed, tolerances)
    if dcarried is not None:
        assert_outputs_match(("dcarried",), (dcarried,), want[-1:], (np.float32,), lambda r, i: perturbed(r, -1), seed)


def test_bad_arguments_are_named():
    config = mj.Config(n=4)
    t, n, d = 5, 4, 8
    params = random_numpy_params(np.random.default_rng(0), config, d)
    x = jnp.zeros((t, n, d))
    partials = jnp.zeros((t, config.projection_width + 1))
    gates = jnp.zeros((t, n))
    cotangents = (jnp.zeros((t, d)), jnp.zeros((t, n, d)), gates, gates, jnp.zeros((t, n, n)), x, partials)
    cases = [
        (
            "pre_forward_partials: phi",
            lambda: mhc.tpu.pre_forward_partials(config, x, params.norm_weight, params.phi[1:]),
        ),
        (
            "pre_forward_partials: x",
            lambda: mhc.tpu.pre_forward_partials(config, x[:, :3], params.norm_weight, params.phi),
        ),
        (
            "pre_forward_finish: partials",
            lambda: mhc.tpu.pre_forward_finish(config, x, gates, params.alpha, params.bias),
        ),
        ("pre_forward_finish: slices", lambda: mhc.tpu.pre_forward_finish(config, x, partials, *params[2:], slices=0)),
        ("pre_forward_finish: bias", lambda: mhc.tpu.pre_forward_finish(config, x, partials, params.alpha, gates)),
        (
            "pre_forward_finish_carried: carried",
            lambda: mhc.tpu.pre_forward_finish_carried(config, x, partials, gates[:, :2], *params[2:]),
        ),
        ("pre_backward_partials: dlayer_in", lambda: mhc.tpu.pre_backward_partials(config, x[:, 0, :3], x)),
        (
            "pre_backward_finish: dh_pre",
            lambda: mhc.tpu.pre_backward_finish(config, *cotangents[:2], gates[:1], *cotangents[3:], params),
        ),
        (
            "pre_backward_finish: partials",
            lambda: mhc.tpu.pre_backward_finish(config, *cotangents[:-1], partials[:, 1:], params),
        ),
        (
            "pre_backward_finish_carried: carried",
            lambda: mhc.tpu.pre_backward_finish_carried(config, *cotangents, gates[:1], params),
        ),
    ]
    for message, call in cases:
        with pytest.raises(ValueError, match=f"mhc.tpu.{message}"):
            call()

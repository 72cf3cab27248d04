"""The spec's forward and backward (docs/math.md) in float64 NumPy, vectorized over tokens.

Written from the spec's text, sharing no code with src/core/reference.cc or mhc.jax.reference, so
it is an independent oracle for the Python tests: the kernel path and the plain-JAX path are both
held to it. Its backward is pinned to central differences of its forward (test_reference_numpy.py).
"""

import itertools

import numpy as np

# The tensors of one sublayer's forward and VJP, in the order values() returns them.
NAMES = ("layer_in", "out", "dx", "dlayer_out", "dnorm_weight", "dphi", "dalpha", "dbias")


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _softmax(v):
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def permutation_matrices(n):
    """[n!, n, n]: [p, i, perm_p(i)] = 1, permutations in lexicographic order."""
    perms = list(itertools.permutations(range(n)))
    mats = np.zeros((len(perms), n, n))
    for p, perm in enumerate(perms):
        mats[p, np.arange(n), perm] = 1.0
    return mats


def _rounded(value, noise):
    """value, or with noise (a np.random.Generator) value * (1 + u), |u| <= 2^-24: a value the
    kernels round to f32 and reuse (conftest.assert_matches' spread; RoundingNoise in
    include/mhc/reference.h)."""
    if noise is None:
        return value
    return value * (1.0 + noise.uniform(-(2.0**-24), 2.0**-24, np.shape(value)))


def _forward(x, layer_out, params, config, noise=None):
    """Every intermediate the backward needs, for tokens flattened to [T, ...]. With `noise`, r, the
    projection P, the logits a and the coefficients carry one f32 unit of random rounding
    (_rounded), as reference::RoundingNoise does in C++ (backward: the gradients of a, P and r and
    the dx through the projection too)."""
    nw, phi, alpha, bias = (np.asarray(p, np.float64) for p in params)
    n, d = x.shape[-2:]
    x3 = np.asarray(x, np.float64).reshape(-1, n, d)
    lo = np.asarray(layer_out, np.float64).reshape(-1, d)
    xf = x3.reshape(len(x3), n * d)
    r = _rounded(1.0 / np.sqrt(np.mean(xf * xf, axis=1) + config.rms_eps), noise)  # step 1
    projection = _rounded((xf * nw) @ phi, noise)  # step 2, P
    z = r[:, None] * projection
    scale = np.concatenate([np.full(n, alpha[0]), np.full(n, alpha[1]), np.full(phi.shape[1] - 2 * n, alpha[2])])
    a = _rounded(scale * z + bias, noise)  # step 3
    s_pre, s_post = _sigmoid(a[:, :n]), _sigmoid(a[:, n : 2 * n])
    h_pre = _rounded(s_pre + config.pre_eps, noise)  # step 4
    h_post = _rounded(config.post_scale * s_post, noise)
    res = a[:, 2 * n :]
    steps = []  # (over_columns, sums, result) per Sinkhorn step
    if config.mix == "sinkhorn":  # step 5
        soft = _softmax(res.reshape(-1, n, n))
        current = soft + config.sinkhorn_eps
        for k in range(2 * config.sinkhorn_iters - 1):
            over_columns = k % 2 == 0  # columns first and last
            sums = current.sum(axis=1 if over_columns else 2)
            current = current / ((sums[:, None, :] if over_columns else sums[:, :, None]) + config.sinkhorn_eps)
            steps.append((over_columns, sums, current))
        h_res = _rounded(current, noise)
    else:
        soft = _softmax(res)
        h_res = _rounded(np.einsum("tp,pij->tij", soft, permutation_matrices(n)), noise)
    layer_in = np.einsum("tk,tkd->td", h_pre, x3)  # step 6
    out = np.einsum("tij,tid->tjd", h_res, x3) + h_post[:, :, None] * lo[:, None, :]  # step 8
    return dict(
        x3=x3,
        lo=lo,
        xf=xf,
        r=r,
        projection=projection,
        z=z,
        scale=scale,
        s_pre=s_pre,
        s_post=s_post,
        h_pre=h_pre,
        h_post=h_post,
        h_res=h_res,
        soft=soft,
        steps=steps,
        layer_in=layer_in,
        out=out,
    )


def forward(x, layer_out, params, config, noise=None):
    """(layer_in, out) in float64, shaped like layer_out and x."""
    f = _forward(x, layer_out, params, config, noise)
    return f["layer_in"].reshape(np.shape(layer_out)), f["out"].reshape(np.shape(x))


def coefficients(x, params, config):
    """(h_pre [T, n], h_post [T, n], h_res [T, n, n]) in float64, tokens flattened."""
    f = _forward(x, np.zeros(np.shape(x)[:-2] + np.shape(x)[-1:]), params, config)
    return f["h_pre"], f["h_post"], f["h_res"]


def backward(x, layer_out, params, config, dlayer_in, dout, noise=None):
    """The VJP of (layer_in, out) = forward(...) at cotangents (dlayer_in, dout): (dx, dlayer_out,
    dparams) with dparams in the layout of params, all float64 (spec: Backward)."""
    f = _forward(x, layer_out, params, config, noise)
    d = f["x3"].shape[2]
    x3 = f["x3"]
    g = np.asarray(dout, np.float64).reshape(x3.shape)
    dli = np.asarray(dlayer_in, np.float64).reshape(-1, d)
    # Post, then the pre-apply.
    _, dx3, dlayer_out, dh_post, dh_res = post_values(x3, f["lo"], f["h_post"], f["h_res"], g)
    dx3 = dx3 + f["h_pre"][:, :, None] * dli[:, None, :]
    dh_pre = np.einsum("tkd,td->tk", x3, dli)
    dxf, dparams = _coefficient_backward(f, params, config, dh_pre, dh_post, dh_res, noise)
    dxf = dx3.reshape(dxf.shape) + dxf
    return dxf.reshape(np.shape(x)), dlayer_out.reshape(np.shape(layer_out)), dparams


def post_values(x, layer_out, h_post, h_res, dout):
    """The post alone (spec: Forward step 8) from given coefficients, out_j = sum_i h_res[i, j] x_i +
    h_post[j] layer_out, and its VJP at dout: (out, dx, dlayer_out, dh_post, dh_res), float64,
    any leading dims."""
    x, layer_out, h_post, h_res, g = (np.asarray(v, np.float64) for v in (x, layer_out, h_post, h_res, dout))
    out = np.einsum("...ij,...id->...jd", h_res, x) + h_post[..., :, None] * layer_out[..., None, :]
    dx = np.einsum("...ij,...jd->...id", h_res, g)
    dlayer_out = np.einsum("...j,...jd->...d", h_post, g)
    dh_post = np.einsum("...d,...jd->...j", layer_out, g)
    dh_res = np.einsum("...id,...jd->...ij", x, g)
    return out, dx, dlayer_out, dh_post, dh_res


def pre_values(x, params, config, dlayer_in, dh_pre, dh_post, dh_res, carried=None, noise=None):
    """The pre alone (the kernels' pre_forward and pre_backward) in float64: layer_in and the
    coefficients (h_pre, h_post, h_res), then the VJP at the cotangents of all four, (dx, dparams,
    dcarried). V4 (carried None): layer_in = sum_k h_pre[k] x[k], so h_pre's cotangent is dh_pre
    plus sum_d x[k, d] dlayer_in[d], dcarried None; V4.1 (carried given): layer_in = sum_k
    carried[k] x[k], dcarried = sum_d x[k, d] dlayer_in[d]. x [T, n, D]; noise: see _forward."""
    f = _forward(x, np.zeros(np.shape(x)[:-2] + np.shape(x)[-1:]), params, config, noise)
    x3 = f["x3"]
    dli = np.asarray(dlayer_in, np.float64).reshape(-1, x3.shape[2])
    mix = f["h_pre"] if carried is None else np.asarray(carried, np.float64).reshape(-1, x3.shape[1])
    layer_in = np.einsum("tk,tkd->td", mix, x3)
    dmix = np.einsum("tkd,td->tk", x3, dli)
    gates = np.asarray(dh_pre, np.float64) + (dmix if carried is None else 0.0)
    dxf, dparams = _coefficient_backward(f, params, config, gates, dh_post, dh_res, noise)
    dx = mix[:, :, None] * dli[:, None, :] + dxf.reshape(x3.shape)
    return (
        (layer_in, f["h_pre"], f["h_post"], f["h_res"]),
        (dx.reshape(np.shape(x)), dparams, None if carried is None else dmix),
    )


def _coefficient_backward(f, params, config, dh_pre, dh_post, dh_res, noise):
    """The backward of steps 1-5 from the coefficients' cotangents (f: _forward's intermediates):
    the gradient wrt x through the coefficients ([T, n*D]) and dparams in the layout of params."""
    nw, phi = (np.asarray(p, np.float64) for p in params[:2])
    n = f["x3"].shape[1]
    x3, xf, r = f["x3"], f["xf"], f["r"]
    # Gates (pre_eps has no gradient).
    da_pre = dh_pre * f["s_pre"] * (1.0 - f["s_pre"])
    da_post = dh_post * config.post_scale * f["s_post"] * (1.0 - f["s_post"])
    if config.mix == "sinkhorn":
        grad = dh_res
        for over_columns, sums, result in reversed(f["steps"]):
            axis = 1 if over_columns else 2
            dots = np.expand_dims((grad * result).sum(axis=axis), axis)
            grad = (grad - dots) / (np.expand_dims(sums, axis) + config.sinkhorn_eps)
        soft = f["soft"]
        da_res = (soft * (grad - (grad * soft).sum(axis=2, keepdims=True))).reshape(len(x3), n * n)
    else:
        w = f["soft"]
        dw = np.einsum("tij,pij->tp", dh_res, permutation_matrices(n))
        da_res = w * (dw - (w * dw).sum(axis=1, keepdims=True))
    da = _rounded(np.concatenate([da_pre, da_post, da_res], axis=1), noise)
    # Scales, biases, then back through Z = r P and the RMS statistic.
    dbias = da.sum(axis=0)
    groups = [slice(0, n), slice(n, 2 * n), slice(2 * n, None)]
    dalpha = np.array([np.sum(da[:, s] * f["z"][:, s]) for s in groups])
    dz = f["scale"] * da
    dp = _rounded(r[:, None] * dz, noise)
    dr = _rounded(np.sum(dz * f["projection"], axis=1), noise)
    dphi = (xf * nw).T @ dp
    through_projection = _rounded(dp @ phi.T, noise)  # [T, M]
    dnorm_weight = np.sum(xf * through_projection, axis=0)
    dxf = through_projection * nw - (dr * r**3)[:, None] * xf / xf.shape[1]
    dparams = (
        type(params)(dnorm_weight, dphi, dalpha, dbias)
        if hasattr(params, "_fields")
        else (dnorm_weight, dphi, dalpha, dbias)
    )
    return dxf, dparams


def values(x, layer_out, params, config, dlayer_in, dout, noise=None):
    """forward and backward as one dict by NAMES: layer_in, out, then the VJP at (dlayer_in, dout)
    with respect to x, layer_out and the parameters. `noise`: see _forward."""
    layer_in, out = forward(x, layer_out, params, config, noise)
    dx, dlo, dparams = backward(x, layer_out, params, config, dlayer_in, dout, noise)
    return dict(zip(NAMES, (layer_in, out, dx, dlo, *dparams), strict=True))


# DeepSeek-V4.1's sublayer (spec: Single-pass schedule), the tensors in the order
# carried_values returns them.
CARRIED_NAMES = (
    "layer_in",
    "h_pre",
    "out",
    "dx",
    "dcarried",
    "dlayer_out",
    "dnorm_weight",
    "dphi",
    "dalpha",
    "dbias",
)


def carried_values(x, layer_out, params, config, carried, dlayer_in, dh_pre, dout, noise=None):
    """V4.1's sublayer in float64: layer_in = sum_k carried[k] x[k] (carried None: the one-hot on
    stream 0), this sublayer's own h_pre (to carry), out as in V4; then the VJP at cotangents
    (dlayer_in, dh_pre, dout) wrt x, carried, layer_out and the parameters. dh_pre enters the gate
    backward as given; dcarried = sum_d x[k, d] dlayer_in[d]. One dict by CARRIED_NAMES (dcarried
    None for the one-hot). `noise`: see _forward."""
    f = _forward(x, layer_out, params, config, noise)
    n, d = f["x3"].shape[1:]
    x3 = f["x3"]
    p = np.eye(n)[np.zeros(len(x3), int)] if carried is None else np.asarray(carried, np.float64).reshape(-1, n)
    layer_in = np.einsum("tk,tkd->td", p, x3)
    g = np.asarray(dout, np.float64).reshape(x3.shape)
    dli = np.asarray(dlayer_in, np.float64).reshape(-1, d)
    _, dx3, dlayer_out, dh_post, dh_res = post_values(x3, f["lo"], f["h_post"], f["h_res"], g)
    dx3 = dx3 + p[:, :, None] * dli[:, None, :]
    dcarried = np.einsum("tkd,td->tk", x3, dli)
    given = np.asarray(dh_pre, np.float64).reshape(-1, n)
    dxf, dparams = _coefficient_backward(f, params, config, given, dh_post, dh_res, noise)
    lead = np.shape(x)[:-2]
    results = (
        layer_in.reshape(*lead, d),
        f["h_pre"].reshape(*lead, n),
        f["out"].reshape(np.shape(x)),
        (dx3.reshape(dxf.shape) + dxf).reshape(np.shape(x)),
        None if carried is None else dcarried.reshape(*lead, n),
        dlayer_out.reshape(np.shape(layer_out)),
        *dparams,
    )
    return dict(zip(CARRIED_NAMES, results, strict=True))


def collapse_values(x, carried, dout):
    """V4.1's collapse h = sum_k carried[k] x[k] and its VJP at dout: (h, dx, dcarried), float64."""
    x = np.asarray(x, np.float64)
    carried = np.asarray(carried, np.float64)
    g = np.asarray(dout, np.float64)
    out = np.einsum("...k,...kd->...d", carried, x)
    return out, carried[..., :, None] * g[..., None, :], np.einsum("...kd,...d->...k", x, g)


def head_values(x, head, config, dout, noise=None):
    """DeepSeek-V4's head (spec: Head) and its VJP at dout: (out [..., D], dx, dfn, dbase, dscale),
    float64. head = (fn [n, M], base [n], scale [1]). `noise`: r, p, a, the sigmoids and the
    gradients of a, p and r, as in _forward."""
    fn, base, scale = (np.asarray(p, np.float64) for p in head)
    n, d = x.shape[-2:]
    x3 = np.asarray(x, np.float64).reshape(-1, n, d)
    xf = x3.reshape(len(x3), n * d)
    g = np.asarray(dout, np.float64).reshape(-1, d)
    r = _rounded(1.0 / np.sqrt((xf * xf).mean(axis=1) + config.rms_eps), noise)  # [T]
    p = _rounded(xf @ fn.T, noise)  # [T, n]
    s = _rounded(_sigmoid(_rounded(scale[0] * r[:, None] * p + base, noise)), noise)
    out = np.einsum("tk,tkd->td", s + config.pre_eps, x3)
    # Backward through out = sum_k gate_k x_k, gate = sigmoid(a) + pre_eps, a = scale r p + base.
    da = _rounded(np.einsum("td,tkd->tk", g, x3) * s * (1.0 - s), noise)
    dr = _rounded((da * scale[0] * p).sum(axis=1), noise)
    dp = _rounded(da * scale[0] * r[:, None], noise)
    dx = (s + config.pre_eps)[:, :, None] * g[:, None, :]
    dx = dx.reshape(len(x3), n * d) + dp @ fn - (dr * r**3 / (n * d))[:, None] * xf
    dfn = dp.T @ xf
    dbase = da.sum(axis=0)
    dscale = np.array([(da * r[:, None] * p).sum()])
    return out.reshape(x.shape[:-2] + (d,)), dx.reshape(x.shape), dfn, dbase, dscale

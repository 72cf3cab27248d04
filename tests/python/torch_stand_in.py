"""A stand-in for the extension's ``run`` entry point, for the tests of mhc.torch's plumbing only
(custom-op registration, fake implementations, autograd wiring, torch.compile, checkpoint, the
Hugging Face patch) while the compiled extension has no ``run``: every operation of
``mhc.torch._ops.OPERATIONS`` computed from the plain-torch formulas in float32, its backward by
torch autograd through them. Never a check of the kernels' numerics (those tests need the real
entry point, ``has_kernel_entry_point``).

The work runs on a thread of its own: inside a custom op's kernel the dispatcher has turned
autograd off for the calling thread, and the backward operations need it."""

from __future__ import annotations

import concurrent.futures

import torch

from mhc._config import Config
from mhc.torch import reference

_F32 = torch.float32


def has_kernel_entry_point() -> bool:
    from mhc import _mhc_cpu

    return hasattr(_mhc_cpu, "run")


def _config(n, mix, iters, sinkhorn_eps, rms_eps, pre_eps, post_scale, carried=False) -> Config:
    return Config(n, mix, iters, sinkhorn_eps, rms_eps, pre_eps, post_scale, pre_from_previous=carried)


def _pre(config, x, carried, params):
    h_pre, h_post, h_res = reference.coefficients(x, params, config)
    if carried is None:
        return reference.mix(h_pre, x), h_pre, h_post, h_res
    layer_in = x[:, 0] if carried.shape[-1] == 0 else reference.mix(carried, x)
    return layer_in, h_pre, h_post, h_res


def _vjp(function, primals, cotangents):
    primals = [p.detach().requires_grad_() for p in primals]
    outputs = function(*primals)
    pairs = [(o, c) for o, c in zip(outputs, cotangents, strict=True) if c is not None]
    grads = torch.autograd.grad(
        [o for o, _ in pairs], primals, [c for _, c in pairs], allow_unused=True, materialize_grads=True
    )
    return list(grads)


def _params(values):
    from mhc._config import Params

    return Params(*values)


def _compute(name, inputs, config):
    values = [t.to(_F32) for t in inputs]
    if name == "pre_forward":
        return list(_pre(config, values[0], None, _params(values[1:])))
    if name == "pre_forward_carried":
        return list(_pre(config, values[0], values[1], _params(values[2:])))
    if name == "post_forward":
        return [reference.post(*values)]
    if name == "head_forward":
        from mhc._config import HeadParams

        params = HeadParams(*values[1:])
        flat = values[0].reshape(values[0].shape[0], -1)
        r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + config.rms_eps)
        gates = torch.sigmoid(params.scale[0] * r * (flat @ params.fn.T) + params.base) + config.pre_eps
        return [reference.mix(gates, values[0]), gates]
    if name == "collapse_forward":
        return [reference.mix(values[1], values[0])]
    if name in ("boundary_forward", "boundary_forward_carried"):
        carried = name.endswith("carried")
        x, layer_out, *rest = values
        h_pre, (h_post, h_res), params = (rest[0], rest[1:3], rest[3:]) if carried else (None, rest[:2], rest[2:])
        x_next = reference.post(x, layer_out, h_post, h_res)
        return [x_next, *_pre(config, x_next, h_pre, _params(params))]
    if name == "post_backward":
        g, *primals = values
        return _vjp(lambda *p: [reference.post(*p)], primals, [g])
    if name == "pre_backward":
        dli, dxp, dhp, dhr, x, *params = values
        dx, *grads = _vjp(lambda x, *p: _pre(config, x, None, _params(p)), [x, *params], [dli, None, dhp, dhr])
        return [dx + dxp, *grads]
    if name == "pre_backward_carried":
        dli, dxp, dh_pre, dhp, dhr, x, carried, *params = values
        grads = _vjp(lambda x, c, *p: _pre(config, x, c, _params(p)), [x, carried, *params], [dli, dh_pre, dhp, dhr])
        return [grads[0] + dxp, *grads[1:]]
    if name in ("boundary_backward", "boundary_backward_carried"):
        carried = name.endswith("carried")
        count = 5 if carried else 4
        cotangents, (x, layer_out, *rest) = values[:count], values[count:]
        h_pre, (h_post, h_res), params = (rest[0], rest[1:3], rest[3:]) if carried else (None, rest[:2], rest[2:])
        dli, dxn, *coefficient_cotangents = cotangents
        if not carried:
            coefficient_cotangents = [None, *coefficient_cotangents]

        def chain(x, layer_out, h_pre, h_post, h_res, *p):
            x_next = reference.post(x, layer_out, h_post, h_res)
            return [x_next, *_pre(config, x_next, h_pre, _params(p))]

        if not carried:
            return _vjp(
                lambda x, lo, hp, hr, *p: chain(x, lo, None, hp, hr, *p),
                [x, layer_out, h_post, h_res, *params],
                [dxn, dli, *coefficient_cotangents],
            )
        grads = _vjp(chain, [x, layer_out, h_pre, h_post, h_res, *params], [dxn, dli, *coefficient_cotangents])
        dx, dlayer_out, dh_pre, dh_post, dh_res, *param_grads = grads
        return [dx, dlayer_out, dh_post, dh_res, dh_pre, *param_grads]
    if name == "head_backward":
        dout, *primals = values
        return _vjp(lambda *p: _compute("head_forward", p, config)[:1], primals, [dout])
    if name == "collapse_backward":
        dout, x, carried = values
        return _vjp(lambda x, c: [reference.mix(c, x)], [x, carried], [dout])
    raise KeyError(name)


_pool = concurrent.futures.ThreadPoolExecutor(1)


def run(name, inputs, outputs, n, mix, iters, sinkhorn_eps, rms_eps, pre_eps, post_scale, tensor_parallel):
    assert tensor_parallel == 1
    config = _config(n, mix, iters, sinkhorn_eps, rms_eps, pre_eps, post_scale)
    values = _pool.submit(_compute, name, inputs, config).result()
    assert len(values) == len(outputs), name
    for out, value in zip(outputs, values, strict=True):
        out.copy_(value.detach().reshape(out.shape))


def use_where_needed(monkeypatch) -> None:
    """mhc.torch's ops on the stand-in where the extension has no run, else unchanged."""
    if not has_kernel_entry_point():
        from mhc.torch import _ops

        monkeypatch.setattr(_ops, "_extension_run", run)

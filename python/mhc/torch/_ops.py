"""The C++ operations as torch custom ops (namespace ``mhc``), and the autograd that joins them.

Every operation declared in the C++ table (src/ffi/operations.h, read through
``mhc._operations``: its inputs, outputs and their shape and dtype rules) becomes an op with no
per-operation code: its schema, its CPU implementation (allocate the results by the rules, call
the extension's ``run(name, inputs, outputs, ...)`` over DLPack, GIL released) and its fake (meta)
implementation, the same allocation on FakeTensors, which is all ``torch.compile`` needs.

The autograd is one ``torch.autograd.Function`` per sublayer role (pre, boundary, post, head,
collapse, V4 and V4.1), not ``register_autograd`` on each op: pre and boundary hand their input
streams on to the next post as an output of their own (``Context.x``), so the post's gradient of
the streams (dx_partial) arrives in the pre's backward as that output's cotangent and enters
``pre_backward`` whole, as in mhc.jax's custom VJPs. A custom op may not return an alias of its
input; with the streams used by two ops, autograd would add the two gradients in x's dtype (in
bf16, rounding twice where the kernel rounds once).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from mhc import _operations
from mhc._config import MIXES, Config, PreApply

OPERATIONS = _operations.OPERATIONS  # name -> its C++ declaration (inputs, outputs, their rules)

# The config's scalars, the trailing arguments of every op (n comes from x's shape).
_SCALARS = (("mix", "int"), ("sinkhorn_iters", "int"), ("sinkhorn_eps", "float"), ("rms_eps", "float"))
_SCALARS += (("pre_eps", "float"), ("post_scale", "float"))


def scalars(config: Config) -> tuple:
    """The config as the ops take it: mix as the C++ enum (0 sinkhorn, 1 permutations), then floats."""
    return (MIXES.index(config.mix), *(getattr(config, name) for name, _ in _SCALARS[1:]))


def _schema(operation: dict) -> str:
    arguments = [f"Tensor {name}" for name in operation["inputs"]]
    arguments += [f"{kind} {name}" for name, kind in _SCALARS]
    outputs = operation["outputs"]
    results = ", ".join("Tensor" for _ in outputs)
    return f"({', '.join(arguments)}) -> " + (results if len(outputs) == 1 else f"({results})")


def _allocate(operation: dict, tensors: tuple) -> list:
    """The results, uninitialised, by the declaration's rules: the same code on real and fake tensors."""
    device = tensors[operation["inputs"].index("x")].device
    specs = _operations.output_specs(operation, tensors, torch.float32)
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]


class _Signature(NamedTuple):
    shape: tuple
    dtype: torch.dtype


@functools.lru_cache(maxsize=256)
def _cached_specs(name: str, signature: tuple) -> tuple:
    return tuple(_operations.output_specs(OPERATIONS[name], [_Signature(*s) for s in signature], torch.float32))


def _allocate_on_the_cpu(name: str, tensors: tuple) -> list:
    """_allocate for real host tensors, the output rules read once per input signature (evaluating
    them in Python took 41 us a call at decode: docs/performance.md). Fake tensors take _allocate
    (their shapes may be symbolic)."""
    specs = _cached_specs(name, tuple((tuple(t.shape), t.dtype) for t in tensors))
    return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]


_extension_run = None


def _run_entry_point():
    """The extension's ``run``: an operation on host tensors (DLPack), outputs written in place."""
    global _extension_run
    if _extension_run is None:
        from mhc import _mhc_cpu

        _extension_run = _mhc_cpu.run
    return _extension_run


def _define(name: str, operation: dict):
    count = len(operation["inputs"])

    def allocate_only(*arguments):
        outputs = _allocate(operation, arguments[:count])
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def run_on_the_cpu(*arguments):
        tensors, config_scalars = arguments[:count], arguments[count:]
        outputs = _allocate_on_the_cpu(name, tensors)
        n = tensors[operation["inputs"].index("x")].shape[1]
        # tensor_parallel 1: torch's ops run on the whole D (the split forms see D / tensor_parallel as D)
        _run_entry_point()(name, list(tensors), outputs, n, *config_scalars, 1)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    library_op = torch.library.custom_op(
        f"mhc::{name}", run_on_the_cpu, mutates_args=(), device_types="cpu", schema=_schema(operation)
    )
    library_op.register_fake(allocate_only)
    return library_op


OPS = {name: _define(name, operation) for name, operation in OPERATIONS.items()}


def _param_grads_or_none(needs: tuple, grads) -> tuple:
    return tuple(g if need else None for g, need in zip(grads, needs, strict=True))


class PreFunction(torch.autograd.Function):
    """V4's pre: x [T, n, D] -> layer_in, x (handed on to the post), h_post, h_res."""

    @staticmethod
    def forward(ctx, config, x, *params):
        layer_in, _, h_post, h_res = OPS["pre_forward"](x, *params, *scalars(config))
        ctx.config = config
        ctx.save_for_backward(x, *params)
        return layer_in, x, h_post, h_res

    @staticmethod
    def backward(ctx, dlayer_in, dx_partial, dh_post, dh_res):
        x, *params = ctx.saved_tensors
        cotangents = [c.contiguous() for c in (dlayer_in, dx_partial, dh_post, dh_res)]
        dx, *grads = OPS["pre_backward"](*cotangents, x, *params, *scalars(ctx.config))
        return None, dx, *_param_grads_or_none(ctx.needs_input_grad[2:], grads)


def carried_operand(pre_apply: PreApply, xf: torch.Tensor, carried):
    """The carried operand of the V4.1 pre operations for a mode (CARRIED or ONE_HOT, from
    PreApply.of at the top of mhc.torch.pre), x flat [T, n, D]: the mix as [T, n], or for the
    one-hot an f32 [T, 0] tensor, the form the C++ operations take for it. Made here only."""
    if pre_apply is PreApply.CARRIED:
        return tokens(carried, 1)
    if pre_apply is not PreApply.ONE_HOT:
        raise ValueError(f"pre_apply: expected PreApply.CARRIED or PreApply.ONE_HOT, got {pre_apply!r}")
    return xf.new_zeros((xf.shape[0], 0), dtype=torch.float32)


class PreCarriedFunction(torch.autograd.Function):
    """V4.1's pre: x and the carried mix ([T, n], or [T, 0]: the one-hot) -> layer_in, x, h_pre, h_post, h_res."""

    @staticmethod
    def forward(ctx, config, x, carried, *params):
        layer_in, h_pre, h_post, h_res = OPS["pre_forward_carried"](x, carried, *params, *scalars(config))
        ctx.config = config
        ctx.save_for_backward(x, carried, *params)
        return layer_in, x, h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, dlayer_in, dx_partial, dh_pre, dh_post, dh_res):
        x, carried, *params = ctx.saved_tensors
        cotangents = [c.contiguous() for c in (dlayer_in, dx_partial, dh_pre, dh_post, dh_res)]
        op = OPS["pre_backward_carried"]
        dx, dcarried, *grads = op(*cotangents, x, carried, *params, *scalars(ctx.config))
        return None, dx, dcarried, *_param_grads_or_none(ctx.needs_input_grad[3:], grads)


class PostFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, config, x, layer_out, h_post, h_res):
        ctx.config = config
        ctx.save_for_backward(x, layer_out, h_post, h_res)
        return OPS["post_forward"](x, layer_out, h_post, h_res, *scalars(config))

    @staticmethod
    def backward(ctx, g):
        dx_partial, dlayer_out, dh_post, dh_res = OPS["post_backward"](
            g.contiguous(), *ctx.saved_tensors, *scalars(ctx.config)
        )
        return None, dx_partial, dlayer_out, dh_post, dh_res


class BoundaryFunction(torch.autograd.Function):
    """V4's fused post of one sublayer and pre of the next: -> layer_in, x_next, h_post, h_res (the next's)."""

    @staticmethod
    def forward(ctx, config, x, layer_out, h_post, h_res, *params):
        x_next, layer_in, _, next_h_post, next_h_res = OPS["boundary_forward"](
            x, layer_out, h_post, h_res, *params, *scalars(config)
        )
        ctx.config = config
        ctx.save_for_backward(x, layer_out, h_post, h_res, *params)
        return layer_in, x_next, next_h_post, next_h_res

    @staticmethod
    def backward(ctx, dlayer_in, dx_next, dh_post, dh_res):
        x, layer_out, h_post, h_res, *params = ctx.saved_tensors
        cotangents = [c.contiguous() for c in (dlayer_in, dx_next, dh_post, dh_res)]
        op = OPS["boundary_backward"]
        dx, dlayer_out, dh_post_in, dh_res_in, *grads = op(
            *cotangents, x, layer_out, h_post, h_res, *params, *scalars(ctx.config)
        )
        return None, dx, dlayer_out, dh_post_in, dh_res_in, *_param_grads_or_none(ctx.needs_input_grad[5:], grads)


class BoundaryCarriedFunction(torch.autograd.Function):
    """V4.1's boundary: the next pre reads h_pre (this sublayer's gates) as its carried mix."""

    @staticmethod
    def forward(ctx, config, x, layer_out, h_pre, h_post, h_res, *params):
        x_next, layer_in, next_h_pre, next_h_post, next_h_res = OPS["boundary_forward_carried"](
            x, layer_out, h_pre, h_post, h_res, *params, *scalars(config)
        )
        ctx.config = config
        ctx.save_for_backward(x, layer_out, h_pre, h_post, h_res, *params)
        return layer_in, x_next, next_h_pre, next_h_post, next_h_res

    @staticmethod
    def backward(ctx, dlayer_in, dx_next, dh_pre, dh_post, dh_res):
        x, layer_out, h_pre, h_post, h_res, *params = ctx.saved_tensors
        cotangents = [c.contiguous() for c in (dlayer_in, dx_next, dh_pre, dh_post, dh_res)]
        op = OPS["boundary_backward_carried"]
        dx, dlayer_out, dh_post_in, dh_res_in, dh_pre_in, *grads = op(
            *cotangents, x, layer_out, h_pre, h_post, h_res, *params, *scalars(ctx.config)
        )
        param_grads = _param_grads_or_none(ctx.needs_input_grad[6:], grads)
        return None, dx, dlayer_out, dh_pre_in, dh_post_in, dh_res_in, *param_grads


class HeadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, config, x, fn, base, scale):
        out, _ = OPS["head_forward"](x, fn, base, scale, *scalars(config))
        ctx.config = config
        ctx.save_for_backward(x, fn, base, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        dx, *grads = OPS["head_backward"](dout.contiguous(), *ctx.saved_tensors, *scalars(ctx.config))
        return None, dx, *_param_grads_or_none(ctx.needs_input_grad[2:], grads)


class CollapseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, config, x, carried):
        ctx.config = config
        ctx.save_for_backward(x, carried)
        return OPS["collapse_forward"](x, carried, *scalars(config))

    @staticmethod
    def backward(ctx, dout):
        dx, dcarried = OPS["collapse_backward"](dout.contiguous(), *ctx.saved_tensors, *scalars(ctx.config))
        return None, dx, dcarried


def tokens(tensor: torch.Tensor, trailing: int) -> torch.Tensor:
    """The tensor with its leading axes (all but the last ``trailing``) flattened into one (a view)."""
    lead = tensor.shape[: tensor.dim() - trailing]
    return tensor.reshape((math.prod(lead), *tensor.shape[tensor.dim() - trailing :]))

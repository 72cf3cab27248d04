"""The C++ operations as torch custom ops (namespace ``mhc``), and the autograd that joins them.

Every operation is one row of ``OPERATIONS``: its operands and its results with their shape and
dtype rules, in the order of ``include/mhc/ops.h``. From a row come, with no per-operation code:
the op's schema, its CPU implementation (allocate the results, call the extension's
``run(name, inputs, outputs, ...)`` over DLPack, GIL released) and its fake (meta) implementation,
the same allocation on FakeTensors, which is all that ``torch.compile`` needs to trace it.

Shapes: T tokens, n streams, D features; N = phi's columns; ``like:<operand>`` is that operand's
shape (a parameter's gradient, an absent carried mix of shape [T, 0]). Dtypes: ``f32``, or an
operand's name for its dtype (``x``: activations follow x, ``layer_out``: its gradient follows it).

The autograd is one ``torch.autograd.Function`` per sublayer role (pre, boundary, post, head,
collapse, V4 and V4.1), not ``register_autograd`` on each op: pre and boundary hand their input
streams on to the next post as an output of their own (``Context.x``), so the post's gradient of
the streams (dx_partial) arrives in the pre's backward as that output's cotangent and enters
``pre_backward`` whole, as in mhc.jax's custom VJPs. A custom op may not return an alias of its
input; with the streams used by two ops, autograd would add the two gradients in x's dtype (in
bf16, rounding twice where the kernel rounds once).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mhc._config import Config

_PARAMS = ("norm_weight", "phi", "alpha", "bias")
_PARAM_GRADS = tuple((f"d{name}", f"like:{name}", "f32") for name in _PARAMS)
_HEAD_PARAMS = ("fn", "base", "scale")
_HEAD_GRADS = tuple((f"d{name}", f"like:{name}", "f32") for name in _HEAD_PARAMS)
_PRE_OUTPUTS = (("layer_in", "T D", "x"), ("h_pre", "T n", "f32"), ("h_post", "T n", "f32"), ("h_res", "T n n", "f32"))
_POST_GRADS = (
    ("dx_partial", "T n D", "x"),
    ("dlayer_out", "T D", "layer_out"),
    ("dh_post", "T n", "f32"),
    ("dh_res", "T n n", "f32"),
)
_NEXT_COTANGENTS = ("next_dlayer_in", "next_dx_partial")


class Operation(NamedTuple):
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, str, str], ...]  # (name, shape rule, dtype rule)


OPERATIONS = {
    "pre_forward": Operation(("x", *_PARAMS), _PRE_OUTPUTS),
    "pre_backward": Operation(
        ("dlayer_in", "dx_partial", "dh_post", "dh_res", "x", *_PARAMS), (("dx", "T n D", "x"), *_PARAM_GRADS)
    ),
    "post_forward": Operation(("x", "layer_out", "h_post", "h_res"), (("out", "T n D", "x"),)),
    "post_backward": Operation(("g", "x", "layer_out", "h_post", "h_res"), _POST_GRADS),
    "boundary_forward": Operation(
        ("x", "layer_out", "h_post", "h_res", *_PARAMS), (("x_next", "T n D", "x"), *_PRE_OUTPUTS)
    ),
    "boundary_backward": Operation(
        (*_NEXT_COTANGENTS, "next_dh_post", "next_dh_res", "x", "layer_out", "h_post", "h_res", *_PARAMS),
        (*_POST_GRADS, *_PARAM_GRADS),
    ),
    "head_forward": Operation(("x", *_HEAD_PARAMS), (("out", "T D", "x"), ("gates", "T n", "f32"))),
    "head_backward": Operation(("dout", "x", *_HEAD_PARAMS), (("dx", "T n D", "x"), *_HEAD_GRADS)),
    "pre_forward_carried": Operation(("x", "carried", *_PARAMS), _PRE_OUTPUTS),
    "pre_backward_carried": Operation(
        ("dlayer_in", "dx_partial", "dh_pre", "dh_post", "dh_res", "x", "carried", *_PARAMS),
        (("dx", "T n D", "x"), ("dcarried", "like:carried", "f32"), *_PARAM_GRADS),
    ),
    "collapse_forward": Operation(("x", "carried"), (("out", "T D", "x"),)),
    "collapse_backward": Operation(("dout", "x", "carried"), (("dx", "T n D", "x"), ("dcarried", "T n", "f32"))),
    "boundary_forward_carried": Operation(
        ("x", "layer_out", "h_pre", "h_post", "h_res", *_PARAMS), (("x_next", "T n D", "x"), *_PRE_OUTPUTS)
    ),
    "boundary_backward_carried": Operation(
        (*_NEXT_COTANGENTS, "next_dh_pre", "next_dh_post", "next_dh_res", "x", "layer_out", "h_pre", "h_post", "h_res")
        + _PARAMS,
        (*_POST_GRADS, ("dh_pre", "T n", "f32"), *_PARAM_GRADS),
    ),
}

# The config's scalars, the trailing arguments of every op (n comes from x's shape).
_SCALARS = (("mix", "str"), ("sinkhorn_iters", "int"), ("sinkhorn_eps", "float"), ("rms_eps", "float"))
_SCALARS += (("pre_eps", "float"), ("post_scale", "float"))


def scalars(config: Config) -> tuple:
    return tuple(getattr(config, name) for name, _ in _SCALARS)


def _schema(operation: Operation) -> str:
    arguments = [f"Tensor {name}" for name in operation.inputs] + [f"{kind} {name}" for name, kind in _SCALARS]
    results = ", ".join("Tensor" for _ in operation.outputs)
    return f"({', '.join(arguments)}) -> " + (results if len(operation.outputs) == 1 else f"({results})")


def _allocate(operation: Operation, tensors: tuple) -> list:
    """The results, uninitialised, by the row's rules: the same code on real and fake tensors."""
    named = dict(zip(operation.inputs, tensors, strict=True))
    t, n, d = named["x"].shape
    sizes = {"T": t, "n": n, "D": d}
    outputs = []
    for _, shape, dtype in operation.outputs:
        if shape.startswith("like:"):
            dims = named[shape.removeprefix("like:")].shape
        else:
            dims = tuple(sizes[axis] for axis in shape.split())
        kind = torch.float32 if dtype == "f32" else named[dtype].dtype
        outputs.append(torch.empty(dims, dtype=kind, device=named["x"].device))
    return outputs


_extension_run = None


def _run_entry_point():
    """The extension's ``run`` (issue 37's operation table), checked once against OPERATIONS."""
    global _extension_run
    if _extension_run is None:
        from mhc import _mhc_cpu

        if not hasattr(_mhc_cpu, "run"):
            raise RuntimeError(
                "mhc.torch: the compiled extension mhc._mhc_cpu has no run() entry point (the operation table "
                "of issue 37); rebuild the package from a tree that has it"
            )
        if hasattr(_mhc_cpu, "operations"):
            _check_against_the_table(_mhc_cpu.operations())
        _extension_run = _mhc_cpu.run
    return _extension_run


def _check_against_the_table(declared) -> None:
    """Every op here exists in the C++ table with the same operand and result counts."""
    table = {}
    for row in declared:
        name = row["name"].removeprefix("mhc_")
        table[name] = row
    for name, operation in OPERATIONS.items():
        row = table.get(name)
        if row is None:
            raise RuntimeError(f"mhc.torch: operation {name!r} is not in the extension's operations()")
        counts = (len(row.get("inputs", ())), len(row.get("outputs", ())))
        if counts != (len(operation.inputs), len(operation.outputs)):
            raise RuntimeError(
                f"mhc.torch: operation {name!r} takes {counts[0]} operands and writes {counts[1]} results in the "
                f"extension, {len(operation.inputs)} and {len(operation.outputs)} in mhc.torch"
            )


def _define(name: str, operation: Operation):
    count = len(operation.inputs)

    def allocate_only(*arguments):
        outputs = _allocate(operation, arguments[:count])
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def run_on_the_cpu(*arguments):
        tensors, (mix, iters, sinkhorn_eps, rms_eps, pre_eps, post_scale) = arguments[:count], arguments[count:]
        outputs = _allocate(operation, tensors)
        n = tensors[operation.inputs.index("x")].shape[1]
        run = _run_entry_point()
        run(name, list(tensors), outputs, n, mix, iters, sinkhorn_eps, rms_eps, pre_eps, post_scale, 1)
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

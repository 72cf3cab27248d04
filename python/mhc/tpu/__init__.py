"""Pallas TPU kernels for mHC (a backend beside the CPU and CUDA ones). Every kernel is unverified
on TPU hardware: each is checked in TPU interpret mode against the float64 reference, lowered to
Mosaic, and compiled for v5e/v6e through libtpu's compile-only topologies, never run on a chip.

The functions take and return the flat shapes of mhc.jax's kernel calls (x [T, n, D], Params with
norm_weight [n D] and phi [n D, N]), so that a dispatch can swap them in.

KERNELS is the one place that says which operations this backend has: it maps the name of the C++
backends' FFI target to a function taking the same operands in the same order,
``kernel(config, *operands, interpret=None)`` (the split forms' finishes, TAKES_SLICES, also
``slices=``: the devices D is split over), and returning the same results. The dispatch in
mhc.jax reads it, so a kernel added here is used on a TPU with no other change."""

from mhc._config import HeadParams, Params
from mhc.tpu._boundary import (
    boundary_backward,
    boundary_backward_carried,
    boundary_forward,
    boundary_forward_carried,
)
from mhc.tpu._collapse import collapse_backward, collapse_forward
from mhc.tpu._head import head_backward, head_forward
from mhc.tpu._layout import TOKEN_TILES
from mhc.tpu._post import post_backward, post_forward
from mhc.tpu._pre import pre_forward, pre_forward_carried
from mhc.tpu._pre_backward import pre_backward, pre_backward_carried
from mhc.tpu._split import (
    pre_backward_finish,
    pre_backward_finish_carried,
    pre_backward_partials,
    pre_forward_finish,
    pre_forward_finish_carried,
    pre_forward_partials,
)


def _flat_parameters(kernel, parameters=Params):
    """``kernel(config, *operands, parameters, interpret=None)`` as the FFI targets call it: the
    parameters passed flat, their fields last (norm_weight, phi, alpha, bias; fn, base, scale)."""
    count = len(parameters._fields)

    def target(config, *operands, interpret=None, **options):
        return kernel(config, *operands[:-count], parameters(*operands[-count:]), interpret=interpret, **options)

    return target


KERNELS = {
    "mhc_pre_forward": _flat_parameters(pre_forward),
    "mhc_post_forward": post_forward,
    "mhc_post_backward": post_backward,
    "mhc_boundary_forward": _flat_parameters(boundary_forward),
    "mhc_pre_backward": _flat_parameters(pre_backward),
    "mhc_head_forward": _flat_parameters(head_forward, HeadParams),
    "mhc_head_backward": _flat_parameters(head_backward, HeadParams),
    "mhc_boundary_backward": _flat_parameters(boundary_backward),
    # DeepSeek-V4.1's carried mix (spec: Single-pass schedule).
    "mhc_pre_forward_carried": _flat_parameters(pre_forward_carried),
    "mhc_pre_backward_carried": _flat_parameters(pre_backward_carried),
    "mhc_collapse_forward": collapse_forward,
    "mhc_collapse_backward": collapse_backward,
    "mhc_boundary_forward_carried": _flat_parameters(boundary_forward_carried),
    "mhc_boundary_backward_carried": _flat_parameters(boundary_backward_carried),
    # The split forms (D split over devices: spec, Tensor parallelism): partials, the caller's
    # all-reduce, finish.
    "mhc_pre_forward_partials": pre_forward_partials,
    "mhc_pre_forward_finish": pre_forward_finish,
    "mhc_pre_forward_finish_carried": pre_forward_finish_carried,
    "mhc_pre_backward_partials": pre_backward_partials,
    "mhc_pre_backward_finish": _flat_parameters(pre_backward_finish),
    "mhc_pre_backward_finish_carried": _flat_parameters(pre_backward_finish_carried),
}

TAKES_SLICES = frozenset(
    {
        "mhc_pre_forward_finish",
        "mhc_pre_forward_finish_carried",
        "mhc_pre_backward_finish",
        "mhc_pre_backward_finish_carried",
    }
)
"""The KERNELS that take ``slices=`` (the devices D is split over: the RMS mean is over the whole
n D), which the dispatch passes them."""

__all__ = [
    "KERNELS",
    "TAKES_SLICES",
    "TOKEN_TILES",
    "boundary_backward",
    "boundary_backward_carried",
    "boundary_forward",
    "boundary_forward_carried",
    "collapse_backward",
    "collapse_forward",
    "head_backward",
    "head_forward",
    "post_backward",
    "post_forward",
    "pre_backward",
    "pre_backward_carried",
    "pre_backward_finish",
    "pre_backward_finish_carried",
    "pre_backward_partials",
    "pre_forward",
    "pre_forward_carried",
    "pre_forward_finish",
    "pre_forward_finish_carried",
    "pre_forward_partials",
]

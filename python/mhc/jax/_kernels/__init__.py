"""The C++ operations as JAX primitives: ffi_call wrappers and the custom VJPs around them.

The ffi_call wrappers take flat shapes, x [T, n, D]. The custom VJPs take x with any leading
(token) dims and run the calls through partitioned operations (_partitioning), so that under jit
on a mesh each device runs them on its own shards.

pre's custom VJP returns x itself as an extra output (the context's copy). post's backward sends
its dx_partial back along that output, so pre's backward receives it as a cotangent and the C++
pre_backward adds it while it writes dx: no separate pass to sum the two paths of dx.

The package is split by operation family, as the backends are: ``pre``, ``post``, ``boundary``,
``head``, ``collapse``, each with its kernel calls, per-device functions, partitioned operations
(``Operation``) and custom VJPs, over ``dispatch``, which they share (see its docstring).
"""

from mhc.jax._kernels.boundary import (
    BOUNDARY_BACKWARD,
    BOUNDARY_BACKWARD_CARRIED,
    BOUNDARY_FORWARD,
    BOUNDARY_FORWARD_CARRIED,
    boundary,
    boundary_carried,
)
from mhc.jax._kernels.collapse import COLLAPSE_BACKWARD, COLLAPSE_FORWARD, collapse
from mhc.jax._kernels.dispatch import (
    FALLBACK_CHOICES,
    RESIDUAL_COEFFICIENTS,
    RESIDUAL_LAYER_OUT,
    RESIDUAL_NAMES,
    RESIDUAL_PARTIALS,
    RESIDUAL_X,
    _check_platform_p,
    carried_operand,
    on_common_manual_axes,
    registered_targets,
    varies_over,
)
from mhc.jax._kernels.head import HEAD_BACKWARD, HEAD_FORWARD, head, head_gathering_features
from mhc.jax._kernels.post import POST_BACKWARD, POST_FORWARD, post, post_backward, post_forward
from mhc.jax._kernels.pre import (
    PRE_BACKWARD,
    PRE_BACKWARD_CARRIED,
    PRE_FORWARD,
    PRE_FORWARD_CARRIED,
    pre,
    pre_backward,
    pre_backward_partials,
    pre_carried,
    pre_forward,
    pre_forward_partials,
)

OPERATIONS = (
    PRE_FORWARD,
    PRE_BACKWARD,
    POST_FORWARD,
    POST_BACKWARD,
    BOUNDARY_FORWARD,
    BOUNDARY_BACKWARD,
    HEAD_FORWARD,
    HEAD_BACKWARD,
    PRE_FORWARD_CARRIED,
    PRE_BACKWARD_CARRIED,
    COLLAPSE_FORWARD,
    COLLAPSE_BACKWARD,
    BOUNDARY_FORWARD_CARRIED,
    BOUNDARY_BACKWARD_CARRIED,
)
PARTITIONED_TARGETS = frozenset(
    target for operation in OPERATIONS for target in operation.targets + operation.split_targets
)
"""Every FFI target the JAX package calls; tests check it covers every registered target."""

__all__ = [
    "BOUNDARY_BACKWARD",
    "BOUNDARY_BACKWARD_CARRIED",
    "BOUNDARY_FORWARD",
    "BOUNDARY_FORWARD_CARRIED",
    "COLLAPSE_BACKWARD",
    "COLLAPSE_FORWARD",
    "FALLBACK_CHOICES",
    "HEAD_BACKWARD",
    "HEAD_FORWARD",
    "OPERATIONS",
    "PARTITIONED_TARGETS",
    "POST_BACKWARD",
    "POST_FORWARD",
    "PRE_BACKWARD",
    "PRE_BACKWARD_CARRIED",
    "PRE_FORWARD",
    "PRE_FORWARD_CARRIED",
    "RESIDUAL_COEFFICIENTS",
    "RESIDUAL_LAYER_OUT",
    "RESIDUAL_NAMES",
    "RESIDUAL_PARTIALS",
    "RESIDUAL_X",
    "_check_platform_p",
    "boundary",
    "boundary_carried",
    "carried_operand",
    "collapse",
    "head",
    "head_gathering_features",
    "on_common_manual_axes",
    "post",
    "post_backward",
    "post_forward",
    "pre",
    "pre_backward",
    "pre_backward_partials",
    "pre_carried",
    "pre_forward",
    "pre_forward_partials",
    "registered_targets",
    "varies_over",
]

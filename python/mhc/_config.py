"""The hyper-parameters and the parameter layouts every backend shares: Config, Params, HeadParams.

A module of its own, above both mhc.jax and mhc.tpu and importing neither (nor the C++
extension), so that the pure-Python TPU backend imports without the compiled CPU extension and
nothing imports back up: mhc.jax uses mhc.tpu's kernels, mhc.tpu only these types. It does not
import jax either: mhc.torch shares Config, and Params / HeadParams hold torch tensors there.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # the annotations only: mhc.torch imports this module without jax
    import jax

# The functional API every binding (mhc.jax, mhc.torch) exports, name for name: each binding's
# __all__ is these and its own extras.
BINDING_API = (
    "Config",
    "Context",
    "Params",
    "init_params",
    "HeadParams",
    "init_head_params",
    "head",
    "pre",
    "post",
    "boundary",
    "Pending",
    "Streams",
    "sublayer",
    "finish",
    "streams",
    "collapse",
    "stack",
    "expand",
    "reduce",
    "reference",
)
MIXES = ("sinkhorn", "permutations")
MAX_STREAMS = 16
MAX_PERMUTATION_STREAMS = 6


@dataclasses.dataclass(frozen=True)
class Config:
    """mHC hyper-parameters (spec: Shapes and names). Hashable, so it can be a static argument."""

    n: int
    mix: str = "sinkhorn"
    sinkhorn_iters: int = 20
    sinkhorn_eps: float = 1e-6
    rms_eps: float = 1e-6
    pre_eps: float = 1e-6
    post_scale: float = 2.0
    # DeepSeek-V4.1's single-pass schedule (its hc_pre_from_prev_sublayer; spec: Single-pass
    # schedule): the pre-apply reads the carried mix, the previous sublayer's h_pre.
    pre_from_previous: bool = False

    def __post_init__(self):
        if self.mix not in MIXES:
            raise ValueError(f"Config.mix: expected one of {MIXES}, got {self.mix!r}")
        limit = MAX_PERMUTATION_STREAMS if self.mix == "permutations" else MAX_STREAMS
        if not isinstance(self.n, (int, np.integer)) or not 1 <= self.n <= limit:
            raise ValueError(f"Config.n: expected an int in 1..{limit} for mix={self.mix!r}, got {self.n!r}")
        if not isinstance(self.sinkhorn_iters, (int, np.integer)) or not 1 <= self.sinkhorn_iters <= 10000:
            raise ValueError(f"Config.sinkhorn_iters: expected an int in 1..10000, got {self.sinkhorn_iters!r}")
        for name in ("sinkhorn_eps", "pre_eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Config.{name}: expected a finite value >= 0, got {value!r}")
        if not (math.isfinite(self.rms_eps) and self.rms_eps > 0):
            raise ValueError(f"Config.rms_eps: expected a finite value > 0, got {self.rms_eps!r}")
        if not math.isfinite(self.post_scale):
            raise ValueError(f"Config.post_scale: expected a finite value, got {self.post_scale!r}")
        if not isinstance(self.pre_from_previous, (bool, np.bool_)):
            raise ValueError(
                f"Config.pre_from_previous: expected a bool (True: DeepSeek-V4.1's carried mix), "
                f"got {self.pre_from_previous!r}"
            )

    def check_reads_carried(self) -> None:
        """A pre given a carried mix (the previous sublayer's h_pre): only V4.1's schedule reads one."""
        if not self.pre_from_previous:
            raise ValueError(
                "carried: a carried mix is read only by DeepSeek-V4.1's schedule; pass "
                "Config(..., pre_from_previous=True), or carried=None"
            )

    @property
    def residual_logits(self) -> int:
        """R: n*n for Sinkhorn, n! for permutations."""
        return self.n * self.n if self.mix == "sinkhorn" else math.factorial(self.n)

    @property
    def projection_width(self) -> int:
        """N = 2n + R: columns of phi."""
        return 2 * self.n + self.residual_logits


class PreApply(enum.Enum):
    """Which mix a pre's pre-apply reads (spec: Algorithm step 6, Single-pass schedule): the one
    value every layer passes, from a public call's arguments down to the kernels. Derived once, at
    the top of a public function (``PreApply.of``); the values are the C++ core's
    ``mhc::PreApply`` (include/mhc/config.h)."""

    OWN_GATES = 0  # DeepSeek-V4: the sublayer's own h_pre
    CARRIED = 1  # V4.1: a carried mix [..., n] f32, the previous sublayer's h_pre
    ONE_HOT = 2  # V4.1's first sublayer: the one-hot on stream 0 (layer_in = x[..., 0, :])

    @classmethod
    def of(cls, config: Config, carried) -> PreApply:
        """The mode of a pre with this config and ``carried=`` argument (None or a mix): own gates
        unless ``config.pre_from_previous``, then the carried mix, or the one-hot without one."""
        if not config.pre_from_previous:
            return cls.OWN_GATES
        return cls.ONE_HOT if carried is None else cls.CARRIED


class Params(NamedTuple):
    """mHC parameters, f32, layout as in the spec: phi's columns are [pre | post | res]."""

    norm_weight: jax.Array  # [n*D]
    phi: jax.Array  # [n*D, N]
    alpha: jax.Array  # [3]: (alpha_pre, alpha_post, alpha_res)
    bias: jax.Array  # [N]


class HeadParams(NamedTuple):
    """DeepSeek-V4's head (spec: Head), f32, as V4 stores it: fn is [n, M], not transposed."""

    fn: jax.Array  # [n, n*D]
    base: jax.Array  # [n]
    scale: jax.Array  # [1]

"""The parameters' initialisers, the context that pre hands to post, and argument checks
(Config, Params and HeadParams live in mhc._config, which the TPU backend shares).

Every check here runs at trace time, before any custom call, and raises ValueError (bad shape or
value) or TypeError (bad dtype) naming the argument.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mhc._config import Config, HeadParams, Params
from mhc._errors import names_its_errors  # noqa: F401  (mhc.jax's modules import it from here)


def init_params(key: jax.Array, config: Config, dim: int) -> Params:
    """alpha 0.01, bias 0, norm_weight 1, phi ~ N(0, 1/(n*D)); dim is D, the features per stream."""
    m = config.n * dim
    phi = jax.random.normal(key, (m, config.projection_width), jnp.float32) / math.sqrt(m)
    return Params(
        norm_weight=jnp.ones((m,), jnp.float32),
        phi=phi,
        alpha=jnp.full((3,), 0.01, jnp.float32),
        bias=jnp.zeros((config.projection_width,), jnp.float32),
    )


def init_head_params(key: jax.Array, config: Config, dim: int) -> HeadParams:
    """scale 0.01, base 0, fn ~ N(0, 1/(n*D)): every gate starts near 1/2 (out ~ half the sum); dim is D."""
    m = config.n * dim
    return HeadParams(
        fn=jax.random.normal(key, (config.n, m), jnp.float32) / math.sqrt(m),
        base=jnp.zeros((config.n,), jnp.float32),
        scale=jnp.full((1,), 0.01, jnp.float32),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """What post and the backward need from pre: the streams and the post/res coefficients.

    x [..., n, D] (x's dtype), h_post [..., n] and h_res [..., n, n] (f32). `config`, `use_kernel`
    and `tensor_axis` are static, so post runs the same path as the pre that made the context.
    h_pre [..., n] (f32): with ``config.pre_from_previous`` (V4.1) this sublayer's pre gates, the
    mix the next sublayer's pre (or ``collapse``) reads; None in V4, whose pre used them itself.
    """

    x: jax.Array
    h_post: jax.Array
    h_res: jax.Array
    config: Config = dataclasses.field(metadata=dict(static=True))
    use_kernel: bool = dataclasses.field(metadata=dict(static=True))
    # Inside jax.shard_map, the mesh axis that splits D (pre's tensor_axis): post's backward sums
    # over it.
    tensor_axis: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    h_pre: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pending:
    """The streams between two sublayers with the first one's post not yet applied: its
    layer_out [..., D] and its Context. ``mhc.jax.sublayer`` fuses it into the next sublayer's
    pre; ``mhc.jax.finish`` applies it."""

    layer_out: jax.Array
    ctx: Context


class Streams(NamedTuple):
    """The streams between two sublayers with every post applied: x [..., n, D] and, in V4.1
    (``Config.pre_from_previous``), the carried mix [..., n] f32 that the next sublayer's pre reads
    (None: the one-hot on stream 0, as at the first sublayer; always None in V4).
    ``mhc.jax.streams`` makes one from a chain's state; a caller may change x (V4.1's Engram adds
    to every stream there) and pass ``Streams(new_x, carried)`` on to ``mhc.jax.sublayer``."""

    x: jax.Array
    carried: jax.Array | None = None


ACTIVATION_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_activation(name: str, array, expected_shape=None) -> None:
    if jnp.dtype(array.dtype) not in ACTIVATION_DTYPES:
        raise TypeError(f"{name}: expected dtype float32 or bfloat16, got {array.dtype}")
    if expected_shape is not None and tuple(array.shape) != tuple(expected_shape):
        raise ValueError(f"{name}: expected shape {tuple(expected_shape)}, got {tuple(array.shape)}")


def _check_call(x, params, params_type, config: Config) -> None:
    """The config and params types and x's dtype, as every operation checks them first."""
    if not isinstance(config, Config):
        raise TypeError(f"config: expected mhc.jax.Config, got {type(config).__name__}")
    if not isinstance(params, params_type):
        raise TypeError(f"params: expected mhc.jax.{params_type.__name__}, got {type(params).__name__}")
    check_activation("x", x)


def _check_f32_params(params, expected: dict, context: str) -> None:
    """Each field of params float32 with the shape in ``expected``; ``context`` names the sizes."""
    for name, shape in expected.items():
        value = getattr(params, name)
        if jnp.dtype(value.dtype) != jnp.dtype(jnp.float32):
            raise TypeError(f"params.{name}: expected dtype float32, got {value.dtype}")
        if tuple(value.shape) != shape:
            raise ValueError(f"params.{name}: expected shape {shape} for {context}, got {tuple(value.shape)}")


def check_pre_args(x, params: Params, config: Config) -> None:
    _check_call(x, params, Params, config)
    if x.ndim < 2:
        raise ValueError(f"x: expected shape [..., n, D] with rank >= 2, got {tuple(x.shape)}")
    n, d = x.shape[-2], x.shape[-1]
    if n != config.n:
        raise ValueError(f"x: expected {config.n} streams (config.n) in axis -2, got shape {tuple(x.shape)}")
    if d < 1:
        raise ValueError(f"x: expected D >= 1 in the last axis, got shape {tuple(x.shape)}")
    m, width = n * d, config.projection_width
    expected = {"norm_weight": (m,), "phi": (m, width), "alpha": (3,), "bias": (width,)}
    _check_f32_params(params, expected, f"n={n}, D={d}, mix={config.mix!r}")


def check_carried(carried, x, config: Config) -> None:
    """The carried mix of V4.1's pre: None, or f32 [..., n] with x's leading axes."""
    if carried is None:
        return
    config.check_reads_carried()
    if not hasattr(carried, "dtype") or not hasattr(carried, "shape"):
        raise TypeError(f"carried: expected an array [..., n] (float32), got {type(carried).__name__}")
    if jnp.dtype(carried.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"carried: expected dtype float32 (the previous sublayer's h_pre), got {carried.dtype}")
    expected = tuple(x.shape[:-2]) + (config.n,)
    if tuple(carried.shape) != expected:
        raise ValueError(f"carried: expected shape {expected} (x's leading axes, config.n), got {tuple(carried.shape)}")


def check_collapse_args(x, carried) -> None:
    """V4.1's collapse: x [..., n, D] and the carried mix f32 [..., n]."""
    check_activation("x", x)
    if x.ndim < 2 or x.shape[-1] < 1:
        raise ValueError(f"x: expected shape [..., n, D] with rank >= 2 and D >= 1, got {tuple(x.shape)}")
    if jnp.dtype(carried.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"carried: expected dtype float32 (the last sublayer's h_pre), got {carried.dtype}")
    if tuple(carried.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"carried: expected shape {tuple(x.shape[:-1])} (x's leading axes, n), got {tuple(carried.shape)}"
        )


def check_head_args(x, params: HeadParams, config: Config) -> None:
    _check_call(x, params, HeadParams, config)
    if x.ndim < 2 or x.shape[-2] != config.n or x.shape[-1] < 1:
        raise ValueError(f"x: expected shape [..., {config.n}, D] (config.n streams, D >= 1), got {tuple(x.shape)}")
    n, d = config.n, x.shape[-1]
    _check_f32_params(params, {"fn": (n, n * d), "base": (n,), "scale": (1,)}, f"n={n}, D={d}")


def check_post_args(layer_out, ctx: Context) -> None:
    if not isinstance(ctx, Context):
        raise TypeError(f"ctx: expected the Context returned by mhc.jax.pre, got {type(ctx).__name__}")
    check_activation("layer_out", layer_out, ctx.x.shape[:-2] + ctx.x.shape[-1:])

"""Pallas TPU kernels for mHC (a backend beside the CPU and CUDA ones; not yet dispatched to by
mhc.jax). Every kernel is unverified on TPU hardware: each is checked in TPU interpret mode
against the float64 reference, lowered to Mosaic, and compiled for v5e/v6e through libtpu's
compile-only topologies, never run on a chip.

The functions take and return the flat shapes of mhc.jax's kernel calls (x [T, n, D], Params with
norm_weight [n D] and phi [n D, N]), so that a dispatch can swap them in."""

from mhc.tpu._layout import TOKEN_TILES
from mhc.tpu._post import post_backward, post_forward
from mhc.tpu._pre import pre_forward

__all__ = ["TOKEN_TILES", "post_backward", "post_forward", "pre_forward"]

"""Stability diagnostics of a trained mHC model (spec: Amax gain)."""

from __future__ import annotations

import numpy as np


def amax_gain(h_res_per_layer) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward Amax gain of the composite residual mix at every depth.

    Args:
      h_res_per_layer: the H_res of each mHC sublayer in depth order, shape [L, T, n, n] (or a
        list of [T, n, n]); first index input stream i, second output stream j. The Flax layers
        sow them (``sow_mixes``; ``nnx.view`` turns it on, ``nnx.capture`` collects them):
        ``mhc.models.Transformer.residual_mixes`` returns a model's in this layout.

    One sublayer maps the streams by A = H_res^T, so depth l composes C_l = A_l ... A_1 per token.
    Forward gain: the largest absolute row sum of C_l; backward gain: the largest absolute column
    sum. Returns (forward [L], backward [L]), each the mean over the T tokens.
    """
    h = np.asarray(h_res_per_layer, np.float64)
    if h.ndim != 4 or h.shape[-1] != h.shape[-2]:
        raise ValueError(f"h_res_per_layer: expected shape [L, T, n, n], got {h.shape}")
    depth, tokens, n, _ = h.shape
    composite = np.broadcast_to(np.eye(n), (tokens, n, n)).copy()
    forward, backward = np.empty(depth), np.empty(depth)
    for layer in range(depth):
        composite = np.swapaxes(h[layer], -1, -2) @ composite
        forward[layer] = np.abs(composite).sum(axis=-1).max(axis=-1).mean()
        backward[layer] = np.abs(composite).sum(axis=-2).max(axis=-1).mean()
    return forward, backward

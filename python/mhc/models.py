"""A small decoder-only byte-level transformer whose residual stream is plain, mHC (Sinkhorn) or
mHC-lite (permutations), for the demo and for experiments.

embedding -> expand to n streams -> L blocks (attention and MLP sublayers, each wrapped by
ManifoldConstrainedHyperConnections) -> reduce -> final RMSNorm -> logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mhc import jax as mhc_jax
from mhc.flax import ManifoldConstrainedHyperConnections

RESIDUALS = ("plain", "mhc", "mhc-lite")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256  # bytes
    width: int = 128
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    residual: str = "mhc"  # plain | mhc (Sinkhorn) | mhc-lite (permutations)
    n: int = 4  # streams of the mHC residual
    use_kernel: bool = True  # fused C++ kernels, or the plain-JAX reference path
    fuse_boundaries: bool = True  # each post fused with the next sublayer's pre, or run whole

    def __post_init__(self):
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual: expected one of {RESIDUALS}, got {self.residual!r}")
        if self.width % self.heads:
            raise ValueError(f"width: expected a multiple of heads={self.heads}, got {self.width}")

    def mhc_config(self) -> mhc_jax.Config:
        return mhc_jax.Config(n=self.n, mix="sinkhorn" if self.residual == "mhc" else "permutations")


class CausalSelfAttention(nnx.Module):
    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.qkv = nnx.Linear(width, 3 * width, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(width, width, use_bias=False, rngs=rngs)

    def __call__(self, h):
        batch, seq, width = h.shape
        q, k, v = jnp.split(self.qkv(h).reshape(batch, seq, 3 * self.heads, width // self.heads), 3, axis=2)
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.reshape(batch, seq, width))


class MLP(nnx.Module):
    def __init__(self, width: int, ratio: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(width, ratio * width, rngs=rngs)
        self.down = nnx.Linear(ratio * width, width, rngs=rngs)

    def __call__(self, h):
        return self.down(jax.nn.gelu(self.up(h)))


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        width = config.width
        self.attn_norm = nnx.RMSNorm(width, rngs=rngs)
        self.attn = CausalSelfAttention(width, config.heads, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(width, rngs=rngs)
        self.mlp = MLP(width, config.mlp_ratio, rngs=rngs)
        self.plain = config.residual == "plain"
        self.fuse_boundaries = config.fuse_boundaries
        if not self.plain:
            hc = config.mhc_config()
            self.attn_hc = ManifoldConstrainedHyperConnections(hc, width, use_kernel=config.use_kernel, rngs=rngs)
            self.mlp_hc = ManifoldConstrainedHyperConnections(hc, width, use_kernel=config.use_kernel, rngs=rngs)

    def __call__(self, x):
        """x: the hidden state [batch, seq, width] (plain), or for mHC the streams [batch, seq, n,
        width] or the previous block's ``mhc.jax.Pending``, which this block returns in turn: each
        post is fused with the next sublayer's pre (end the stack with ``mhc.jax.finish``)."""
        if self.plain:
            x = x + self.attn(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))
        if not self.fuse_boundaries:
            x = self.attn_hc(self.attn_norm, self.attn, x)
            return self.mlp_hc(self.mlp_norm, self.mlp, x)
        state = self.attn_hc.chain(self.attn_norm, self.attn, x)
        return self.mlp_hc.chain(self.mlp_norm, self.mlp, state)

    def hyper_connections(self):
        return [] if self.plain else [self.attn_hc, self.mlp_hc]


class Transformer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab, config.width, rngs=rngs)
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.layers)])
        self.final_norm = nnx.RMSNorm(config.width, rngs=rngs)
        self.head = nnx.Linear(config.width, config.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        """tokens [batch, seq] int -> logits [batch, seq, vocab]."""
        h = self.embed(tokens)
        if self.config.residual == "plain":
            for block in self.blocks:
                h = block(h)
        else:
            state = mhc_jax.expand(h, self.config.n)
            for block in self.blocks:
                state = block(state)
            h = mhc_jax.reduce(mhc_jax.finish(state))
        return self.head(self.final_norm(h))

    def residual_mixes(self, tokens) -> np.ndarray:
        """H_res of every mHC sublayer in depth order, [2L, batch*seq, n, n] (empty for plain)."""
        layers = [hc for block in self.blocks for hc in block.hyper_connections()]
        if not layers:
            return np.zeros((0, 0, 0, 0))
        mixes = []
        for hc in layers:
            hc.on_mix = lambda h_res: mixes.append(np.asarray(h_res))
        try:
            self(tokens)
        finally:
            for hc in layers:
                hc.on_mix = None
        n = self.config.n
        return np.stack([m.reshape(-1, n, n) for m in mixes])


def loss_fn(model: Transformer, tokens, targets):
    logits = model(tokens)
    return cross_entropy(logits, targets)


def cross_entropy(logits, targets):
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))

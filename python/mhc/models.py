"""A small DeepSeek-V4-shaped decoder-only byte-level transformer for the demo and for experiments,
whose residual is one of five kinds (``ModelConfig.residual``):

- ``plain``: one residual stream, ``h + F(norm(h))``;
- ``hc``: unconstrained dynamic hyper-connections (Zhu et al., 2024, arXiv 2409.19606), the
  baseline that mHC fixes (``HyperConnections``, plain JAX);
- ``mhc``: mHC, H_res doubly stochastic by Sinkhorn (``mhc.flax.ManifoldConstrainedHyperConnections``);
- ``mhc-lite``: mHC with H_res a convex mix of permutations;
- ``mhc-v4.1``: DeepSeek-V4.1's structure (spec: Single-pass schedule): Sinkhorn mHC whose every
  sublayer reads its input with the previous sublayer's pre gates (the first: stream 0), and whose
  streams end in the collapse by the last sublayer's pre gates (``mhc.jax.collapse``), no head.

With n streams (every kind but plain): embedding -> ``mhc.jax.expand`` to n streams -> L blocks of
(attention sublayer, MLP sublayer), each sublayer wrapped by the residual's connections -> the
collapse of the n streams into one (``ModelConfig.collapse``: DeepSeek-V4's learned head
``mhc.flax.Head``, the plain sum ``mhc.jax.reduce``, or, for ``mhc-v4.1`` only, V4.1's carried
collapse) -> final RMSNorm -> logits.

Every multi-stream kind sows its H_res per sublayer when asked (``sow_mixes``, turned on by
``nnx.view``), and ``Transformer.residual_mixes`` collects them with ``nnx.capture`` (in the spec's
orientation: first index input stream i, second output stream j), for the Amax gain.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mhc import jax as mhc_jax
from mhc.flax import Head, ManifoldConstrainedHyperConnections, stack

RESIDUALS = ("plain", "hc", "mhc", "mhc-lite", "mhc-v4.1")
# The residuals that run mhc.flax's layers (and so its kernels, recompute and fused boundaries).
MHC_RESIDUALS = ("mhc", "mhc-lite", "mhc-v4.1")
COLLAPSES = ("head", "sum", "carried")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256  # bytes
    width: int = 128
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    # plain | hc (unconstrained) | mhc (Sinkhorn) | mhc-lite (permutations) | mhc-v4.1 (V4.1's schedule)
    residual: str = "mhc"
    n: int = 4  # streams of a multi-stream residual
    # How n streams become one: "head" (V4's learned head), "sum", or "carried" (V4.1's sum by the
    # last sublayer's pre gates; mhc-v4.1 only, and the only one it has). None: the residual's own,
    # "carried" for mhc-v4.1, "head" for the others (``final_collapse``).
    collapse: str | None = None
    use_kernel: bool = True  # fused C++ kernels (mHC sublayers, the head, the collapse), or the plain-JAX path
    fuse_boundaries: bool = True  # each mHC post fused with the next sublayer's pre, or run whole
    # mHC's streams kept for the backward only at the start of every group of this many sublayers
    # (the backward rebuilds the others with the kernels); None keeps them all. mhc.flax.stack.
    recompute: int | None = None
    dtype: str = "float32"  # the activations' (embedding output, sublayers, streams); parameters stay f32

    def __post_init__(self):
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual: expected one of {RESIDUALS}, got {self.residual!r}")
        if self.collapse is not None and self.collapse not in COLLAPSES:
            raise ValueError(f"collapse: expected None or one of {COLLAPSES}, got {self.collapse!r}")
        if self.residual == "mhc-v4.1" and self.collapse not in (None, "carried"):
            raise ValueError(
                "collapse: residual 'mhc-v4.1' ends with the sum by the last sublayer's pre gates (no head "
                f"parameters): expected None or 'carried', got {self.collapse!r}"
            )
        if self.residual != "mhc-v4.1" and self.collapse == "carried":
            raise ValueError(
                "collapse: 'carried' (the sum by the last sublayer's pre gates) is DeepSeek-V4.1's: expected "
                f"residual 'mhc-v4.1', got residual={self.residual!r}"
            )
        if self.width % self.heads:
            raise ValueError(f"width: expected a multiple of heads={self.heads}, got {self.width}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if self.recompute is not None:
            if isinstance(self.recompute, bool) or not isinstance(self.recompute, int) or self.recompute < 1:
                raise ValueError(f"recompute: expected None or a group size >= 1 (sublayers), got {self.recompute!r}")
            if self.residual not in MHC_RESIDUALS or not self.use_kernel:
                raise ValueError(
                    f"recompute: rebuilds mHC's streams with its kernels: expected residual in {MHC_RESIDUALS} "
                    f"with use_kernel=True, got residual={self.residual!r}, use_kernel={self.use_kernel}"
                )

    @property
    def final_collapse(self) -> str | None:
        """How the n streams become one: "head", "sum" or "carried"; None for the plain residual."""
        if self.residual == "plain":
            return None
        if self.collapse is not None:
            return self.collapse
        return "carried" if self.residual == "mhc-v4.1" else "head"

    def mhc_config(self) -> mhc_jax.Config:
        """The mHC layers' Config. mhc-v4.1 keeps the other kinds' eps (not V4.1's rms_eps 1e-20),
        so that a comparison differs in the schedule alone."""
        if self.residual == "mhc-v4.1":
            return mhc_jax.Config(n=self.n, pre_from_previous=True)
        return mhc_jax.Config(n=self.n, mix="permutations" if self.residual == "mhc-lite" else "sinkhorn")


class HyperConnections(nnx.Module):
    """Dynamic hyper-connections (Zhu et al., 2024, arXiv 2409.19606) around one sublayer F: the
    unconstrained baseline. Plain JAX (no kernel), same call as
    ``ManifoldConstrainedHyperConnections``: ``layer(norm_fn, branch_fn, x)``.

    Per token, with the streams x [n, D] and x_norm[k] = x[k] / sqrt(mean_d x[k, d]^2 + eps) (an
    RMSNorm of each stream over D, without weight, where the paper has a LayerNorm):

        H_pre[k]     = B_pre[k]     + s_mix  * tanh(x_norm[k] . w_pre)          [n]
        H_post[j]    = B_post[j]    + s_post * tanh(x_norm[j] . w_post)         [n]
        H_res[i, j]  = B_res[i, j]  + s_mix  * tanh(x_norm[i] . w_res[:, j])    [n, n]
        layer_in     = sum_k H_pre[k] x[k]
        out[j]       = sum_i H_res[i, j] x[i] + H_post[j] F(layer_in)

    the paper's A_m = H_pre, B = H_post, A_r = H_res, in the spec's orientation (first index input
    stream i, second output stream j). Initialized as the paper does: the static part B to the
    identity-like connections (B_pre the one-hot of stream ``layer_index mod n``, B_post all ones,
    B_res the identity), the dynamic projections w_pre [D], w_post [D], w_res [D, n] to zero and the
    scales s_mix, s_post to 0.01. All are learned, and nothing bounds them: no Sinkhorn, no
    sigmoid, so the product of the H_res over depth is free to grow (or shrink) in norm.
    """

    def __init__(self, n: int, dim: int, layer_index: int, *, rms_eps: float = 1e-6, sow_mixes: bool = False):
        self.n = n
        self.rms_eps = rms_eps
        # As ManifoldConstrainedHyperConnections': each call sows its H_res [..., n, n] as the
        # nnx.Intermediate "h_res" when set (nnx.view(model, sow_mixes=True)).
        self.sow_mixes = sow_mixes
        self.static_pre = nnx.Param(jax.nn.one_hot(layer_index % n, n, dtype=jnp.float32))
        self.static_post = nnx.Param(jnp.ones((n,), jnp.float32))
        self.static_res = nnx.Param(jnp.eye(n, dtype=jnp.float32))
        self.dynamic_pre = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.dynamic_post = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.dynamic_res = nnx.Param(jnp.zeros((dim, n), jnp.float32))
        self.scale_mix = nnx.Param(jnp.full((), 0.01, jnp.float32))
        self.scale_post = nnx.Param(jnp.full((), 0.01, jnp.float32))

    def set_view(self, sow_mixes: bool | None = None):
        """For ``nnx.view``: ``sow_mixes`` as in the constructor."""
        if sow_mixes is not None:
            self.sow_mixes = sow_mixes

    def coefficients(self, x: jax.Array):
        """(H_pre [..., n], H_post [..., n], H_res [..., n, n]) of the streams x [..., n, D], f32."""
        x = x.astype(jnp.float32)
        x_norm = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.rms_eps)
        h_pre = self.static_pre[...] + self.scale_mix[...] * jnp.tanh(x_norm @ self.dynamic_pre[...])
        h_post = self.static_post[...] + self.scale_post[...] * jnp.tanh(x_norm @ self.dynamic_post[...])
        h_res = self.static_res[...] + self.scale_mix[...] * jnp.tanh(x_norm @ self.dynamic_res[...])
        return h_pre, h_post, h_res

    def __call__(self, norm_fn, branch_fn, x: jax.Array) -> jax.Array:
        h_pre, h_post, h_res = self.coefficients(x)
        if self.sow_mixes:
            self.sow(nnx.Intermediate, "h_res", h_res)
        layer_in = jnp.einsum("...k,...kd->...d", h_pre, x).astype(x.dtype)
        layer_out = branch_fn(norm_fn(layer_in))
        mixed = jnp.einsum("...ij,...id->...jd", h_res, x)
        return (mixed + h_post[..., :, None] * layer_out[..., None, :]).astype(x.dtype)


@jax.custom_vjp
def causal_attention(q, k, v):
    """Causal softmax attention, q, k, v [batch, seq, heads, head_dim] -> [batch, seq, heads,
    head_dim]: ``jax.nn.dot_product_attention(q, k, v, is_causal=True)``'s formulas (logits in f32,
    scaled by 1/sqrt(head_dim), probabilities cast back to q's dtype), whose backward keeps one
    [batch, heads, seq, seq] array, the probabilities.

    Why not jax.nn.dot_product_attention itself: JAX's autodiff of it keeps three [B, H, S, S]
    residuals (the masked logits, their exp and the probabilities), which XLA fuses down to about
    one when nothing stands between them and the backward; under ``jax.checkpoint`` (mHC's
    recompute groups, ``ModelConfig.recompute``) they cross the checkpoint's optimization barrier
    and all three are stored (in f32 at D = 128, n = 4: recompute then needed 14 MiB more than
    keeping every stream instead of saving memory)."""
    return _causal_attention_forward(q, k, v)[0]


def _causal_attention_forward(q, k, v):
    scale = 1.0 / np.sqrt(q.shape[-1])
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.tril(jnp.ones(logits.shape[-2:], bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v), probs


def _causal_attention_fwd(q, k, v):
    out, probs = _causal_attention_forward(q, k, v)
    return out, (q, k, v, probs)


def _causal_attention_bwd(residuals, d_out):
    q, k, v, probs = residuals
    scale = 1.0 / np.sqrt(q.shape[-1])
    d_v = jnp.einsum("bhqk,bqhd->bkhd", probs, d_out)
    d_probs = jnp.einsum("bqhd,bkhd->bhqk", d_out, v, preferred_element_type=jnp.float32)
    p = probs.astype(jnp.float32)  # softmax' backward: p (dp - sum_k p dp), masked entries have p = 0
    d_logits = (p * (d_probs - jnp.sum(p * d_probs, axis=-1, keepdims=True)) * scale).astype(q.dtype)
    d_q = jnp.einsum("bhqk,bkhd->bqhd", d_logits, k)
    d_k = jnp.einsum("bhqk,bqhd->bkhd", d_logits, q)
    return d_q, d_k, d_v


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


class CausalSelfAttention(nnx.Module):
    def __init__(self, width: int, heads: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.heads = heads
        self.qkv = nnx.Linear(width, 3 * width, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(width, width, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, h):
        batch, seq, width = h.shape
        q, k, v = jnp.split(self.qkv(h).reshape(batch, seq, 3 * self.heads, width // self.heads), 3, axis=2)
        attended = causal_attention(q, k, v)
        return self.out(attended.reshape(batch, seq, width))


@jax.custom_vjp
def gelu(u):
    """``jax.nn.gelu`` (tanh form) whose backward keeps only its input u and derives the gradient
    from it. JAX's autodiff keeps several [.., 4 D] intermediates (u^3, the tanh, ...), which XLA
    must store once they cross ``jax.checkpoint``'s barrier (mHC's recompute groups): 14.5 MiB of
    the 16 sublayers' f32 temporaries at D = 128. The backward reads u through an optimization
    barrier: without it XLA merges the backward's recomputation with the forward's gelu and keeps
    the tanh (f32) or three bf16-rounded intermediates per MLP until the backward (seen in the
    buffer assignment), whether or not a checkpoint is around. Same values and gradients as
    ``jax.nn.gelu``."""
    return jax.nn.gelu(u)


def _gelu_fwd(u):
    return jax.nn.gelu(u), u


def _gelu_bwd(u, d_out):
    # The barrier keeps XLA from computing this backward's intermediates with the forward's gelu
    # (and so storing them from the forward on); it recomputes them here from u.
    return jax.vjp(jax.nn.gelu, jax.lax.optimization_barrier(u))[1](d_out)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


class MLP(nnx.Module):
    def __init__(self, width: int, ratio: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.up = nnx.Linear(width, ratio * width, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(ratio * width, width, dtype=dtype, rngs=rngs)

    def __call__(self, h):
        return self.down(gelu(self.up(h)))


class Block(nnx.Module):
    """One attention sublayer and one MLP sublayer, each wrapped by the residual's connections.

    ``rngs`` draws the sublayers' weights and ``mix_rngs`` the connections', so that every residual
    kind built from one seed starts from the same attention and MLP weights.
    """

    def __init__(self, config: ModelConfig, index: int, *, rngs: nnx.Rngs, mix_rngs: nnx.Rngs):
        width, dtype = config.width, jnp.dtype(config.dtype)
        self.attn_norm = nnx.RMSNorm(width, dtype=dtype, rngs=rngs)
        self.attn = CausalSelfAttention(width, config.heads, dtype=dtype, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(width, dtype=dtype, rngs=rngs)
        self.mlp = MLP(width, config.mlp_ratio, dtype=dtype, rngs=rngs)
        self.residual = config.residual
        self.fuse_boundaries = config.fuse_boundaries
        if config.residual == "hc":
            self.attn_hc = HyperConnections(config.n, width, 2 * index)
            self.mlp_hc = HyperConnections(config.n, width, 2 * index + 1)
        elif config.residual != "plain":
            hc, use_kernel = config.mhc_config(), config.use_kernel
            self.attn_hc = ManifoldConstrainedHyperConnections(hc, width, use_kernel=use_kernel, rngs=mix_rngs)
            self.mlp_hc = ManifoldConstrainedHyperConnections(hc, width, use_kernel=use_kernel, rngs=mix_rngs)

    def __call__(self, x):
        """x: the hidden state [batch, seq, width] (plain), or the streams [batch, seq, n, width]; for
        mHC with fused boundaries also the previous block's ``mhc.jax.Pending``, which this block
        returns in turn (each post fused with the next sublayer's pre; ``mhc.jax.finish`` ends it)."""
        if self.residual == "plain":
            x = x + self.attn(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))
        if self.residual == "hc":
            x = self.attn_hc(self.attn_norm, self.attn, x)
            return self.mlp_hc(self.mlp_norm, self.mlp, x)
        return stack(x, self.mhc_sublayers(), fuse_boundaries=self.fuse_boundaries)

    def mhc_sublayers(self) -> list[tuple]:
        """(connections, norm, branch) of the attention and MLP sublayers, for ``mhc.flax.stack``."""
        return [(self.attn_hc, self.attn_norm, self.attn), (self.mlp_hc, self.mlp_norm, self.mlp)]

    def hyper_connection_names(self) -> tuple[str, ...]:
        """The attributes holding this block's connections, in depth order."""
        return () if self.residual == "plain" else ("attn_hc", "mlp_hc")


class Transformer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        # Drawn first whatever the residual, so that the other weights come from the same stream.
        mix_rngs = nnx.Rngs(rngs.params())
        dtype = jnp.dtype(config.dtype)
        self.embed = nnx.Embed(config.vocab, config.width, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(config, i, rngs=rngs, mix_rngs=mix_rngs) for i in range(config.layers)])
        if config.final_collapse == "head":
            self.collapse = Head(config.mhc_config(), config.width, use_kernel=config.use_kernel, rngs=mix_rngs)
        else:
            self.collapse = None
        self.final_norm = nnx.RMSNorm(config.width, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(config.width, config.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        """tokens [batch, seq] int -> logits [batch, seq, vocab]."""
        h = self.embed(tokens)
        if self.config.residual == "plain":
            for block in self.blocks:
                h = block(h)
        else:
            state = mhc_jax.expand(h, self.config.n)
            if self.config.residual == "hc":
                for block in self.blocks:
                    state = block(state)
            else:  # the whole depth as one chain, so that a recompute group may span blocks
                sublayers = [sublayer for block in self.blocks for sublayer in block.mhc_sublayers()]
                state = stack(
                    state, sublayers, recompute=self.config.recompute, fuse_boundaries=self.config.fuse_boundaries
                )
            if self.config.final_collapse == "carried":
                h = mhc_jax.collapse(state, use_kernel=self.config.use_kernel)
            else:
                streams = mhc_jax.finish(state)
                h = mhc_jax.reduce(streams) if self.collapse is None else self.collapse(streams)
        return self.head(self.final_norm(h))

    def residual_mixes(self, tokens) -> np.ndarray:
        """H_res of every sublayer in depth order, [2L, batch*seq, n, n] (empty for plain): one
        forward of a view that sows them, collected with ``nnx.capture``."""
        if self.config.residual == "plain":
            return np.zeros((0, 0, 0, 0))
        probe = nnx.view(self, sow_mixes=True)
        _, sown = nnx.jit(nnx.capture(Transformer.__call__, nnx.Intermediate))(probe, tokens)
        n = self.config.n
        mixes = []
        for index, block in enumerate(self.blocks):
            for name in block.hyper_connection_names():
                (h_res,) = sown["blocks"][index][name]["h_res"].get_value()
                mixes.append(np.asarray(h_res).reshape(-1, n, n))
        return np.stack(mixes)


def loss_fn(model: Transformer, tokens, targets):
    logits = model(tokens)
    return cross_entropy(logits, targets)


def cross_entropy(logits, targets):
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))

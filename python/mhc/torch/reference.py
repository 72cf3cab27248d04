"""The plain-torch path: the spec's formulas in torch (f32 coefficient math), differentiated by
torch's autograd, on any device. ``mhc.torch.pre(..., use_kernel=False)`` runs this; it is the
same math as ``mhc.jax.reference`` and as Hugging Face's ``DeepseekV4HyperConnection``."""

from __future__ import annotations

import itertools

import torch

from mhc._config import Config, HeadParams, Params, PreApply


def permutation_matrices(n: int, device=None) -> torch.Tensor:
    """[n!, n, n] with [p, i, perm_p(i)] = 1, permutations of range(n) in lexicographic order."""
    perms = list(itertools.permutations(range(n)))
    mats = torch.zeros((len(perms), n, n), dtype=torch.float32, device=device)
    for p, perm in enumerate(perms):
        mats[p, torch.arange(n), torch.tensor(perm)] = 1.0
    return mats


def mix_matrix(config: Config, logits: torch.Tensor) -> torch.Tensor:
    """H_res [..., n, n] from the residual logits [..., R] (spec: Forward step 5)."""
    n, eps = config.n, config.sinkhorn_eps
    if config.mix == "permutations":
        weights = torch.softmax(logits, dim=-1)
        return torch.einsum("...p,pij->...ij", weights, permutation_matrices(n, logits.device).to(logits.dtype))
    s = torch.softmax(logits.reshape(*logits.shape[:-1], n, n), dim=-1) + eps
    s = s / (s.sum(dim=-2, keepdim=True) + eps)
    for _ in range(config.sinkhorn_iters - 1):
        s = s / (s.sum(dim=-1, keepdim=True) + eps)
        s = s / (s.sum(dim=-2, keepdim=True) + eps)
    return s


def _wide(x: torch.Tensor) -> torch.Tensor:
    """The coefficient math's dtype: f32, or f64 for f64 inputs (the tests' float64 oracle)."""
    return x if x.dtype == torch.float64 else x.float()


def _rms_factor(flat: torch.Tensor, config: Config) -> torch.Tensor:
    return torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + config.rms_eps)


def coefficients(x: torch.Tensor, params: Params, config: Config):
    """h_pre [..., n], h_post [..., n], h_res [..., n, n] in f32 (spec: Forward steps 1-5)."""
    n = config.n
    flat = _wide(x).reshape(*x.shape[:-2], n * x.shape[-1])
    projection = (flat * params.norm_weight) @ params.phi
    r = _rms_factor(flat, config)
    alpha = params.alpha
    scale = torch.cat([alpha[0].expand(n), alpha[1].expand(n), alpha[2].expand(config.residual_logits)])
    logits = scale * (r * projection) + params.bias
    h_pre = torch.sigmoid(logits[..., :n]) + config.pre_eps
    h_post = config.post_scale * torch.sigmoid(logits[..., n : 2 * n])
    return h_pre, h_post, mix_matrix(config, logits[..., 2 * n :])


def mix(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_k weights[..., k] x[..., k, :] in f32, rounded once to x's dtype: [..., D]."""
    return (weights.unsqueeze(-1) * _wide(x)).sum(dim=-2).to(x.dtype)


def pre_apply(mode: PreApply, x: torch.Tensor, h_pre: torch.Tensor, carried) -> torch.Tensor:
    """layer_in: V4 mixes by its own gates; V4.1 by the carried mix, or its one-hot takes stream 0."""
    if mode is PreApply.OWN_GATES:
        return mix(h_pre, x)
    return x[..., 0, :] if mode is PreApply.ONE_HOT else mix(carried, x)


def post(x: torch.Tensor, layer_out: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> torch.Tensor:
    """out[..., j, d] = sum_i h_res[..., i, j] x[..., i, d] + h_post[..., j] layer_out[..., d] (x's dtype)."""
    mixed = torch.einsum("...ij,...id->...jd", h_res, _wide(x))
    return (mixed + h_post.unsqueeze(-1) * _wide(layer_out).unsqueeze(-2)).to(x.dtype)


def head(x: torch.Tensor, params: HeadParams, config: Config) -> torch.Tensor:
    """DeepSeek-V4's head [..., D] (x's dtype): sum_k g_k x_k with
    g = sigmoid(scale * r * (x_flat . fn^T) + base) + pre_eps (spec: Head)."""
    flat = _wide(x).reshape(*x.shape[:-2], config.n * x.shape[-1])
    gates = torch.sigmoid(params.scale[0] * (_rms_factor(flat, config) * (flat @ params.fn.T)) + params.base)
    return mix(gates + config.pre_eps, x)


def collapse(x: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4.1's end of the model: sum_k carried[..., k] x[..., k, :] (x's dtype)."""
    return mix(carried, x)

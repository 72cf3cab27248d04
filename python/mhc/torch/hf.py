"""A drop-in for Hugging Face transformers' DeepSeek-V4 mHC modules, on mhc's kernels.

``HyperConnection`` and ``HyperHead`` hold the same parameters as transformers'
``DeepseekV4HyperConnection`` (``fn`` [2n + n^2, n*D], ``base``, ``scale`` [3]) and
``DeepseekV4HyperHead`` (``hc_fn`` [n, n*D], ``hc_base``, ``hc_scale``) and have the same forward
signature and outputs; ``patch(model)`` swaps them into a loaded ``DeepseekV4ForCausalLM`` (or
``DeepseekV4Model``) in place, keeping the very Parameter objects, so the state_dict and an
optimizer built before the patch are unchanged. Their forward is ``mhc.torch.pre`` / ``head``: one
fused op forward and backward where transformers runs about 60 small torch ops (its Sinkhorn a
Python loop).

``patch(model, fuse=True)`` (the default) also runs each decoder layer with its attention's post
fused into its MLP's pre; between layers the post and the next pre stay two calls (transformers'
model calls the layers one by one). With ``fuse=False`` the decoder layers are transformers' own,
applying each post in plain torch. transformers 5.x has no DeepSeek-V4.1 model (its
``hc_pre_from_prev_sublayer`` schedule); ``mhc.torch`` has V4.1's operations for one.

Importing this module does not import transformers; ``patch`` needs it.
"""

from __future__ import annotations

import types

import torch
from torch import nn

import mhc.torch as mt


class HyperConnection(nn.Module):
    """transformers' ``DeepseekV4HyperConnection`` on mhc's pre: forward(hidden_streams [B, S, n, D])
    -> (post [B, S, n] f32, comb [B, S, n, n] f32, collapsed [B, S, D] in the streams' dtype)."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_sinkhorn_iters: int, hc_eps: float, rms_norm_eps: float):
        super().__init__()
        self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps = hc_mult, hc_sinkhorn_iters, hc_eps
        self.rms_norm_eps = rms_norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(width, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))
        # DeepSeek-V4's RMS norm over the flattened streams has no weight: ones, never trained.
        self.register_buffer("norm_weight", torch.ones(hc_mult * hidden_size), persistent=False)
        self._phi, self._phi_key = None, None  # params(): fn transposed, kept for inference
        self.config = mt.Config(
            n=hc_mult, sinkhorn_iters=hc_sinkhorn_iters, sinkhorn_eps=hc_eps, pre_eps=hc_eps, rms_eps=rms_norm_eps
        )

    @classmethod
    def replacing(cls, module: nn.Module) -> HyperConnection:
        """This module in place of transformers' ``module``, sharing its Parameter objects."""
        dim = module.fn.shape[1] // module.hc_mult
        new = cls(module.hc_mult, dim, module.hc_sinkhorn_iters, module.hc_eps, module.input_norm.variance_epsilon)
        new.fn, new.base, new.scale = module.fn, module.base, module.scale
        return new.to(module.fn.device)

    def params(self) -> mt.Params:
        """mhc's parameters: phi is fn transposed. When fn's gradient is wanted, a copy in the graph
        (the gradient flows back through it); otherwise (inference) a copy kept until fn changes:
        at decode the transpose of a [24, 16384] fn costs more than the kernel."""
        if torch.is_grad_enabled() and self.fn.requires_grad:
            phi = self.fn.t().contiguous()
        else:
            key = (id(self.fn), self.fn.data_ptr(), self.fn._version)  # _version: bumped by every in-place write
            if self._phi_key != key:
                self._phi, self._phi_key = self.fn.detach().t().contiguous(), key
            phi = self._phi
        return mt.Params(self.norm_weight, phi, self.scale, self.base)

    def forward(self, hidden_streams: torch.Tensor):
        use_kernel = hidden_streams.device.type == "cpu"  # the CUDA kernels are unverified: plain torch there
        collapsed, ctx = mt.pre(hidden_streams.contiguous(), self.params(), self.config, use_kernel=use_kernel)
        return ctx.h_post, ctx.h_res, collapsed


class HyperHead(nn.Module):
    """transformers' ``DeepseekV4HyperHead`` on mhc's head: forward(x [B, S, n, D]) -> [B, S, D]."""

    def __init__(self, hc_mult: int, hidden_size: int, eps: float, rms_norm_eps: float):
        super().__init__()
        self.hc_mult, self.eps = hc_mult, eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.empty(hc_mult))
        self.hc_scale = nn.Parameter(torch.empty(1))
        self.config = mt.Config(n=hc_mult, pre_eps=eps, rms_eps=rms_norm_eps)

    @classmethod
    def replacing(cls, module: nn.Module) -> HyperHead:
        dim = module.hc_fn.shape[1] // module.hc_mult
        new = cls(module.hc_mult, dim, module.eps, module.input_norm.variance_epsilon)
        new.hc_fn, new.hc_base, new.hc_scale = module.hc_fn, module.hc_base, module.hc_scale
        return new.to(module.hc_fn.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = mt.HeadParams(self.hc_fn, self.hc_base, self.hc_scale)
        return mt.head(x.contiguous(), params, self.config, use_kernel=x.device.type == "cpu")


_REPLACEMENTS = {"DeepseekV4HyperConnection": HyperConnection, "DeepseekV4HyperHead": HyperHead}


def fused_decoder_forward(self, hidden_states: torch.Tensor, input_ids=None, **kwargs) -> torch.Tensor:
    """``DeepseekV4DecoderLayer.forward`` with the attention's post fused into the MLP's pre
    (``mhc.torch.boundary``: the new streams written once and projected while in cache, and in the
    backward never stored): pre -> attention -> boundary -> MLP -> post, each on mhc's kernels."""
    use_kernel = hidden_states.device.type == "cpu"
    config = self.attn_hc.config
    layer_in, ctx = mt.pre(hidden_states.contiguous(), self.attn_hc.params(), config, use_kernel=use_kernel)
    attn_output, _ = self.self_attn(self.input_layernorm(layer_in), **kwargs)
    layer_in, ctx = mt.boundary(attn_output.contiguous(), ctx, self.ffn_hc.params(), config, use_kernel=use_kernel)
    mlp_output = self.mlp(self.post_attention_layernorm(layer_in), input_ids=input_ids)
    return mt.post(mlp_output.contiguous(), ctx)


def patch(model: nn.Module, *, fuse: bool = True) -> nn.Module:
    """Swaps every ``DeepseekV4HyperConnection`` and ``DeepseekV4HyperHead`` of ``model`` for
    mhc's, in place, sharing their parameters; returns the model. Raises if there is none.

    fuse: also run each ``DeepseekV4DecoderLayer`` with its attention's post fused into its MLP's
    pre (``fused_decoder_forward``, set on each layer instance). The post after the MLP stays
    separate: the next layer's pre is in the next layer's call."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"mhc.torch.hf.patch: model: expected a torch.nn.Module, got {type(model).__name__}")
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement = _REPLACEMENTS.get(type(child).__name__)
            if replacement is not None:
                setattr(parent, name, replacement.replacing(child))
                swapped += 1
    if fuse:
        for layer in model.modules():
            if type(layer).__name__ == "DeepseekV4DecoderLayer" and isinstance(layer.attn_hc, HyperConnection):
                layer.forward = types.MethodType(fused_decoder_forward, layer)
    if not swapped:
        raise ValueError(
            "mhc.torch.hf.patch: model: no DeepseekV4HyperConnection or DeepseekV4HyperHead in it "
            f"({type(model).__name__}); expected a transformers DeepSeek-V4 model"
        )
    return model

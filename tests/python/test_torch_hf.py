"""mhc.torch.hf: the drop-in for transformers' DeepSeek-V4 mHC modules, on a tiny random model made
here (no download): the state_dict unchanged, the logits and every hc parameter's gradient within
the spec's bounds of the float64 model, the same greedy tokens as the unpatched model."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mhc.torch needs torch (pip install mhc[torch])")
transformers = pytest.importorskip("transformers", reason="the drop-in is tested against transformers' model")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V4", allow_module_level=True)

from conftest import assert_matches  # noqa: E402
from mhc.torch import hf  # noqa: E402

VOCAB = 64


def tiny_model(seed):
    config = transformers.DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        q_lora_rank=16,
        num_experts_per_tok=2,
        n_routed_experts=4,
        n_shared_experts=1,
        hc_mult=4,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        sliding_window=8,
        num_nextn_predict_layers=0,
        max_position_embeddings=128,
    )
    config._experts_implementation = "eager"  # grouped_mm has no float64: the oracle runs the model in float64
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial coefficients (spec: Accuracy): scales of order 1, random biases
        for name, parameter in model.named_parameters():
            if name.endswith((".scale", "hc_scale")):
                sign = torch.where(torch.rand(parameter.shape, generator=generator) < 0.3, -1.0, 1.0)
                parameter.copy_(sign * (0.5 + torch.rand(parameter.shape, generator=generator)))
            elif name.endswith((".base", "hc_base")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


def hc_names(model):
    return [name for name, _ in model.named_parameters() if "_hc." in name or "hc_head." in name]


def logits_and_hc_grads(model, ids):
    model.zero_grad()
    logits = model(ids).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1)).backward()
    parameters = dict(model.named_parameters())
    return [logits.detach()] + [parameters[name].grad.clone() for name in hc_names(model)]


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "modules"])
def test_patch_keeps_the_state_dict_and_matches_the_float64_model(seed, fuse):
    """fused: the decoder layers run pre, boundary, post on mhc; modules: transformers' layers call
    the swapped modules."""
    model = tiny_model(seed)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    unpatched = copy.deepcopy(model)
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    assert hf.patch(model, fuse=fuse) is model
    fused = [layer for layer in model.model.layers if "forward" in vars(layer)]
    assert len(fused) == (2 if fuse else 0)
    swapped = [m for m in model.modules() if isinstance(m, (hf.HyperConnection, hf.HyperHead))]
    assert len(swapped) == 2 * 2 + 1, "every layer's attn_hc and ffn_hc, and the head"
    assert list(model.state_dict()) == keys
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]), name

    got = logits_and_hc_grads(model, ids)
    want = logits_and_hc_grads(copy.deepcopy(unpatched).double(), ids)
    names = ["logits", *hc_names(model)]

    def perturbed(rng, index):
        moved = copy.deepcopy(unpatched).double()
        with torch.no_grad():
            for p in moved.parameters():
                p.mul_(1 + torch.from_numpy(rng.uniform(-(2.0**-24), 2.0**-24, tuple(p.shape))))
        return logits_and_hc_grads(moved, ids)[index].numpy()

    for index, (name, value, reference) in enumerate(zip(names, got, want, strict=True)):
        assert_matches(
            name,
            value.numpy(),
            reference.numpy(),
            1e-5,
            lambda rng, index=index: perturbed(rng, index),
            f"seed={seed}",
        )

    prompt = ids[:, :4]
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = model.generate(prompt, **options)
        unpatched_tokens = unpatched.generate(prompt, **options)
    assert torch.equal(tokens, unpatched_tokens)


def test_patch_refuses_a_model_without_hyper_connections():
    with pytest.raises(ValueError, match=r"mhc.torch.hf.patch: model: no DeepseekV4HyperConnection"):
        hf.patch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"mhc.torch.hf.patch: model: expected a torch.nn.Module"):
        hf.patch(np.zeros(2))


def test_inference_sees_every_change_of_fn(seed):
    """Without gradients the module keeps fn transposed between calls: a write to fn in place (an
    optimizer step, load_state_dict) or a new fn Parameter must reach the next call, with the bits
    of a module made afresh from the changed weights."""
    torch.manual_seed(seed)
    original = tiny_model(seed).model.layers[0].attn_hc
    module = hf.HyperConnection.replacing(copy.deepcopy(original))
    x = torch.randn(2, 3, 4, 32)

    def fresh():
        clone = copy.deepcopy(original)
        clone.load_state_dict(module.state_dict())
        return hf.HyperConnection.replacing(clone)(x)

    with torch.no_grad():
        module(x)
        module.fn.mul_(1.5)
        for got, want in zip(module(x), fresh(), strict=True):
            assert torch.equal(got, want)
        module.load_state_dict({"fn": torch.randn_like(module.fn), "base": module.base, "scale": module.scale})
        for got, want in zip(module(x), fresh(), strict=True):
            assert torch.equal(got, want)
        module.fn = torch.nn.Parameter(torch.randn_like(module.fn))
        for got, want in zip(module(x), fresh(), strict=True):
            assert torch.equal(got, want)

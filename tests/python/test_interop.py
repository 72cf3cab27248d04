"""mhc.interop: bit-exact weight conversion to and from DeepSeek-V4 / Hugging Face / MaxText, the
safetensors loader, and a forward through converted weights against NumPy transcriptions of
DeepSeek-V4's and MaxText's own code."""

import dataclasses
import functools
import itertools
import json
import math
import re
import sys
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
import numpy_reference
from conftest import assert_matches, relative_error, round_by_one_unit
from mhc import interop

CASES = [(mix, n) for mix in ("sinkhorn", "permutations") for n in (1, 3, 4)]
D = 5  # odd, so that no reshape can be confused with a transpose


def random_v4_tensors(rng, config, d, layer, sublayer, naming="v4"):
    """fn, base, scale of one sublayer with non-trivial values (scale of order 1, random base)."""
    names = interop.v4_sublayer_names(layer, sublayer, naming)
    m, width = config.n * d, config.projection_width
    sign = np.where(rng.uniform(size=3) < 0.3, -1.0, 1.0)
    # Unit rows and a base off sigmoid's flat tails: every gate moves with x (at D = 5 a row of
    # N(0, 1/m) entries was short often enough to leave n = 1's post gate near constant).
    fn = rng.standard_normal((width, m))
    return {
        names["fn"]: (fn / np.linalg.norm(fn, axis=1, keepdims=True)).astype(np.float32),
        names["base"]: rng.uniform(-1.5, 1.5, width).astype(np.float32),
        names["scale"]: (sign * rng.uniform(0.5, 1.5, size=3)).astype(np.float32),
    }


def random_v4_head(rng, config, d, naming="v4"):
    names = interop.v4_head_names(naming)
    m = config.n * d
    return {
        names["fn"]: (rng.standard_normal((config.n, m)) / math.sqrt(m)).astype(np.float32),
        names["base"]: rng.standard_normal(config.n).astype(np.float32),
        names["scale"]: rng.uniform(0.5, 1.5, size=1).astype(np.float32),
    }


def random_params(rng, config, d, unit_norm=False):
    m, width = config.n * d, config.projection_width
    norm_weight = np.ones(m) if unit_norm else 1.0 + 0.2 * rng.standard_normal(m)
    return mj.Params(
        norm_weight=norm_weight.astype(np.float32),
        phi=(rng.standard_normal((m, width)) / math.sqrt(m)).astype(np.float32),
        alpha=rng.uniform(-1.5, 1.5, size=3).astype(np.float32),
        bias=rng.standard_normal(width).astype(np.float32),
    )


def assert_same_tree(got, want, path=""):
    assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
    for key, value in want.items():
        if isinstance(value, dict):
            assert_same_tree(got[key], value, f"{path}/{key}")
        else:
            assert got[key].dtype == np.float32, f"{path}/{key}: dtype {got[key].dtype}"
            np.testing.assert_array_equal(got[key], value, err_msg=f"{path}/{key}")


def assert_same_params(got, want):
    assert type(got) is type(want)
    for name, a, b in zip(type(want)._fields, got, want, strict=True):
        assert np.asarray(a).dtype == np.float32, f"{name}: dtype {np.asarray(a).dtype}"
        np.testing.assert_array_equal(a, b, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Round trips (bit-exact)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("naming", interop.NAMINGS)
@pytest.mark.parametrize(("mix", "n"), CASES)
def test_v4_round_trips_are_exact(seed, mix, n, naming):
    rng = np.random.default_rng(seed)
    config = mj.Config(n=n, mix=mix)
    for layer, sublayer in ((0, "attn"), (7, "ffn")):
        tensors = random_v4_tensors(rng, config, D, layer, sublayer, naming)
        names = interop.v4_sublayer_names(layer, sublayer, naming)
        params = interop.params_from_v4(tensors, config, layer=layer, sublayer=sublayer, naming=naming)
        np.testing.assert_array_equal(params.phi, tensors[names["fn"]].T)
        np.testing.assert_array_equal(params.norm_weight, np.ones(n * D, np.float32))
        back = interop.params_to_v4(params, config, layer=layer, sublayer=sublayer, naming=naming)
        assert_same_tree(back, tensors)

        unit = random_params(rng, config, D, unit_norm=True)
        exported = interop.params_to_v4(unit, config, layer=layer, sublayer=sublayer, naming=naming)
        assert_same_params(
            interop.params_from_v4(exported, config, layer=layer, sublayer=sublayer, naming=naming), unit
        )


@pytest.mark.parametrize("naming", interop.NAMINGS)
@pytest.mark.parametrize("n", (1, 3, 4))
def test_head_round_trips_are_exact(seed, n, naming):
    rng = np.random.default_rng(seed)
    config = mj.Config(n=n)
    tensors = random_v4_head(rng, config, D, naming)
    head = interop.head_from_v4(tensors, config, naming=naming)
    assert_same_tree(interop.head_to_v4(head, config, naming=naming), tensors)
    maxtext = interop.head_to_maxtext(head, config)
    np.testing.assert_array_equal(maxtext["hc_fn"], head.fn.T)
    assert_same_params(interop.head_from_maxtext(maxtext, config), head)


@pytest.mark.parametrize(("mix", "n"), CASES)
def test_maxtext_round_trips_are_exact(seed, mix, n):
    rng = np.random.default_rng(seed)
    config = mj.Config(n=n, mix=mix)
    params = random_params(rng, config, D)
    tree = interop.params_to_maxtext(params, config)
    r = config.residual_logits
    assert tree["res_beta"].shape == ((n, n) if mix == "sinkhorn" else (r,))
    assert tree["pre_alpha"].shape == (n * D, n) and tree["res_alpha"].shape == (n * D, r)
    np.testing.assert_array_equal(tree["post_alpha"], params.phi[:, n : 2 * n])
    np.testing.assert_array_equal(tree["res_alpha_scale"], params.alpha[2:])
    assert_same_params(interop.params_from_maxtext(tree, config), params)
    assert_same_tree(interop.params_to_maxtext(interop.params_from_maxtext(tree, config), config), tree)
    # flax.nnx variables keep their array in .value
    wrapped = {key: value if isinstance(value, dict) else SimpleNamespace(value=value) for key, value in tree.items()}
    assert_same_params(interop.params_from_maxtext(wrapped, config), params)


def test_norm_weight_is_folded_only_on_request(seed):
    rng = np.random.default_rng(seed)
    config = mj.Config(n=3)
    params = random_params(rng, config, D)
    with pytest.raises(ValueError, match=r"params\.norm_weight: .*fold_norm_weight=True"):
        interop.params_to_v4(params, config, layer=0, sublayer="attn")
    folded = interop.params_to_v4(params, config, layer=0, sublayer="attn", fold_norm_weight=True)
    np.testing.assert_array_equal(folded["layers.0.hc_attn_fn"], (params.norm_weight[:, None] * params.phi).T)
    converted = interop.params_from_v4(folded, config, layer=0, sublayer="attn")
    x = jnp.asarray(rng.standard_normal((4, 3, D)), jnp.float32)
    layer_out = jnp.asarray(rng.standard_normal((4, D)), jnp.float32)
    # The folded weights give the unfolded sublayer: both the folded and the original parameters
    # against the float64 oracle of the original ones, with the one accuracy rule.
    want = numpy_reference.forward(x, layer_out, params, config)

    def perturbed(index, rng):
        moved = (round_by_one_unit(rng, v) for v in (x, layer_out, params))
        return numpy_reference.forward(*moved, config, noise=rng)[index]

    for label, sublayer_params in (("folded", converted), ("original", params)):
        got_in, got_ctx = mj.pre(x, sublayer_params, config, use_kernel=False)
        got = (got_in, mj.post(layer_out, got_ctx))
        for index, name in enumerate(("layer_in", "out")):
            resample = functools.partial(perturbed, index)
            assert_matches(name, got[index], want[index], 1e-5, resample, f"{label} params (seed {seed})")


def test_config_from_v4():
    native = {"hc_mult": 4, "hc_sinkhorn_iters": 7, "hc_eps": 1e-4, "norm_eps": 1e-5, "dim": 4096}
    assert interop.config_from_v4(native) == mj.Config(
        n=4, sinkhorn_iters=7, sinkhorn_eps=1e-4, rms_eps=1e-5, pre_eps=1e-4, post_scale=2.0
    )
    assert interop.config_from_v4({"hc_mult": 2, "rms_norm_eps": 1e-5}).rms_eps == 1e-5
    assert interop.config_from_v4({"hc_mult": 2}) == mj.Config(n=2)
    with pytest.raises(KeyError, match="hc_mult"):
        interop.config_from_v4({"hc_eps": 1e-6})
    with pytest.raises(TypeError, match="model_config"):
        interop.config_from_v4([("hc_mult", 4)])


# ---------------------------------------------------------------------------------------------
# Forward through converted weights vs. NumPy transcriptions of DeepSeek-V4 and MaxText
# ---------------------------------------------------------------------------------------------


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def v4_hc_split_sinkhorn(mixes, hc_scale, hc_base, hc, sinkhorn_iters, eps):
    """DeepSeek-V4 inference/kernel.py hc_split_sinkhorn_kernel, per token, in float64."""
    pre = _sigmoid(mixes[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * _sigmoid(mixes[..., hc : 2 * hc] * hc_scale[1] + hc_base[hc : 2 * hc])
    comb = mixes[..., 2 * hc :].reshape(*mixes.shape[:-1], hc, hc) * hc_scale[2] + hc_base[2 * hc :].reshape(hc, hc)
    comb = np.exp(comb - comb.max(axis=-1, keepdims=True))  # comb = comb.softmax(-1) + eps
    comb = comb / comb.sum(axis=-1, keepdims=True) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return pre, post, comb


def v4_hc_pre(x, hc_fn, hc_scale, hc_base, hc_mult, sinkhorn_iters, norm_eps, hc_eps):
    """DeepSeek-V4 inference/model.py Block.hc_pre; x [b, s, hc, d] in float64."""
    flat = x.reshape(*x.shape[:-2], -1)
    rsqrt = 1.0 / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    mixes = (flat @ hc_fn.T) * rsqrt
    pre, post, comb = v4_hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, hc_eps)
    y = np.sum(pre[..., None] * x, axis=-2)
    return y, post, comb


def v4_hc_post(x, residual, post, comb):
    """Block.hc_post: y = post x + sum over comb's FIRST index of comb * residual."""
    return post[..., None] * x[..., None, :] + np.sum(comb[..., None] * residual[..., None, :], axis=-3)


def v4_hc_head(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps):
    """ParallelHead.hc_head."""
    flat = x.reshape(*x.shape[:-2], -1)
    rsqrt = 1.0 / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    mixes = (flat @ hc_fn.T) * rsqrt
    pre = _sigmoid(mixes * hc_scale + hc_base) + hc_eps
    return np.sum(pre[..., None] * x, axis=-2)


@pytest.mark.parametrize("hc_eps", (1e-6, 1e-3))
@pytest.mark.parametrize("n", (1, 3, 4))
def test_forward_matches_deepseek_v4(seed, n, hc_eps):
    """A large hc_eps makes the eps placement (pre gate, softmax, each normalization) visible."""
    rng = np.random.default_rng(seed)
    v4_config = {"hc_mult": n, "hc_sinkhorn_iters": 20, "hc_eps": hc_eps, "norm_eps": 1e-5}
    config = interop.config_from_v4(v4_config)
    tensors = {**random_v4_tensors(rng, config, D, 2, "ffn"), **random_v4_head(rng, config, D)}
    params = interop.params_from_v4(tensors, config, layer=2, sublayer="ffn")
    head = interop.head_from_v4(tensors, config)
    # 24 tokens: the gates' spread below is a sample statistic (6 tokens left it under 0.05 for
    # about 1 seed in 4,000 at n = 1).
    x = rng.standard_normal((4, 6, n, D)).astype(np.float32)
    layer_out = rng.standard_normal((4, 6, D)).astype(np.float32)

    layer_in, ctx = mj.pre(jnp.asarray(x), params, config, use_kernel=False)
    out = mj.post(jnp.asarray(layer_out), ctx)
    collapsed = mj.head(jnp.asarray(x), head, config, use_kernel=False)

    fn, base, scale = (tensors[f"layers.2.hc_ffn_{part}"].astype(np.float64) for part in ("fn", "base", "scale"))
    x64 = x.astype(np.float64)
    y, post, comb = v4_hc_pre(x64, fn, scale, base, n, 20, 1e-5, hc_eps)
    want_out = v4_hc_post(layer_out.astype(np.float64), x64, post, comb)
    head_fn, head_base, head_scale = (tensors[f"hc_head_{part}"].astype(np.float64) for part in ("fn", "base", "scale"))
    want_head = v4_hc_head(x64, head_fn, head_scale, head_base, 1e-5, hc_eps)

    for name, got, want in (
        ("layer_in", layer_in, y),
        ("h_post", ctx.h_post, post),
        ("h_res", ctx.h_res, comb),
        ("out", out, want_out),
        ("head", collapsed, want_head),
    ):
        error = relative_error(got, want)
        assert error <= 1e-5, f"{name}: relative error {error:.3g} vs DeepSeek-V4 (n={n}, hc_eps={hc_eps})"
    assert np.std(post) > 0.05, "post gates too close to constant to test anything"
    assert n == 1 or np.std(comb) > 0.01, "h_res too close to constant to test anything"


# DeepSeek-V4.1 (spec: Single-pass schedule): the same per-layer tensors, no head, and a
# pre-apply by the previous sublayer's gates.
V41_CONFIG = {
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "norm_eps": 1e-20,
    "hc_pre_from_prev_sublayer": True,
}


def hf_v41_text_config(**fields):
    """transformers' ``DeepseekV41TextConfig(...).to_dict()`` at test size: what ``save_pretrained`` of
    a ``DeepseekV41TextModel`` writes to config.json. V4.1 is known by the model_type alone: there is
    no ``hc_pre_from_prev_sublayer`` key. The mHC norm's eps is ``rms_norm_eps`` (default 1e-20)."""
    config = {
        "model_type": "deepseek_v41_text",
        "architectures": ["DeepseekV41TextModel"],
        "vocab_size": 1024,
        "hidden_size": D,
        "num_hidden_layers": 2,
        "compress_ratios": [0, 0],
        "layer_types": ["sliding_attention", "sliding_attention"],
        "engram_layer_ids": [],
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-20,
        "dtype": "bfloat16",
        "transformers_version": "5.1.0.dev0",
    }
    return {**config, **fields}


def hf_v41_composite_config(text_config):
    """transformers' composite ``DeepseekV41Config``: the released V4.1 checkpoint's config.json, and
    what ``save_pretrained`` of a ``DeepseekV41ForCausalLM`` writes; the text fields under ``text_config``."""
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": {key: value for key, value in text_config.items() if key != "architectures"},
        "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 1024, "patch_size": 14},
        "image_token_id": 129264,
        "tie_word_embeddings": False,
        "transformers_version": "5.1.0.dev0",
    }


class TransformersConfig:
    """Stands in for a transformers ``PretrainedConfig`` (not a mapping; ``to_dict()`` gives its fields)."""

    def __init__(self, fields):
        self._fields = fields

    def to_dict(self):
        return json.loads(json.dumps(self._fields))


def test_config_from_v41():
    v41 = mj.Config(
        n=4, sinkhorn_iters=20, sinkhorn_eps=1e-6, rms_eps=1e-20, pre_eps=1e-6, post_scale=2.0, pre_from_previous=True
    )
    assert interop.config_from_v4(V41_CONFIG) == v41
    # DeepSeek's own inference config: the eps of the mHC norm is its norm_eps, 1e-20 when absent.
    assert interop.config_from_v4({**V41_CONFIG, "norm_eps": 1e-12}).rms_eps == 1e-12
    assert interop.config_from_v4({k: v for k, v in V41_CONFIG.items() if k != "norm_eps"}) == v41
    assert not interop.config_from_v4({**V41_CONFIG, "hc_pre_from_prev_sublayer": False}).pre_from_previous
    assert interop.config_from_v4({**V41_CONFIG, "hc_pre_from_prev_sublayer": False}).rms_eps == 1e-20
    with pytest.raises(TypeError, match=r"model_config\['hc_pre_from_prev_sublayer'\]: expected true or false"):
        interop.config_from_v4({**V41_CONFIG, "hc_pre_from_prev_sublayer": "yes"})

    # transformers' text and composite configs, as dicts, as the config.json save_pretrained writes
    # and as config objects: V4.1 by the model_type, with the config's own eps.
    want = dataclasses.replace(v41, sinkhorn_iters=7, sinkhorn_eps=1e-3, pre_eps=1e-3, rms_eps=1e-12)
    text = hf_v41_text_config(hc_sinkhorn_iters=7, hc_eps=1e-3, rms_norm_eps=1e-12)
    for model_config in (text, hf_v41_composite_config(text)):
        for form in (model_config, json.loads(json.dumps(model_config)), TransformersConfig(model_config)):
            assert interop.config_from_v4(form) == want, model_config["model_type"]
    assert interop.config_from_v4(hf_v41_text_config()) == v41  # transformers' default eps
    # The composite's text_config as transformers writes it has its model_type; without one it is still V4.1.
    bare_text = {key: value for key, value in text.items() if key != "model_type"}
    assert interop.config_from_v4({**hf_v41_composite_config(text), "text_config": bare_text}) == want


def test_config_from_hf_v4():
    hf_v4 = {"model_type": "deepseek_v4", "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-5}
    assert interop.config_from_v4(hf_v4) == mj.Config(n=4, rms_eps=1e-5)
    assert interop.config_from_v4(TransformersConfig(hf_v4)) == mj.Config(n=4, rms_eps=1e-5)


def test_config_from_v4_rejects_what_it_cannot_place():
    """A configuration of another model, or one that contradicts itself, raises instead of being read as V4."""
    text = hf_v41_text_config()
    with pytest.raises(ValueError, match=r"config_from_v4: model_config\['model_type'\] is 'llama': expected one of "):
        interop.config_from_v4({**text, "model_type": "llama"})
    with pytest.raises(ValueError, match=r"'deepseek_v41_text'.*or no model_type"):
        interop.config_from_v4({"model_type": "deepseek_v42", "hc_mult": 4})
    composite = hf_v41_composite_config(text)
    with pytest.raises(KeyError, match=r"config_from_v4: model_config\['text_config'\]: expected .*'deepseek_v41'"):
        interop.config_from_v4({key: value for key, value in composite.items() if key != "text_config"})
    with pytest.raises(ValueError, match=r"\['text_config'\]\['model_type'\]: expected 'deepseek_v41_text'"):
        interop.config_from_v4({**composite, "text_config": {**text, "model_type": "deepseek_v4"}})
    with pytest.raises(KeyError, match=r"config_from_v4: model_config\['text_config'\]: 'hc_mult' missing"):
        interop.config_from_v4({**composite, "text_config": {"model_type": "deepseek_v41_text"}})
    with pytest.raises(ValueError, match=r"'hc_pre_from_prev_sublayer'\] is False in a model_type 'deepseek_v41_text'"):
        interop.config_from_v4({**text, "hc_pre_from_prev_sublayer": False})
    with pytest.raises(ValueError, match=r"'hc_pre_from_prev_sublayer'\] is True in a model_type 'deepseek_v4'"):
        interop.config_from_v4({"model_type": "deepseek_v4", "hc_mult": 4, "hc_pre_from_prev_sublayer": True})


@pytest.mark.parametrize("naming", interop.NAMINGS)
def test_v41_round_trips_are_exact(seed, naming):
    """V4.1's tensors (fn F32 [24, 20480] at D = 5120; D = 5 here) convert both ways bit for bit."""
    rng = np.random.default_rng(seed)
    config = interop.config_from_v4(V41_CONFIG)
    for layer, sublayer in ((0, "attn"), (42, "ffn")):
        tensors = random_v4_tensors(rng, config, D, layer, sublayer, naming)
        params = interop.params_from_v4(tensors, config, layer=layer, sublayer=sublayer, naming=naming)
        assert_same_tree(interop.params_to_v4(params, config, layer=layer, sublayer=sublayer, naming=naming), tensors)
        unit = random_params(rng, config, D, unit_norm=True)
        exported = interop.params_to_v4(unit, config, layer=layer, sublayer=sublayer, naming=naming)
        assert_same_params(
            interop.params_from_v4(exported, config, layer=layer, sublayer=sublayer, naming=naming), unit
        )


def v41_forward(x, sublayers, branches, *, rms_eps, hc_eps, sinkhorn_iters):
    """DeepSeek-V4.1's forward over a few sublayers, float64, transcribed from the spec's
    "Single-pass schedule": every sublayer s takes H_pre_s, H_post_s, H_res_s from its own x_s
    (V4's hc_pre projection and hc_split_sinkhorn above), reads layer_in_s = sum_k p_s[k] x_s[k]
    with the carried p_s = H_pre_{s-1} (p_0 = the one-hot on stream 0), merges as V4's hc_post,
    and the model ends with h = sum_k p_last[k] x_final[k]. sublayers: (fn, scale, base) each.
    Returns (the layer_in of every sublayer, h, the pre gates of every sublayer)."""
    n = x.shape[-2]
    carried = np.broadcast_to(np.eye(n)[0], x.shape[:-1])
    layer_ins, gates = [], []
    for (fn, scale, base), branch in zip(sublayers, branches, strict=True):
        flat = x.reshape(*x.shape[:-2], -1)
        rsqrt = 1.0 / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + rms_eps)
        pre, post, comb = v4_hc_split_sinkhorn((flat @ fn.T) * rsqrt, scale, base, n, sinkhorn_iters, hc_eps)
        layer_in = np.sum(carried[..., None] * x, axis=-2)
        layer_ins.append(layer_in)
        x = v4_hc_post(branch(layer_in), x, post, comb)
        carried = pre
        gates.append(pre)
    return layer_ins, np.sum(carried[..., None] * x, axis=-2), gates


@pytest.mark.parametrize(("hc_eps", "rms_eps"), ((1e-6, 1e-20), (1e-3, 1e-6)))
def test_forward_matches_deepseek_v41(seed, hc_eps, rms_eps):
    """Three sublayers (layer 0's attn and ffn, layer 1's attn) of V4.1 loaded by interop, through
    mhc.jax's plain path (pre with the carried mix, post, the final collapse; and the same as one
    stack), against the float64 transcription. Each branch is a random tanh(h W). The Config comes
    from transformers' V4.1 text config, so its eps values are the config's."""
    rng = np.random.default_rng(seed)
    config = interop.config_from_v4(hf_v41_text_config(hc_eps=hc_eps, rms_norm_eps=rms_eps))
    n = config.n
    where = ((0, "attn"), (0, "ffn"), (1, "attn"))
    tensors = {}
    for layer, sublayer in where:
        tensors.update(random_v4_tensors(rng, config, D, layer, sublayer))
    params = [interop.params_from_v4(tensors, config, layer=layer, sublayer=sub) for layer, sub in where]
    weights = [(rng.standard_normal((D, D)) / math.sqrt(D)).astype(np.float32) for _ in where]
    # Streams of order 1e-3 (mean square 1e-6) make the RMS eps visible (1e-6 moves r by a factor 0.7).
    x = (1e-3 * rng.standard_normal((2, 3, n, D))).astype(np.float32)

    names = [interop.v4_sublayer_names(layer, sub) for layer, sub in where]
    stored = [tuple(tensors[names[s][part]].astype(np.float64) for part in ("fn", "scale", "base")) for s in range(3)]
    want_layer_ins, want_h, gates = v41_forward(
        x.astype(np.float64),
        stored,
        [lambda h, w=w: np.tanh(h @ w.astype(np.float64)) for w in weights],
        rms_eps=rms_eps,
        hc_eps=hc_eps,
        sinkhorn_iters=20,
    )

    branches = [lambda h, w=w: jnp.tanh(h @ w) for w in weights]
    streams, carried = jnp.asarray(x), None
    for s in range(3):
        layer_in, ctx = mj.pre(streams, params[s], config, carried=carried, use_kernel=False)
        error = relative_error(layer_in, want_layer_ins[s])
        assert error <= 1e-5, f"sublayer {s} layer_in: relative error {error:.3g} vs the V4.1 transcription"
        streams, carried = mj.post(branches[s](layer_in), ctx), ctx.h_pre
    h = jnp.einsum("...k,...kd->...d", carried, streams)
    assert relative_error(h, want_h) <= 1e-5, "the collapse by the last pre gates"

    chain = mj.stack(jnp.asarray(x), list(zip(params, [config] * 3, branches, strict=True)), use_kernel=False)
    assert relative_error(mj.collapse(chain), want_h) <= 1e-5, "mhc.jax.stack then mhc.jax.collapse"
    assert min(np.std(g) for g in gates) > 0.05, "pre gates too close to constant to test anything"


def maxtext_mhc(x, layer_out, tree, k, lite, norm_eps):
    """MaxText layers/mhc.py ManifoldConstrainedHyperConnections.__call__ (non-kernel path), float64;
    x [t, k, d]. Returns (layer_input, output)."""
    leaf = {key: np.asarray(value, np.float64) for key, value in tree.items() if key != "mhc_norm"}
    t, _, d = x.shape
    flat = x.reshape(t, k * d)
    norm_x = flat / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    norm_x = norm_x * np.asarray(tree["mhc_norm"]["scale"], np.float64)
    h = norm_x @ np.concatenate([leaf["pre_alpha"], leaf["post_alpha"], leaf["res_alpha"]], axis=-1)
    h_pre, h_post, h_res = h[:, :k], h[:, k : 2 * k], h[:, 2 * k :]
    pre = 1.0 * _sigmoid(leaf["pre_alpha_scale"] * h_pre + leaf["pre_beta"]) + 1e-6
    layer_input = np.einsum("tk,tkd->td", pre, x)
    post = 2.0 * _sigmoid(leaf["post_alpha_scale"] * h_post + leaf["post_beta"])
    logits = leaf["res_alpha_scale"] * h_res
    if lite:
        logits = logits + leaf["res_beta"]
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        permutation_matrices = np.eye(k)[np.array(list(itertools.permutations(range(k))))]
        res = np.einsum("tn,nkm->tkm", weights, permutation_matrices)
    else:
        res = np.exp(logits.reshape(t, k, k) + leaf["res_beta"])  # MaxText's sinkhorn(), eps 1e-6
        res = res / res.sum(axis=-1, keepdims=True) + 1e-6
        res = res / (res.sum(axis=-2, keepdims=True) + 1e-6)
        for _ in range(20 - 1):
            res = res / (res.sum(axis=-1, keepdims=True) + 1e-6)
            res = res / (res.sum(axis=-2, keepdims=True) + 1e-6)
    output = np.einsum("tkm,tkd->tmd", res, x) + layer_out[:, None, :] * post[:, :, None]
    return layer_input, output


@pytest.mark.parametrize("mix", ("sinkhorn", "permutations"))
def test_forward_matches_maxtext(seed, mix):
    rng = np.random.default_rng(seed)
    n, norm_eps = 3, 1e-5
    config = mj.Config(n=n, mix=mix, rms_eps=norm_eps)
    tree = interop.params_to_maxtext(random_params(rng, config, D), config)
    params = interop.params_from_maxtext(tree, config)
    x = rng.standard_normal((6, n, D)).astype(np.float32)
    layer_out = rng.standard_normal((6, D)).astype(np.float32)
    layer_in, ctx = mj.pre(jnp.asarray(x), params, config, use_kernel=False)
    out = mj.post(jnp.asarray(layer_out), ctx)
    want_in, want_out = maxtext_mhc(
        x.astype(np.float64), layer_out.astype(np.float64), tree, n, mix != "sinkhorn", 1e-5
    )
    assert relative_error(layer_in, want_in) <= 1e-5
    assert relative_error(out, want_out) <= 1e-5


# ---------------------------------------------------------------------------------------------
# safetensors checkpoints
# ---------------------------------------------------------------------------------------------


def v4_checkpoint_tensors(rng, config, naming, dtypes):
    """Two layers and the head (dtypes: layer 0, layer 1, head), plus tensors the loader must skip."""
    import jax

    tensors = {}
    for layer in (0, 1):
        for sublayer in interop.SUBLAYERS:
            tensors.update(random_v4_tensors(rng, config, D, layer, sublayer, naming))
    tensors.update(random_v4_head(rng, config, D, naming))
    stored = {}
    for name, value in tensors.items():
        dtype = dtypes[2] if "hc_head" in name else dtypes[int(re.search(r"layers\.(\d)", name).group(1))]
        stored[name] = jax.numpy.asarray(value, dtype)
    stored["embed.weight" if naming == "v4" else "model.embed_tokens.weight"] = jax.numpy.ones((7, D), jnp.bfloat16)
    stored["mtp.0.hc_attn_fn"] = jax.numpy.zeros((3, 3), jnp.float32)  # an MTP layer: not a decoder layer
    return stored


def expected_weights(stored, config, naming):
    as_f32 = {name: np.asarray(value).astype(np.float32) for name, value in stored.items()}
    return (
        [interop.params_from_v4(as_f32, config, layer=i, sublayer="attn", naming=naming) for i in (0, 1)],
        [interop.params_from_v4(as_f32, config, layer=i, sublayer="ffn", naming=naming) for i in (0, 1)],
        interop.head_from_v4(as_f32, config, naming=naming),
    )


def assert_loaded(weights, stored, config, naming):
    attn, ffn, head = expected_weights(stored, config, naming)
    assert weights.layers == (0, 1)
    for got, want in zip(weights.attn + weights.ffn, attn + ffn, strict=True):
        assert_same_params(got, want)
    assert_same_params(weights.head, head)


def test_load_single_file(seed, tmp_path):
    safetensors_flax = pytest.importorskip("safetensors.flax")
    rng = np.random.default_rng(seed)
    config = mj.Config(n=4)
    stored = v4_checkpoint_tensors(rng, config, "v4", (jnp.float32, jnp.bfloat16, jnp.bfloat16))
    file = tmp_path / "model.safetensors"
    safetensors_flax.save_file(stored, str(file))
    assert_loaded(interop.load_v4(file, config), stored, config, "v4")
    assert_loaded(interop.load_v4(str(tmp_path), config), stored, config, "v4")  # a directory without an index
    only = interop.load_v4(file, config, layers=[1], head=False)
    assert only.layers == (1,) and only.head is None
    assert_same_params(only.ffn[0], expected_weights(stored, config, "v4")[1][1])


def test_load_sharded_hf_checkpoint(seed, tmp_path):
    safetensors_flax = pytest.importorskip("safetensors.flax")
    rng = np.random.default_rng(seed)
    config = mj.Config(n=4)
    stored = v4_checkpoint_tensors(rng, config, "hf", (jnp.bfloat16, jnp.float32, jnp.float32))
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for position, (name, value) in enumerate(sorted(stored.items())):
        shards[sorted(shards)[position % 2]][name] = value
    weight_map = {}
    for file, tensors in shards.items():
        safetensors_flax.save_file(tensors, str(tmp_path / file))
        weight_map.update(dict.fromkeys(tensors, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_loaded(interop.load_v4(tmp_path, config, naming="hf"), stored, config, "hf")
    assert_loaded(interop.load_v4(tmp_path / "model.safetensors.index.json", config, naming="hf"), stored, config, "hf")

    assert_loaded(interop.load_v4(tmp_path, config), stored, config, "hf")  # the naming decided from the file
    with pytest.raises(KeyError, match=r"layers\.0\.hc_attn_fn: no mHC layer tensors .*look like naming='hf'"):
        interop.load_v4(tmp_path, config, naming="v4")
    moved = dict(weight_map, **{"model.hc_head.hc_base": "model-00003-of-00002.safetensors"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(FileNotFoundError, match=r"model-00003-of-00002\.safetensors: missing"):
        interop.load_v4(tmp_path, config, naming="hf")
    other_file = sorted(set(weight_map.values()) - {weight_map["model.hc_head.hc_base"]})[0]
    moved = dict(weight_map, **{"model.hc_head.hc_base": other_file})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(KeyError, match=rf"model\.hc_head\.hc_base: not found in .*{re.escape(other_file)}"):
        interop.load_v4(tmp_path, config, naming="hf")


def transformers_checkpoint_tensors(rng, config):
    """Two layers and the head under the names transformers 5.x's ``save_pretrained`` writes for
    ``DeepseekV4ForCausalLM`` (its conversion mapping reverted on save: the layers' hc tensors go back
    to V4's names under the ``model.`` prefix, the head's keep transformers' module names), beside
    tensors the loader must skip."""
    import jax

    width, m = config.projection_width, config.n * D
    stored = {}
    for layer in (0, 1):
        for sublayer in ("attn", "ffn"):
            stored[f"model.layers.{layer}.hc_{sublayer}_fn"] = rng.standard_normal((width, m))
            stored[f"model.layers.{layer}.hc_{sublayer}_base"] = rng.standard_normal((width,))
            stored[f"model.layers.{layer}.hc_{sublayer}_scale"] = rng.standard_normal((3,))
        stored[f"model.layers.{layer}.self_attn.q_a_proj.weight"] = np.ones((3, D))
    stored["model.hc_head.hc_fn"] = rng.standard_normal((config.n, m))
    stored["model.hc_head.hc_base"] = rng.standard_normal((config.n,))
    stored["model.hc_head.hc_scale"] = rng.standard_normal((1,))
    stored["model.embed_tokens.weight"] = np.ones((7, D))
    stored["lm_head.weight"] = np.ones((7, D))
    return {name: jax.numpy.asarray(value, jnp.float32) for name, value in stored.items()}


def test_load_what_transformers_save_pretrained_writes(seed, tmp_path):
    safetensors_flax = pytest.importorskip("safetensors.flax")
    rng = np.random.default_rng(seed)
    config = mj.Config(n=4)
    stored = transformers_checkpoint_tensors(rng, config)
    file = tmp_path / "model.safetensors"
    safetensors_flax.save_file(stored, str(file))
    weights = interop.load_v4(file, config)
    assert weights.layers == (0, 1)
    as_v4 = {name.removeprefix("model."): np.asarray(value) for name, value in stored.items()}
    for layer in (0, 1):
        want_attn = interop.params_from_v4(as_v4, config, layer=layer, sublayer="attn")
        want_ffn = interop.params_from_v4(as_v4, config, layer=layer, sublayer="ffn")
        assert_same_params(weights.attn[layer], want_attn)
        assert_same_params(weights.ffn[layer], want_ffn)
    head = {f"hc_head_{part}": np.asarray(stored[f"model.hc_head.hc_{part}"]) for part in ("fn", "base", "scale")}
    assert_same_params(weights.head, interop.head_from_v4(head, config))

    # One naming forced for both groups: the error points at the group that has the other one.
    with pytest.raises(KeyError, match=r"hc_head_fn: not found .*naming='v4'.*look like naming='hf'.*model\.hc_head"):
        interop.load_v4(file, config, naming="v4")
    with pytest.raises(KeyError, match=r"layers\.0\.attn_hc\.fn: no mHC layer tensors .*look like naming='v4'"):
        interop.load_v4(file, config, naming="hf")

    # A real miss names the tensors nearest to the one expected.
    safetensors_flax.save_file({k: v for k, v in stored.items() if k != "model.layers.1.hc_ffn_scale"}, str(file))
    with pytest.raises(
        KeyError, match=r"model\.layers\.1\.hc_ffn_scale: not found in .*the nearest names in it: .*model\.layers\."
    ) as missing:
        interop.load_v4(file, config)
    assert "model.layers.0.hc_ffn_scale" in str(missing.value)


def test_load_errors(seed, tmp_path):
    safetensors_flax = pytest.importorskip("safetensors.flax")
    rng = np.random.default_rng(seed)
    config = mj.Config(n=4)
    stored = v4_checkpoint_tensors(rng, config, "v4", (jnp.float32, jnp.float32, jnp.float32))

    def save(tensors):
        file = tmp_path / "model.safetensors"
        safetensors_flax.save_file(tensors, str(file))
        return file

    file = save({name: value for name, value in stored.items() if name != "layers.1.hc_ffn_scale"})
    with pytest.raises(KeyError, match=r"layers\.1\.hc_ffn_scale: not found in .*model\.safetensors"):
        interop.load_v4(file, config)
    with pytest.raises(KeyError, match=r"layers\.5\.hc_attn_fn: not found"):
        interop.load_v4(file, config, layers=[5], head=False)

    file = save(dict(stored, **{"layers.1.hc_attn_base": jnp.zeros((23,), jnp.float32)}))
    with pytest.raises(
        ValueError,
        match=r"layers\.1\.hc_attn_base \(in .*model\.safetensors\): expected shape \(24,\) for n=4, D=5, "
        r"mix='sinkhorn', got \(23,\)",
    ):
        interop.load_v4(file, config)
    file = save(dict(stored, **{"layers.0.hc_attn_fn": jnp.zeros((24, 21), jnp.float32)}))
    with pytest.raises(ValueError, match=r"layers\.0\.hc_attn_fn \(in .*\): expected shape \(24, 4\*D\)"):
        interop.load_v4(file, config)
    with pytest.raises(ValueError, match=r"layers\.0\.hc_attn_fn \(in .*\): expected shape \(24, 20\) for n=4, D=5"):
        interop.load_v4(file, config, dim=5)
    file = save(dict(stored, **{"hc_head_scale": jnp.ones((1,), jnp.int32)}))
    with pytest.raises(TypeError, match=r"hc_head_scale \(in .*\): expected dtype F32, BF16 or F16, got I32"):
        interop.load_v4(file, config)
    with pytest.raises(KeyError, match=r"layers\.0\.hc_attn_fn: no mHC layer tensors in .*\(naming decided from"):
        interop.load_v4(save({"hc_head_fn": jnp.zeros((4, 20))}), config)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"garbage\.safetensors: not a readable safetensors file"):
        interop.load_v4(garbage, config)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        interop.load_v4(tmp_path / "absent.safetensors", config)
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        interop.load_v4(file, config, layers=[0, "1"])
    with pytest.raises(ValueError, match="naming"):
        interop.load_v4(file, config, naming="torch")


def test_load_v41_checkpoint_without_head(seed, tmp_path):
    """A V4.1 checkpoint (no hc_head_*, either naming): loaded without asking for a head; asking
    for one is an error, and a V4 config still demands it."""
    safetensors_flax = pytest.importorskip("safetensors.flax")
    rng = np.random.default_rng(seed)
    config = interop.config_from_v4(V41_CONFIG)
    for naming in interop.NAMINGS:
        stored = {
            name: value
            for name, value in v4_checkpoint_tensors(
                rng, config, naming, (jnp.float32, jnp.bfloat16, jnp.float32)
            ).items()
            if "hc_head" not in name
        }
        file = tmp_path / f"{naming}.safetensors"
        safetensors_flax.save_file(stored, str(file))
        weights = interop.load_v4(file, config)
        assert weights.layers == (0, 1) and weights.head is None
        attn, ffn, _ = expected_weights(
            {**stored, **random_v4_head(rng, config, D, naming)}, config, naming
        )  # expected_weights reads a head too; the one it reads is not compared
        for got, want in zip(weights.attn + weights.ffn, attn + ffn, strict=True):
            assert_same_params(got, want)
        assert interop.load_v4(file, config, head=False).head is None
        with pytest.raises(ValueError, match=r"head: DeepSeek-V4\.1 .*has no head tensors"):
            interop.load_v4(file, config, head=True)
        with pytest.raises(KeyError, match="hc_head"):
            interop.load_v4(file, mj.Config(n=4))  # a V4 config reads the head, which is not there
    with pytest.raises(TypeError, match="head: expected True, False or None"):
        interop.load_v4(file, config, head="no")


# The three namings of V4.1's layer tensors: DeepSeek's (``layers.{i}.hc_attn_fn``), transformers'
# V4.1 with raw layer attributes (V4's names under ``model.``, also what its save_pretrained writes),
# and a newer transformers V4.1 with ``attn_hc`` / ``ffn_hc`` modules (V4's Hugging Face names).
V41_NAMINGS = {
    "deepseek": lambda layer, sublayer: interop.v4_sublayer_names(layer, sublayer, "v4"),
    "transformers": lambda layer, sublayer: {
        part: "model." + name for part, name in interop.v4_sublayer_names(layer, sublayer, "v4").items()
    },
    "transformers-modules": lambda layer, sublayer: interop.v4_sublayer_names(layer, sublayer, "hf"),
}


@pytest.mark.parametrize("naming", sorted(V41_NAMINGS))
@pytest.mark.parametrize("composite", (False, True), ids=("text-config", "composite-config"))
def test_v41_checkpoint_round_trip(seed, tmp_path, naming, composite):
    """A V4.1 checkpoint directory as transformers writes it (config.json + model.safetensors, no
    head, other tensors beside): written from random Params through params_to_v4, read back by
    config_from_v4(config.json) and load_v4 bit for bit, as V4.1 with the config's own eps."""
    safetensors_flax = pytest.importorskip("safetensors.flax")
    rng = np.random.default_rng(seed)
    text = hf_v41_text_config(hc_eps=1e-4, rms_norm_eps=1e-9)
    model_config = hf_v41_composite_config(text) if composite else text
    (tmp_path / "config.json").write_text(json.dumps(model_config, indent=2))
    config = interop.config_from_v4(json.loads((tmp_path / "config.json").read_text()))
    assert config.pre_from_previous and config.rms_eps == 1e-9 and config.pre_eps == config.sinkhorn_eps == 1e-4

    params = {
        (layer, sub): random_params(rng, config, D, unit_norm=True) for layer in (0, 1) for sub in ("attn", "ffn")
    }
    stored = {"model.embed.weight": np.ones((7, D), np.float32), "lm_head.weight": np.ones((7, D), np.float32)}
    for (layer, sublayer), value in params.items():
        exported = interop.params_to_v4(value, config, layer=layer, sublayer=sublayer)
        v4_names = interop.v4_sublayer_names(layer, sublayer)
        for part, name in V41_NAMINGS[naming](layer, sublayer).items():
            stored[name] = exported[v4_names[part]]
    safetensors_flax.save_file(
        {name: jnp.asarray(value) for name, value in stored.items()}, str(tmp_path / "model.safetensors")
    )

    weights = interop.load_v4(tmp_path, config)
    assert weights.layers == (0, 1) and weights.head is None
    for layer in (0, 1):
        assert_same_params(weights.attn[layer], params[layer, "attn"])
        assert_same_params(weights.ffn[layer], params[layer, "ffn"])


def test_load_without_safetensors_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match="pip install safetensors"):
        interop.load_v4(tmp_path, mj.Config(n=4))


# ---------------------------------------------------------------------------------------------
# Argument errors of the converters
# ---------------------------------------------------------------------------------------------


def test_conversion_errors(seed):
    rng = np.random.default_rng(seed)
    config = mj.Config(n=4)
    tensors = random_v4_tensors(rng, config, D, 3, "attn")
    with pytest.raises(
        ValueError,
        match=r"layers\.3\.hc_attn_fn: expected shape \(24, 512\) for n=4, D=128, mix='sinkhorn', got \(24, 511\)",
    ):
        interop.params_from_v4(
            {**tensors, "layers.3.hc_attn_fn": np.zeros((24, 511), np.float32)},
            config,
            layer=3,
            sublayer="attn",
            dim=128,
        )
    with pytest.raises(ValueError, match=r"layers\.3\.hc_attn_fn: expected shape \(15, 3\*D\) for n=3"):
        interop.params_from_v4(tensors, mj.Config(n=3), layer=3, sublayer="attn")
    with pytest.raises(ValueError, match=r"layers\.3\.hc_attn_fn: expected shape \(8, 20\) for n=2, D=10"):
        interop.params_from_v4(tensors, mj.Config(n=2), layer=3, sublayer="attn")
    with pytest.raises(ValueError, match=r"layers\.3\.hc_attn_scale: expected shape \(3,\) for n=4, D=5"):
        interop.params_from_v4(
            {**tensors, "layers.3.hc_attn_scale": np.ones(1, np.float32)}, config, layer=3, sublayer="attn"
        )
    with pytest.raises(KeyError, match=r"layers\.4\.hc_attn_fn: missing from tensors"):
        interop.params_from_v4(tensors, config, layer=4, sublayer="attn")
    with pytest.raises(KeyError, match=r"model\.layers\.3\.attn_hc\.fn: .*look like naming='v4'"):
        interop.params_from_v4(tensors, config, layer=3, sublayer="attn", naming="hf")
    with pytest.raises(ValueError, match="sublayer: expected one of"):
        interop.params_from_v4(tensors, config, layer=3, sublayer="mlp")
    with pytest.raises(ValueError, match="layer: expected a layer index >= 0"):
        interop.params_from_v4(tensors, config, layer=-1, sublayer="attn")
    with pytest.raises(TypeError, match="layer: expected a layer index"):
        interop.params_from_v4(tensors, config, layer="3", sublayer="attn")
    with pytest.raises(TypeError, match="config: expected mhc.jax.Config"):
        interop.params_from_v4(tensors, {"hc_mult": 4}, layer=3, sublayer="attn")
    with pytest.raises(TypeError, match="tensors: expected a mapping"):
        interop.params_from_v4(list(tensors.values()), config, layer=3, sublayer="attn")
    with pytest.raises(
        TypeError, match=r"layers\.3\.hc_attn_base: expected dtype float32, bfloat16 or float16, got int64"
    ):
        interop.params_from_v4({**tensors, "layers.3.hc_attn_base": np.arange(24)}, config, layer=3, sublayer="attn")
    inexact = {**tensors, "layers.3.hc_attn_base": np.full(24, 0.1)}
    with pytest.raises(TypeError, match=r"layers\.3\.hc_attn_base: float64 values that float32 cannot hold exactly"):
        interop.params_from_v4(inexact, config, layer=3, sublayer="attn")
    exact = {**tensors, "layers.3.hc_attn_base": np.full(24, 0.5)}  # float64 that float32 holds exactly
    assert interop.params_from_v4(exact, config, layer=3, sublayer="attn").bias.dtype == np.float32

    params = random_params(rng, config, D, unit_norm=True)
    with pytest.raises(TypeError, match="params: expected mhc.jax.Params"):
        interop.params_to_v4(tuple(params), config, layer=0, sublayer="attn")
    with pytest.raises(ValueError, match=r"params\.bias: expected shape \(24,\) for n=4, D=5"):
        interop.params_to_maxtext(params._replace(bias=params.bias[:-1]), config)
    with pytest.raises(ValueError, match=r"params\.phi: expected shape \(4\*D, 24\)"):
        interop.params_to_v4(params._replace(phi=params.phi[:-1]), config, layer=0, sublayer="attn")
    head = interop.head_from_v4(random_v4_head(rng, config, D), config)
    with pytest.raises(TypeError, match="head: expected mhc.jax.HeadParams"):
        interop.head_to_v4(params, config)
    with pytest.raises(ValueError, match=r"head\.scale: expected shape \(1,\)"):
        interop.head_to_maxtext(head._replace(scale=np.ones(2, np.float32)), config)

    tree = interop.params_to_maxtext(params, config)
    with pytest.raises(KeyError, match=r"mhc_norm\.scale: missing from the MaxText parameter tree"):
        interop.params_from_maxtext({**tree, "mhc_norm": {}}, config)
    with pytest.raises(
        ValueError, match=r"res_beta: expected shape \(4, 4\) for n=4, D=5, mix='sinkhorn', got \(16,\)"
    ):
        interop.params_from_maxtext({**tree, "res_beta": tree["res_beta"].reshape(-1)}, config)
    with pytest.raises(ValueError, match=r"res_alpha: expected shape \(20, 24\) for n=4, D=5, mix='permutations'"):
        interop.params_from_maxtext(tree, mj.Config(n=4, mix="permutations"))
    with pytest.raises(TypeError, match="tree: expected a mapping"):
        interop.params_from_maxtext(list(tree), config)
    with pytest.raises(KeyError, match="hc_fn: missing"):
        interop.head_from_maxtext({"fn": head.fn}, config)

"""Exact conversion of mHC weights between ``mhc.jax.Params`` and DeepSeek-V4, Hugging Face and MaxText.

The spec's "Moving weights" paragraph, as code. Every conversion only transposes, slices,
concatenates or reshapes, so round trips are bit-exact; the one exception is folding a non-unit
``norm_weight`` into DeepSeek-V4's ``fn`` (see ``params_to_v4``).

DeepSeek-V4 (``inference/model.py``; the checkpoint uses the same names), per layer ``i`` and
sublayer ``attn`` / ``ffn``, with N = 2n + R and M = n*D::

    layers.{i}.hc_attn_fn [N, M]    phi = fn^T, norm_weight = ones (V4's RMS norm has no weight)
    layers.{i}.hc_attn_base [N]     bias
    layers.{i}.hc_attn_scale [3]    alpha = (pre, post, res)
    hc_head_fn [n, M], hc_head_base [n], hc_head_scale [1]      HeadParams(fn, base, scale)

Hugging Face transformers (``DeepseekV4DecoderLayer``, ``DeepseekV4HyperHead``) stores the same
tensors as ``model.layers.{i}.attn_hc.{fn,base,scale}``, ``model.layers.{i}.ffn_hc.*`` and
``model.hc_head.{hc_fn,hc_base,hc_scale}`` (``naming="hf"``). Its ``save_pretrained`` (5.x) reverts
its conversion mapping on save, which gives the layers back V4's names under the ``model.`` prefix
(``model.layers.{i}.hc_attn_fn``) and leaves the head's as they are (``model.hc_head.hc_fn``):
``load_v4`` decides the naming per group of tensors and accepts the prefix either way.

MaxText (``maxtext/layers/mhc.py``): one ``ManifoldConstrainedHyperConnections`` per sublayer
(``mhc_attention`` / ``mhc_mlp`` in a decoder layer) holding ``mhc_norm.scale`` [M],
``pre_alpha`` / ``post_alpha`` [M, n], ``res_alpha`` [M, R], ``pre_beta`` / ``post_beta`` [n],
``res_beta`` [n, n] (Sinkhorn) or [n!] (lite), and ``{pre,post,res}_alpha_scale`` [1]; the head
``DeepSeek4HyperHead`` (``decoder/hc_head``) holds ``hc_fn`` [M, n] (V4's fn transposed),
``hc_base`` [n], ``hc_scale`` [1].

DeepSeek-V4.1 (spec: "Single-pass schedule") stores the same per-layer tensors (``fn`` F32
[24, 20480] at n = 4, D = 5120) and has no ``hc_head_*``: its model ends with the collapse by the
last sublayer's pre gates (``mhc.jax.collapse``), which has no parameters. transformers' V4.1
(``DeepseekV41DecoderLayer``) holds them as raw layer attributes, so its checkpoints and
``save_pretrained`` name them as V4 does under the ``model.`` prefix
(``model.layers.{i}.hc_attn_fn``, ``model.layers.{i}.hc_ffn_fn``); a newer transformers V4.1 with
``attn_hc`` modules is read under V4's Hugging Face module names, ``model.layers.{i}.attn_hc.fn``
and ``model.layers.{i}.ffn_hc.fn`` (the ffn side by analogy with V4's; ``naming="hf"``).
``load_v4`` reads either. What tells V4 and V4.1 apart is the config (``config_from_v4``: the
model_type, or ``hc_pre_from_prev_sublayer`` in DeepSeek's own inference config), which gives
``Config(pre_from_previous=True)``, and ``load_v4`` then reads no head.

The hyper-parameters live in ``mhc.jax.Config``, not in the weights: ``config_from_v4`` reads them
from a DeepSeek-V4 or V4.1 ``config.json`` (DeepSeek's or transformers') or a transformers config.
Every function returns NumPy float32 arrays (host memory); pass them to ``jax.device_put`` to
place them.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

from mhc.jax import Config, HeadParams, Params

NAMINGS = ("v4", "hf")
SUBLAYERS = ("attn", "ffn")

# Converting these to float32 never rounds; anything else must be float32-exact already.
_EXACT_DTYPES = ("float32", "bfloat16", "float16")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_INDEX_FILE = "model.safetensors.index.json"
# DeepSeek's own V4.1 inference config.json switch to its single-pass schedule (transformers' V4.1
# configs have no such key: V4.1 is known by its model_type), and V4.1's RMS eps when the config
# names none (spec; transformers' DeepseekV41TextConfig.rms_norm_eps default).
V41_SCHEDULE_KEY = "hc_pre_from_prev_sublayer"
V41_RMS_EPS = 1e-20
# transformers' model_types: V4, V4.1's text config, V4.1's composite config (fields under text_config).
V4_MODEL_TYPE = "deepseek_v4"
V41_MODEL_TYPE = "deepseek_v41_text"
V41_COMPOSITE_MODEL_TYPE = "deepseek_v41"
MODEL_TYPES = (V4_MODEL_TYPE, V41_MODEL_TYPE, V41_COMPOSITE_MODEL_TYPE)


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------


def v4_sublayer_names(layer: int, sublayer: str, naming: str = "v4") -> dict[str, str]:
    """Checkpoint names of one sublayer's mHC tensors: {"fn": ..., "base": ..., "scale": ...}.

    naming "v4": ``layers.{layer}.hc_{sublayer}_fn`` etc.; "hf": ``model.layers.{layer}.{sublayer}_hc.fn``.
    """
    _check_layer("layer", layer)
    _check_choice("sublayer", sublayer, SUBLAYERS)
    _check_choice("naming", naming, NAMINGS)
    if naming == "v4":
        return {part: f"layers.{layer}.hc_{sublayer}_{part}" for part in ("fn", "base", "scale")}
    return {part: f"model.layers.{layer}.{sublayer}_hc.{part}" for part in ("fn", "base", "scale")}


def v4_head_names(naming: str = "v4") -> dict[str, str]:
    """Checkpoint names of the head's tensors: {"fn": ..., "base": ..., "scale": ...}."""
    _check_choice("naming", naming, NAMINGS)
    if naming == "v4":
        return {part: f"hc_head_{part}" for part in ("fn", "base", "scale")}
    return {part: f"model.hc_head.hc_{part}" for part in ("fn", "base", "scale")}


def config_from_v4(model_config) -> Config:
    """The ``Config`` of a DeepSeek-V4 or V4.1 configuration: a parsed ``config.json`` (dict) or a
    transformers config object (read through its ``to_dict()``).

    Recognised, by ``model_type`` (``MODEL_TYPES``):

    - ``deepseek_v4``: transformers' ``DeepseekV4Config`` and the ``config.json`` it writes.
    - ``deepseek_v41_text``: transformers' ``DeepseekV41TextConfig`` and its ``config.json``. V4.1
      is known by this model_type; these configs have no ``hc_pre_from_prev_sublayer`` key.
    - ``deepseek_v41``: the composite ``DeepseekV41Config`` (the released V4.1 checkpoint's
      ``config.json``, and what ``save_pretrained`` of ``DeepseekV41ForCausalLM`` writes): the
      fields are read from its ``text_config``.
    - no ``model_type``: DeepSeek's own inference ``config.json`` (its ``ModelArgs``), V4.1 when
      ``hc_pre_from_prev_sublayer`` is true, V4 otherwise.

    Any other ``model_type`` raises ValueError instead of being read as V4.

    Fields: ``hc_mult`` (n, required), ``hc_sinkhorn_iters`` (default 20), ``hc_eps`` (default
    1e-6; V4 and V4.1 use it for the pre gate and for Sinkhorn: ``pre_eps = sinkhorn_eps``), and
    the RMS eps of the mHC statistic: ``norm_eps`` (DeepSeek's name) or ``rms_norm_eps``
    (transformers'), which both models also use for the norm before the mHC projection; absent,
    it is V4's 1e-6 or V4.1's 1e-20 (``V41_RMS_EPS``, transformers' default for V4.1).
    post_scale is the fixed 2. V4.1 gives ``pre_from_previous=True``. Replace a field with
    ``dataclasses.replace``.
    """
    fields, v41 = _v4_config_fields(model_config)
    rms_eps = fields.get("norm_eps", fields.get("rms_norm_eps", V41_RMS_EPS if v41 else 1e-6))
    hc_eps = fields.get("hc_eps", 1e-6)
    # Config gains pre_from_previous with V4.1; a V4 config is built without naming it.
    schedule = {"pre_from_previous": True} if v41 else {}
    return Config(
        n=fields["hc_mult"],
        mix="sinkhorn",
        sinkhorn_iters=fields.get("hc_sinkhorn_iters", 20),
        sinkhorn_eps=hc_eps,
        rms_eps=rms_eps,
        pre_eps=hc_eps,
        post_scale=2.0,
        **schedule,
    )


def _v4_config_fields(model_config) -> tuple[Mapping, bool]:
    """The mapping that holds the mHC fields of ``model_config`` and whether it is V4.1."""
    where = "model_config"
    if not isinstance(model_config, Mapping) and callable(getattr(model_config, "to_dict", None)):
        model_config = model_config.to_dict()  # a transformers PretrainedConfig
    if not isinstance(model_config, Mapping):
        raise TypeError(
            f"config_from_v4: {where}: expected a mapping (the parsed config.json) or a transformers config, "
            f"got {type(model_config).__name__}"
        )
    model_type = model_config.get("model_type")
    if model_type == V41_COMPOSITE_MODEL_TYPE:
        text_config = model_config.get("text_config")
        if not isinstance(text_config, Mapping):
            raise KeyError(
                f"config_from_v4: {where}['text_config']: expected the text model's fields (a mapping) in a "
                f"model_type {model_type!r} config, got {type(text_config).__name__}"
            )
        where, model_config = f"{where}['text_config']", text_config
        if model_config.get("model_type", V41_MODEL_TYPE) != V41_MODEL_TYPE:
            raise ValueError(
                f"config_from_v4: {where}['model_type']: expected {V41_MODEL_TYPE!r} inside a "
                f"{V41_COMPOSITE_MODEL_TYPE!r} config, got {model_config['model_type']!r}"
            )
        model_type = V41_MODEL_TYPE
    elif model_type is not None and model_type not in MODEL_TYPES:
        accepted = ", ".join(repr(name) for name in MODEL_TYPES)
        raise ValueError(
            f"config_from_v4: {where}['model_type'] is {model_type!r}: expected one of {accepted} (DeepSeek-V4, "
            f"V4.1's text config, V4.1's composite config), or no model_type (DeepSeek's own inference config.json)"
        )
    if "hc_mult" not in model_config:
        raise KeyError(f"config_from_v4: {where}: 'hc_mult' missing (the number of residual streams n)")
    schedule = model_config.get(V41_SCHEDULE_KEY)
    if schedule is not None and not isinstance(schedule, bool):
        raise TypeError(
            f"config_from_v4: {where}[{V41_SCHEDULE_KEY!r}]: expected true or false, got {type(schedule).__name__} "
            f"{schedule!r}"
        )
    if model_type is None:
        return model_config, bool(schedule)
    v41 = model_type == V41_MODEL_TYPE
    if schedule is not None and schedule != v41:
        raise ValueError(
            f"config_from_v4: {where}[{V41_SCHEDULE_KEY!r}] is {schedule} in a model_type {model_type!r} config, "
            f"which is {'V4.1 (single-pass schedule)' if v41 else 'V4 (no carried mix)'}"
        )
    return model_config, v41


def _is_v41(config: Config) -> bool:
    return bool(getattr(config, "pre_from_previous", False))


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4 / Hugging Face
# ---------------------------------------------------------------------------------------------


def params_from_v4(
    tensors: Mapping, config: Config, *, layer: int, sublayer: str, naming: str = "v4", dim: int | None = None
) -> Params:
    """One sublayer's ``Params`` from DeepSeek-V4 tensors (a dict name -> array, f32/bf16/f16).

    Reads fn [N, M], base [N], scale [3] under ``v4_sublayer_names(layer, sublayer, naming)``;
    returns phi = fn^T [M, N], bias = base, alpha = scale and norm_weight = ones [M]. D is taken
    from fn's shape unless ``dim`` is given; every shape is checked against ``config``.
    """
    _check_config(config)
    return _params_from_names(tensors, v4_sublayer_names(layer, sublayer, naming), config, naming, dim)


def _params_from_names(tensors: Mapping, names: Mapping[str, str], config: Config, naming: str, dim) -> Params:
    fn = _lookup(tensors, names["fn"], naming)
    d = _resolve_d(names["fn"], fn.shape, 1, (config.projection_width, None), config, dim)
    m, width = config.n * d, config.projection_width
    base = _lookup(tensors, names["base"], naming)
    scale = _lookup(tensors, names["scale"], naming)
    for name, array, shape in (
        (names["fn"], fn, (width, m)),
        (names["base"], base, (width,)),
        (names["scale"], scale, (3,)),
    ):
        _check_shape(name, array, shape, config, d)
    return Params(norm_weight=np.ones((m,), np.float32), phi=np.ascontiguousarray(fn.T), alpha=scale, bias=base)


def params_to_v4(
    params: Params,
    config: Config,
    *,
    layer: int,
    sublayer: str,
    naming: str = "v4",
    fold_norm_weight: bool = False,
) -> dict[str, np.ndarray]:
    """DeepSeek-V4 tensors {fn [N, M], base [N], scale [3]} of one sublayer's ``Params``.

    V4's RMS norm before the projection has no weight. With norm_weight all ones the export is
    exact (fn = phi^T). Otherwise it raises ValueError unless ``fold_norm_weight=True``, which
    stores fn = (norm_weight[:, None] * phi)^T: the same function in exact arithmetic, but each
    product is rounded to f32 once, so the forward differs by about one f32 unit per element and
    ``params_from_v4`` gives back norm_weight = ones and the folded phi, not the original pair.
    """
    _check_config(config)
    names = v4_sublayer_names(layer, sublayer, naming)
    norm_weight, phi, alpha, bias, d = _checked_params(params, config)
    fn = phi.T
    if not np.all(norm_weight == 1.0):
        if not fold_norm_weight:
            raise ValueError(
                "params.norm_weight: DeepSeek-V4 has no norm weight and this one is not all ones; pass "
                "fold_norm_weight=True to fold it into fn (fn = (norm_weight[:, None] * phi).T, exact up to one "
                "f32 rounding per element)"
            )
        fn = (norm_weight[:, None] * phi).T
    return {names["fn"]: np.ascontiguousarray(fn), names["base"]: bias, names["scale"]: alpha}


def head_from_v4(tensors: Mapping, config: Config, *, naming: str = "v4", dim: int | None = None) -> HeadParams:
    """``HeadParams`` (fn [n, M], base [n], scale [1], stored as V4 does) from DeepSeek-V4 tensors."""
    _check_config(config)
    return _head_from_names(tensors, v4_head_names(naming), config, naming, dim)


def _head_from_names(tensors: Mapping, names: Mapping[str, str], config: Config, naming: str, dim) -> HeadParams:
    fn = _lookup(tensors, names["fn"], naming)
    d = _resolve_d(names["fn"], fn.shape, 1, (config.n, None), config, dim)
    n = config.n
    base = _lookup(tensors, names["base"], naming)
    scale = _lookup(tensors, names["scale"], naming)
    for name, array, shape in (
        (names["fn"], fn, (n, n * d)),
        (names["base"], base, (n,)),
        (names["scale"], scale, (1,)),
    ):
        _check_shape(name, array, shape, config, d)
    return HeadParams(fn=fn, base=base, scale=scale)


def head_to_v4(head: HeadParams, config: Config, *, naming: str = "v4") -> dict[str, np.ndarray]:
    """DeepSeek-V4 tensors {hc_head_fn [n, M], hc_head_base [n], hc_head_scale [1]} of ``HeadParams``."""
    _check_config(config)
    names = v4_head_names(naming)
    fn, base, scale, _ = _checked_head(head, config)
    return {names["fn"]: fn, names["base"]: base, names["scale"]: scale}


# ---------------------------------------------------------------------------------------------
# MaxText
# ---------------------------------------------------------------------------------------------


def params_from_maxtext(tree: Mapping, config: Config, *, dim: int | None = None) -> Params:
    """``Params`` from one MaxText mHC layer's parameters (the ``mhc_attention`` or ``mhc_mlp`` subtree).

    tree: {"mhc_norm": {"scale": [M]}, "pre_alpha": [M, n], "post_alpha": [M, n], "res_alpha": [M, R],
    "pre_beta": [n], "post_beta": [n], "res_beta": [n, n] (Sinkhorn) or [n!] (lite),
    "pre_alpha_scale": [1], "post_alpha_scale": [1], "res_alpha_scale": [1]}. Leaves may be arrays
    or flax.nnx variables. A scanned checkpoint stacks layers on one axis: slice it first.
    """
    _check_config(config)
    if not isinstance(tree, Mapping):
        raise TypeError(f"tree: expected a mapping of MaxText mHC parameters, got {type(tree).__name__}")
    n, r = config.n, config.residual_logits
    pre_alpha = _maxtext_leaf(tree, ("pre_alpha",))
    d = _resolve_d("pre_alpha", pre_alpha.shape, 0, (None, n), config, dim)
    m = n * d
    res_beta_shape = (n, n) if config.mix == "sinkhorn" else (r,)
    expected = {
        ("mhc_norm", "scale"): (m,),
        ("pre_alpha",): (m, n),
        ("post_alpha",): (m, n),
        ("res_alpha",): (m, r),
        ("pre_beta",): (n,),
        ("post_beta",): (n,),
        ("res_beta",): res_beta_shape,
        ("pre_alpha_scale",): (1,),
        ("post_alpha_scale",): (1,),
        ("res_alpha_scale",): (1,),
    }
    leaves = {}
    for path, shape in expected.items():
        leaves[path[-1] if len(path) == 1 else "norm_scale"] = leaf = _maxtext_leaf(tree, path)
        _check_shape(".".join(path), leaf, shape, config, d)
    return Params(
        norm_weight=leaves["norm_scale"],
        phi=np.concatenate([leaves["pre_alpha"], leaves["post_alpha"], leaves["res_alpha"]], axis=1),
        alpha=np.concatenate([leaves["pre_alpha_scale"], leaves["post_alpha_scale"], leaves["res_alpha_scale"]]),
        bias=np.concatenate([leaves["pre_beta"], leaves["post_beta"], leaves["res_beta"].reshape(-1)]),
    )


def params_to_maxtext(params: Params, config: Config) -> dict:
    """One MaxText mHC layer's parameter tree (the layout ``params_from_maxtext`` reads) of ``Params``."""
    _check_config(config)
    norm_weight, phi, alpha, bias, _ = _checked_params(params, config)
    n = config.n
    res_beta = bias[2 * n :]
    if config.mix == "sinkhorn":
        res_beta = res_beta.reshape(n, n)
    return {
        "mhc_norm": {"scale": norm_weight},
        "pre_alpha": np.ascontiguousarray(phi[:, :n]),
        "post_alpha": np.ascontiguousarray(phi[:, n : 2 * n]),
        "res_alpha": np.ascontiguousarray(phi[:, 2 * n :]),
        "pre_beta": bias[:n].copy(),
        "post_beta": bias[n : 2 * n].copy(),
        "res_beta": res_beta.copy(),
        "pre_alpha_scale": alpha[0:1].copy(),
        "post_alpha_scale": alpha[1:2].copy(),
        "res_alpha_scale": alpha[2:3].copy(),
    }


def head_from_maxtext(tree: Mapping, config: Config, *, dim: int | None = None) -> HeadParams:
    """``HeadParams`` from MaxText's ``DeepSeek4HyperHead`` parameters (the ``decoder/hc_head`` subtree):
    {"hc_fn": [M, n] (V4's fn transposed), "hc_base": [n], "hc_scale": [1]}."""
    _check_config(config)
    if not isinstance(tree, Mapping):
        raise TypeError(f"tree: expected a mapping of MaxText hc_head parameters, got {type(tree).__name__}")
    n = config.n
    hc_fn = _maxtext_leaf(tree, ("hc_fn",))
    d = _resolve_d("hc_fn", hc_fn.shape, 0, (None, n), config, dim)
    base = _maxtext_leaf(tree, ("hc_base",))
    scale = _maxtext_leaf(tree, ("hc_scale",))
    for name, array, shape in (("hc_fn", hc_fn, (n * d, n)), ("hc_base", base, (n,)), ("hc_scale", scale, (1,))):
        _check_shape(name, array, shape, config, d)
    return HeadParams(fn=np.ascontiguousarray(hc_fn.T), base=base, scale=scale)


def head_to_maxtext(head: HeadParams, config: Config) -> dict:
    """MaxText's ``DeepSeek4HyperHead`` parameters {"hc_fn": [M, n], "hc_base", "hc_scale"} of ``HeadParams``."""
    _check_config(config)
    fn, base, scale, _ = _checked_head(head, config)
    return {"hc_fn": np.ascontiguousarray(fn.T), "hc_base": base, "hc_scale": scale}


# ---------------------------------------------------------------------------------------------
# safetensors checkpoints
# ---------------------------------------------------------------------------------------------


class V4Weights(NamedTuple):
    """The mHC weights of a DeepSeek-V4 checkpoint: ``attn[k]`` and ``ffn[k]`` belong to layer ``layers[k]``."""

    layers: tuple[int, ...]
    attn: tuple[Params, ...]
    ffn: tuple[Params, ...]
    head: HeadParams | None


def load_v4(
    path: str | os.PathLike,
    config: Config,
    *,
    naming: str | None = None,
    layers: Iterable[int] | None = None,
    head: bool | None = None,
    dim: int | None = None,
) -> V4Weights:
    """Read only the mHC tensors of a safetensors checkpoint and convert them (f32, bf16 or f16 -> f32).

    path: a ``.safetensors`` file, a ``model.safetensors.index.json`` (sharded checkpoint) or a
    directory holding either (without an index, every ``*.safetensors`` in it is searched).
    naming: None (default) decides the naming from the file, separately for the layers' tensors and
    for the head's, since Hugging Face transformers' ``save_pretrained`` writes the layers under
    V4's names (``model.layers.{i}.hc_attn_fn``) and the head under its own
    (``model.hc_head.hc_fn``), and transformers' V4.1 names its layers' tensors so as well (a newer
    one with ``attn_hc`` modules: the "hf" names); "v4" or "hf" requires that naming for both.
    Either way the names may carry transformers' ``model.`` prefix or not (transformers adds or
    drops it by the class saved). layers: the layer indices to read (default: every ``layers.{i}``
    the checkpoint has; MTP layers are not included). head: also read the head; None (default) reads
    it for a V4 ``config`` and not for a V4.1 one (``config.pre_from_previous``: V4.1 has no head,
    and True then raises ValueError). Tensors are read one at a time with
    ``safetensors.safe_open``; shapes and dtypes are checked from the headers before any data is
    read. Raises KeyError naming a missing tensor, the file it was expected in and the file's
    tensors with the nearest names; ValueError for a wrong shape (expected vs got, and the file),
    TypeError for another dtype. Needs the ``safetensors`` package (``pip install safetensors``).
    """
    _check_config(config)
    if naming is not None:
        _check_choice("naming", naming, NAMINGS)
    if head is None:
        head = not _is_v41(config)
    elif not isinstance(head, bool):
        raise TypeError(f"head: expected True, False or None, got {type(head).__name__} {head!r}")
    elif head and _is_v41(config):
        raise ValueError(
            "head: DeepSeek-V4.1 (config.pre_from_previous) has no head tensors: its model ends with "
            "mhc.jax.collapse, which has no parameters; pass head=None or False"
        )
    safe_open = _import_safe_open()
    locations = _tensor_locations(path)
    if layers is None:
        layer_ids = _discover_layers(locations, naming, path)
    else:
        layer_ids = tuple(layers)
        for position, layer in enumerate(layer_ids):
            _check_layer(f"layers[{position}]", layer)
    layer_groups = _resolve_group(
        lambda style: [v4_sublayer_names(i, sublayer, style) for i in layer_ids for sublayer in SUBLAYERS],
        naming,
        locations,
        path,
    )
    groups = [("sublayer", names) for names in layer_groups]
    if head:
        groups += [("head", names) for names in _resolve_group(lambda s: [v4_head_names(s)], naming, locations, path)]
    tensors = _read_tensors(safe_open, locations, groups, config, dim)
    attn, ffn = layer_groups[0::2], layer_groups[1::2]  # SUBLAYERS order per layer
    return V4Weights(
        layers=layer_ids,
        attn=tuple(_params_from_names(tensors, names, config, naming, None) for names in attn),
        ffn=tuple(_params_from_names(tensors, names, config, naming, None) for names in ffn),
        head=_head_from_names(tensors, groups[-1][1], config, naming, None) if head else None,
    )


# transformers' base-model prefix: DeepseekV4ForCausalLM's tensors carry it, DeepseekV4Model's do not.
_MODEL_PREFIX = "model."


def _with_prefix(names: Mapping[str, str], prefixed: bool) -> dict[str, str]:
    bare = {part: name.removeprefix(_MODEL_PREFIX) for part, name in names.items()}
    return {part: _MODEL_PREFIX + name for part, name in bare.items()} if prefixed else bare


def _resolve_group(names_for, naming, locations: Mapping[str, str], path) -> list[dict[str, str]]:
    """The names of one group of tensors (the layers' or the head's): ``names_for(naming)`` gives
    the group's name dicts; each naming is tried with and without the "model." prefix (its own
    form first), and the first form holding every name wins. A real miss names the tensor missing
    from the form that holds the most, and the file's nearest names."""
    candidates = [
        [_with_prefix(names, prefixed) for names in names_for(style)]
        for style in (NAMINGS if naming is None else (naming,))
        for prefixed in ((False, True) if style == "v4" else (True, False))
    ]
    present = [sum(name in locations for names in group for name in names.values()) for group in candidates]
    best = candidates[present.index(max(present))]
    for names in best:
        for name in names.values():
            if name not in locations:
                raise KeyError(
                    f"{name}: not found in {os.fspath(path)} ({_naming_text(naming)})"
                    f"{_naming_hint(name, locations, naming)}{_nearest_hint(name, locations)}"
                )
    return best


def _naming_text(naming) -> str:
    if naming is None:
        return "naming decided from the file: v4 or hf names, with or without the 'model.' prefix"
    return f"naming={naming!r}"


def _nearest_hint(name: str, available: Iterable[str]) -> str:
    nearest = difflib.get_close_matches(name, list(available), n=3, cutoff=0.6)
    if not nearest:
        return "; no tensor in it has a similar name"
    return "; the nearest names in it: " + ", ".join(nearest)


def _import_safe_open():
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise ImportError(
            "mhc.interop.load_v4 needs the safetensors package: pip install safetensors (or mhc[interop])"
        ) from error
    return safe_open


def _tensor_locations(path) -> dict[str, str]:
    """Tensor name -> the file that holds it."""
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, _INDEX_FILE)
        if os.path.isfile(index):
            return _index_locations(index)
        files = sorted(os.path.join(path, name) for name in os.listdir(path) if name.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"path: no {_INDEX_FILE} and no *.safetensors file in directory {path}")
        locations = {}
        for file in files:
            locations.update(dict.fromkeys(_file_keys(file), file))
        return locations
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: {path} does not exist")
    if path.endswith(".json"):
        return _index_locations(path)
    return dict.fromkeys(_file_keys(path), path)


def _index_locations(index: str) -> dict[str, str]:
    with open(index, encoding="utf-8") as handle:
        try:
            weight_map = json.load(handle).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as error:
            raise ValueError(f"{index}: expected a safetensors index (JSON with a 'weight_map'), {error}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: expected a safetensors index with a 'weight_map' object")
    folder = os.path.dirname(index)
    return {name: os.path.join(folder, file) for name, file in weight_map.items()}


def _file_keys(file: str) -> list[str]:
    with _open_safetensors(_import_safe_open(), file) as handle:
        return list(handle.keys())


def _open_safetensors(safe_open, file: str):
    # framework="flax": NumPy has no bfloat16, and V4 checkpoints may store these tensors in it.
    try:
        return safe_open(file, framework="flax")
    except Exception as error:  # safetensors raises its own SafetensorError (an Exception) for bad headers
        raise ValueError(f"{file}: not a readable safetensors file ({error})") from error


def _discover_layers(locations: Mapping[str, str], naming, path) -> tuple[int, ...]:
    first_fn = {"v4": r"layers\.(\d+)\.hc_attn_fn", "hf": r"layers\.(\d+)\.attn_hc\.fn"}
    patterns = [rf"(?:model\.)?{first_fn[style]}" for style in (NAMINGS if naming is None else (naming,))]
    found = sorted(
        {int(match.group(1)) for name in locations for pattern in patterns if (match := re.fullmatch(pattern, name))}
    )
    if not found:
        example = v4_sublayer_names(0, "attn", naming or "v4")["fn"]
        raise KeyError(
            f"{example}: no mHC layer tensors in {os.fspath(path)} ({_naming_text(naming)})"
            f"{_naming_hint(example, locations, naming)}{_nearest_hint(example, locations)}"
        )
    return tuple(found)


def _naming_hint(name: str, available: Mapping, naming) -> str:
    """With a naming forced, say so when the checkpoint uses the other one."""
    if naming is None:
        return ""
    other = NAMINGS[1 - NAMINGS.index(naming)]
    match = re.search(r"layers\.(\d+)\.", name)
    layer = int(match.group(1)) if match else 0
    other_names = [v4_head_names(other)["fn"]] + [v4_sublayer_names(layer, s, other)["fn"] for s in SUBLAYERS]
    other_names = [prefix + n.removeprefix(_MODEL_PREFIX) for n in other_names for prefix in ("", _MODEL_PREFIX)]
    if any(candidate in available for candidate in other_names):
        return f"; the tensors look like naming={other!r}"
    return ""


def _read_tensors(safe_open, locations, groups, config: Config, d) -> dict[str, np.ndarray]:
    """The tensors of ``groups`` (("sublayer" | "head", {"fn": name, ...}), ...) as float32."""
    names = [name for _, group in groups for name in group.values()]
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(locations[name], []).append(name)
    with contextlib.ExitStack() as stack:
        handles = {}
        for file, file_names in by_file.items():
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{file}: missing (the index lists {file_names[0]} in it)")
            handles[file] = stack.enter_context(_open_safetensors(safe_open, file))
        shapes = {}
        for file, file_names in by_file.items():
            available = set(handles[file].keys())
            for name in file_names:
                if name not in available:
                    raise KeyError(f"{name}: not found in {file}")
                view = handles[file].get_slice(name)
                if view.get_dtype() not in _SAFETENSORS_DTYPES:
                    raise TypeError(f"{name} (in {file}): expected dtype F32, BF16 or F16, got {view.get_dtype()}")
                shapes[name] = tuple(view.get_shape())
        # Every shape is checked against one D before any data is read, so a bad file fails fast.
        kind, first = groups[0]
        rows = config.n if kind == "head" else config.projection_width
        d = _resolve_d(f"{first['fn']} (in {locations[first['fn']]})", shapes[first["fn"]], 1, (rows, None), config, d)
        m = config.n * d
        for kind, group in groups:
            rows = config.n if kind == "head" else config.projection_width
            expected = {"fn": (rows, m), "base": (rows,), "scale": (1,) if kind == "head" else (3,)}
            for part, name in group.items():
                if shapes[name] != expected[part]:
                    raise ValueError(
                        f"{name} (in {locations[name]}): expected shape {expected[part]} for "
                        f"{_describe(config, d)}, got {shapes[name]}"
                    )
        return {name: _float32(name, handles[locations[name]].get_tensor(name)) for name in names}


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def _describe(config: Config, d) -> str:
    return f"n={config.n}, D={d}, mix={config.mix!r}"


def _check_config(config) -> None:
    if not isinstance(config, Config):
        raise TypeError(f"config: expected mhc.jax.Config, got {type(config).__name__}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def _check_layer(name: str, layer) -> None:
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"{name}: expected a layer index (int >= 0), got {type(layer).__name__} {layer!r}")
    if layer < 0:
        raise ValueError(f"{name}: expected a layer index >= 0, got {layer}")


def _float32(name: str, value) -> np.ndarray:
    """value as a new float32 array; only conversions that cannot round are allowed."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            f"{name}: expected an array of float32, bfloat16 or float16, got {type(value).__name__} ({error})"
        ) from None
    if array.dtype.name in _EXACT_DTYPES:
        return np.array(array, dtype=np.float32)
    if array.dtype == np.float64:
        converted = array.astype(np.float32)
        if np.array_equal(converted.astype(np.float64), array, equal_nan=True):
            return converted
        raise TypeError(f"{name}: float64 values that float32 cannot hold exactly; convert them to float32 first")
    raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {array.dtype}")


def _lookup(tensors, name: str, naming: str) -> np.ndarray:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors: expected a mapping from tensor name to array, got {type(tensors).__name__}")
    if name not in tensors:
        raise KeyError(
            f"{name}: missing from tensors (naming={naming!r}){_naming_hint(name, tensors, naming)}"
            f"{_nearest_hint(name, tensors)}"
        )
    return _float32(name, tensors[name])


def _maxtext_leaf(tree: Mapping, path: tuple[str, ...]) -> np.ndarray:
    node = tree
    for depth, key in enumerate(path):
        if not isinstance(node, Mapping) or key not in node:
            raise KeyError(f"{'.'.join(path[: depth + 1])}: missing from the MaxText parameter tree")
        node = node[key]
    # flax.nnx variables (and their states) keep the array in .value.
    inner = getattr(node, "value", None)
    if inner is not None and hasattr(inner, "shape"):
        node = inner
    return _float32(".".join(path), node)


def _resolve_d(name: str, shape: tuple, m_axis: int, pattern: tuple, config: Config, dim) -> int:
    """D from the M = n*D axis of a 2-D weight, or the given ``dim`` (checked)."""
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise ValueError(f"dim: expected an int >= 1, got {dim!r}")
        return int(dim)
    shape = tuple(shape)
    if len(shape) == 2 and shape[m_axis] >= config.n and shape[m_axis] % config.n == 0:
        return shape[m_axis] // config.n
    wanted = tuple(f"{config.n}*D" if size is None else size for size in pattern)
    wanted_text = "(" + ", ".join(str(size) for size in wanted) + ")"
    raise ValueError(f"{name}: expected shape {wanted_text} for n={config.n}, mix={config.mix!r} (D >= 1), got {shape}")


def _check_shape(name: str, array: np.ndarray, expected: tuple, config: Config, d: int) -> None:
    if tuple(array.shape) != tuple(expected):
        raise ValueError(
            f"{name}: expected shape {tuple(expected)} for {_describe(config, d)}, got {tuple(array.shape)}"
        )


def _checked_params(params, config: Config):
    if not isinstance(params, Params):
        raise TypeError(f"params: expected mhc.jax.Params, got {type(params).__name__}")
    fields = {name: _float32(f"params.{name}", getattr(params, name)) for name in Params._fields}
    phi = fields["phi"]
    d = _resolve_d("params.phi", phi.shape, 0, (None, config.projection_width), config, None)
    m, width = config.n * d, config.projection_width
    expected = {"norm_weight": (m,), "phi": (m, width), "alpha": (3,), "bias": (width,)}
    for name, shape in expected.items():
        _check_shape(f"params.{name}", fields[name], shape, config, d)
    return fields["norm_weight"], phi, fields["alpha"], fields["bias"], d


def _checked_head(head, config: Config):
    if not isinstance(head, HeadParams):
        raise TypeError(f"head: expected mhc.jax.HeadParams, got {type(head).__name__}")
    fields = {name: _float32(f"head.{name}", getattr(head, name)) for name in HeadParams._fields}
    d = _resolve_d("head.fn", fields["fn"].shape, 1, (config.n, None), config, None)
    n = config.n
    for name, shape in {"fn": (n, n * d), "base": (n,), "scale": (1,)}.items():
        _check_shape(f"head.{name}", fields[name], shape, config, d)
    return fields["fn"], fields["base"], fields["scale"], d


__all__ = [
    "MODEL_TYPES",
    "NAMINGS",
    "SUBLAYERS",
    "V41_COMPOSITE_MODEL_TYPE",
    "V41_MODEL_TYPE",
    "V41_RMS_EPS",
    "V41_SCHEDULE_KEY",
    "V4_MODEL_TYPE",
    "V4Weights",
    "config_from_v4",
    "head_from_maxtext",
    "head_from_v4",
    "head_to_maxtext",
    "head_to_v4",
    "load_v4",
    "params_from_maxtext",
    "params_from_v4",
    "params_to_maxtext",
    "params_to_v4",
    "v4_head_names",
    "v4_sublayer_names",
]

"""mhc.models' Transformer (the mHC residuals) in float64: the oracle of a whole small model's
logits, loss and parameter gradients, against which each f32 evaluation (kernel, plain, recompute) is checked
with the one accuracy rule (conftest.assert_matches), never against another f32 evaluation.

The mHC chain, V4's head and V4.1's collapse come from numpy_reference (through
conftest.chain_values / carried_chain_values); the model's own pieces (embedding, RMSNorm,
causal attention, the tanh GELU MLP, the final norm, the logits and the cross entropy) are their
textbook formulas in float64 JAX (x64 mode), written here from the formulas rather than by running
mhc.models' f32 code (its attention keeps its logits in f32), so the oracle shares no rounding with
what it checks.
"""

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mhc.jax as mj
import numpy_reference
from conftest import assert_matches, carried_chain_values, chain_values, round_by_one_unit
from mhc.models import MHC_RESIDUALS

# The branches and the logits are jitted (x64 traces its own): eager float64 JAX compiles every
# operation apart, 20 s for this oracle on the shared host.


def _rms_norm(h, scale, epsilon):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + epsilon) * scale


@functools.partial(jax.jit, static_argnames=("heads", "epsilon"))
def _attention_branch(layer_in, norm_scale, qkv, out, *, heads, epsilon):
    batch, seq, width = layer_in.shape
    h = _rms_norm(layer_in, norm_scale, epsilon)
    q, k, v = jnp.split((h @ qkv).reshape(batch, seq, 3 * heads, width // heads), 3, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // heads)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, width) @ out


@functools.partial(jax.jit, static_argnames=("epsilon",))
def _mlp_branch(layer_in, norm_scale, up, up_bias, down, down_bias, *, epsilon):
    h = _rms_norm(layer_in, norm_scale, epsilon)
    return jax.nn.gelu(h @ up + up_bias, approximate=True) @ down + down_bias


def _logits_loss(h, final_scale, head, targets, epsilon):
    log_probs = jax.nn.log_softmax(_logits(h, final_scale, head, epsilon), axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


@functools.partial(jax.jit, static_argnums=3)
def _logits(h, final_scale, head, epsilon):
    return _rms_norm(h, final_scale, epsilon) @ head


def _flat_params(p, path):
    """An mHC layer's parameters in mhc.jax's flat Params layout (ManifoldConstrainedHyperConnections.params)."""
    phi = p[(*path, "phi")]
    return mj.Params(
        p[(*path, "norm_weight")].reshape(-1), phi.reshape(-1, phi.shape[-1]), p[(*path, "alpha")], p[(*path, "bias")]
    )


_logits_loss_and_grads = jax.jit(jax.value_and_grad(_logits_loss, argnums=(0, 1, 2)), static_argnums=4)


def model_parameters(model) -> dict:
    """{path: the parameter's value as f32 NumPy} in nnx.to_flat_state's order."""
    return {path: np.asarray(value[...]) for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _float64_parameters(model, parameters):
    config = model.config
    if config.residual not in MHC_RESIDUALS:
        raise ValueError(f"residual: the float64 model covers {MHC_RESIDUALS}, got {config.residual!r}")
    return {path: np.asarray(value, np.float64) for path, value in (parameters or model_parameters(model)).items()}


def _chain(model, p, tokens):
    """The embedded tokens as n streams and the chain's sublayers (chain_values' form), float64."""
    config, mhc_config = model.config, model.config.mhc_config()
    embedded = p[("embed", "embedding")][tokens]
    streams = np.broadcast_to(embedded[..., None, :], (*embedded.shape[:-1], config.n, config.width))
    sublayers = []
    for index, block in enumerate(model.blocks):
        b = ("blocks", index)
        attention = (p[(*b, "attn_norm", "scale")], p[(*b, "attn", "qkv", "kernel")], p[(*b, "attn", "out", "kernel")])
        mlp = (
            p[(*b, "mlp_norm", "scale")],
            *(p[(*b, "mlp", layer, name)] for layer in ("up", "down") for name in ("kernel", "bias")),
        )
        attention_branch = functools.partial(_attention_branch, heads=config.heads, epsilon=block.attn_norm.epsilon)
        sublayers.append((_flat_params(p, (*b, "attn_hc")), mhc_config, attention_branch, attention))
        mlp_branch = functools.partial(_mlp_branch, epsilon=block.mlp_norm.epsilon)
        sublayers.append((_flat_params(p, (*b, "mlp_hc")), mhc_config, mlp_branch, mlp))
    values = carried_chain_values if mhc_config.pre_from_previous else chain_values
    return streams, sublayers, values


def _collapsed(model, p, out, noise):
    """The chain's out as one stream: V4's head, the sum, or (V4.1) out itself, the collapse."""
    collapse = model.config.final_collapse
    if collapse == "head":
        head = tuple(p[("collapse", name)] for name in ("fn", "base", "scale"))
        no_cotangent = np.zeros(out.shape[:-2] + out.shape[-1:])
        return numpy_reference.head_values(out, head, model.config.mhc_config(), no_cotangent, noise)[0]
    return out.sum(axis=-2) if collapse == "sum" else out


def transformer_logits(model, tokens, parameters=None, noise=None):
    """The model's logits [batch, seq, vocab] in float64 (arguments as transformer_values'): the
    chain's forward alone (chain_values' backward would compile the branches' VJPs)."""
    p = _float64_parameters(model, parameters)
    streams, sublayers, _ = _chain(model, p, np.asarray(tokens))
    carried = None
    with jax.enable_x64(True):
        for params, config, branch, branch_args in sublayers:
            no_layer_out = np.zeros(streams.shape[:-2] + streams.shape[-1:])  # layer_in does not read it
            if config.pre_from_previous:
                cotangents = (no_layer_out, np.zeros(streams.shape[:-1]), np.zeros(streams.shape))
                layer_in = numpy_reference.carried_values(streams, no_layer_out, params, config, carried, *cotangents)[
                    "layer_in"
                ]
                layer_out = np.asarray(branch(jnp.asarray(layer_in), *map(jnp.asarray, branch_args)))
                values = numpy_reference.carried_values(streams, layer_out, params, config, carried, *cotangents, noise)
                streams, carried = values["out"], values["h_pre"]
            else:
                layer_in = numpy_reference.forward(streams, no_layer_out, params, config, noise)[0]
                layer_out = np.asarray(branch(jnp.asarray(layer_in), *map(jnp.asarray, branch_args)))
                streams = numpy_reference.forward(streams, layer_out, params, config, noise)[1]
        if carried is not None:
            streams = numpy_reference.collapse_values(
                streams, carried, np.zeros(streams.shape[:-2] + streams.shape[-1:])
            )[0]
        h = _collapsed(model, p, streams, noise)
        scale, head = jnp.asarray(p[("final_norm", "scale")]), jnp.asarray(p[("head", "kernel")])
        return np.asarray(_logits(jnp.asarray(h), scale, head, model.final_norm.epsilon))


def transformer_values(model, tokens, targets, parameters=None, noise=None) -> tuple[float, dict]:
    """(loss, {path: dloss/dparameter}) of ``mhc.models.loss_fn(model, tokens, targets)`` in
    float64, paths as nnx.to_flat_state(nnx.state(grads)) names them. parameters: {path: value}
    in place of the model's (model_parameters; moved ones for the spread), the model supplying
    the structure; noise: numpy_reference's noise= for the mHC parts."""
    config = model.config
    p = _float64_parameters(model, parameters)
    mhc_config = config.mhc_config()
    tokens, targets = np.asarray(tokens), np.asarray(targets)
    streams, sublayers, values = _chain(model, p, tokens)
    epsilon = model.final_norm.epsilon

    tail = {}

    def loss_cotangent(out):
        """The loss' cotangent of the chain's out (the streams; V4.1: the collapsed h), and the
        loss and the gradients of the collapse, the final norm and the logits on the way."""
        h = _collapsed(model, p, out, noise)
        with jax.enable_x64(True):
            loss, (dh, dscale, dhead) = _logits_loss_and_grads(
                jnp.asarray(h),
                jnp.asarray(p[("final_norm", "scale")]),
                jnp.asarray(p[("head", "kernel")]),
                jnp.asarray(targets),
                epsilon,
            )
        tail.update(loss=float(loss), final_scale=np.asarray(dscale), head=np.asarray(dhead))
        dh = np.asarray(dh)
        if config.final_collapse == "head":
            head = tuple(p[("collapse", name)] for name in ("fn", "base", "scale"))
            _, dout, *dcollapse = numpy_reference.head_values(out, head, mhc_config, dh, noise)
            tail.update(collapse=dcollapse)
            return dout
        if config.final_collapse == "sum":
            return np.broadcast_to(dh[..., None, :], out.shape)
        return dh

    _, dstreams, dmhc, dbranches = values(streams, sublayers, loss_cotangent, noise=noise)
    grads = {("embed", "embedding"): np.zeros_like(p[("embed", "embedding")])}
    np.add.at(grads[("embed", "embedding")], tokens, dstreams.sum(axis=-2))
    for index in range(len(model.blocks)):
        b = ("blocks", index)
        for name, dparams, dbranch, branch_names in (
            ("attn", dmhc[2 * index], dbranches[2 * index], ("attn_norm/scale", "attn/qkv/kernel", "attn/out/kernel")),
            (
                "mlp",
                dmhc[2 * index + 1],
                dbranches[2 * index + 1],
                ("mlp_norm/scale", "mlp/up/kernel", "mlp/up/bias", "mlp/down/kernel", "mlp/down/bias"),
            ),
        ):
            for field, value in zip(("norm_weight", "phi", "alpha", "bias"), dparams, strict=True):
                path = (*b, f"{name}_hc", field)
                grads[path] = np.reshape(value, p[path].shape)
            for branch_name, value in zip(branch_names, dbranch, strict=True):
                grads[(*b, *branch_name.split("/"))] = value
    grads[("final_norm", "scale")] = tail["final_scale"]
    grads[("head", "kernel")] = tail["head"]
    if config.final_collapse == "head":
        for field, value in zip(("fn", "base", "scale"), tail["collapse"], strict=True):
            grads[("collapse", field)] = value
    return tail["loss"], grads


def assert_model_gradients_match(evaluations: dict, model, tokens, targets, context=""):
    """Each f32 loss gradient in evaluations ({label: nnx.to_flat_state(nnx.state(grads))}, e.g.
    the kernel, plain and recompute paths of models with the same parameters as `model`), every
    leaf, against transformer_values with the one accuracy rule: the spec's f32 bound 1e-5, or
    SPREAD_MULTIPLE x the oracle's spread on parameters moved by one f32 unit. The moved oracles
    (0.4 s each) are drawn once, seeded by the context, and shared: each leaf measures its spread
    on as many of them as spread_draws asks for its size."""
    _, want = transformer_values(model, tokens, targets)
    parameters = model_parameters(model)
    rng = np.random.default_rng(zlib.crc32(f"model gradients {context}".encode()))
    moved_oracles = []

    def moved_oracle(index):
        while len(moved_oracles) <= index:
            moved = {path: round_by_one_unit(rng, value) for path, value in parameters.items()}
            moved_oracles.append(transformer_values(model, tokens, targets, moved, noise=rng)[1])
        return moved_oracles[index]

    for label, grads in evaluations.items():
        assert {path for path, _ in grads} == set(want), (
            f"{label}: the gradient's leaves are not the model's parameters"
        )
        for path, got in grads:
            draws = itertools.count()
            perturbed = lambda _rng, path=path, draws=draws: moved_oracle(next(draws))[path]  # noqa: E731
            assert_matches(
                "/".join(map(str, path)), np.asarray(got[...]), want[path], 1e-5, perturbed, f"({label}) {context}"
            )


def assert_logits_match(evaluations: dict, model, tokens, context=""):
    """Each f32 evaluation of the model's logits in evaluations ({label: logits}) against
    transformer_logits with the one accuracy rule (f32 bound 1e-5, or SPREAD_MULTIPLE x the
    oracle's spread on parameters moved by one f32 unit)."""
    want = transformer_logits(model, tokens)
    parameters = model_parameters(model)

    def perturbed(rng):
        moved = {path: round_by_one_unit(rng, value) for path, value in parameters.items()}
        return transformer_logits(model, tokens, moved, noise=rng)

    for label, logits in evaluations.items():
        assert_matches("logits", logits, want, 1e-5, perturbed, f"({label}) {context}")


def transformer_loss(model, tokens, targets, parameters=None, noise=None) -> float:
    """mhc.models.loss_fn (the mean cross entropy) in float64, from transformer_logits."""
    logits = transformer_logits(model, tokens, parameters, noise)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return float(-np.mean(np.take_along_axis(log_probs, np.asarray(targets)[..., None], axis=-1)))


def assert_loss_matches(evaluations: dict, model, tokens, targets, context=""):
    """Each f32 loss in evaluations ({label: loss}) against transformer_loss with the one accuracy
    rule (f32 bound 1e-5, or SPREAD_MULTIPLE x the oracle's spread)."""
    want = transformer_loss(model, tokens, targets)
    parameters = model_parameters(model)

    def perturbed(rng):
        moved = {path: round_by_one_unit(rng, value) for path, value in parameters.items()}
        return transformer_loss(model, tokens, targets, moved, noise=rng)

    for label, loss in evaluations.items():
        assert_matches("loss", np.float32(loss), want, 1e-5, perturbed, f"({label}) {context}")

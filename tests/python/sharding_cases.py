"""The kernels under plain jax.jit with sharded arrays, on 8 forced CPU devices, against the
float64 oracle (conftest.assert_matches' one rule; numpy_reference, conftest.chain_values).

Run by test_sharding.py in a subprocess (XLA_FLAGS must be set before JAX starts), once per
partitioner: ``python sharding_cases.py SEED shardy|gspmd [padded-rows]``. Exits non-zero on the first mismatch
and prints one "ok:" line per passing case.

For each layout (tokens over one axis, batch and sequence over two, tokens and D, D alone, a
mesh axis of size 1), each dtype and each mix: the forward values and every gradient match the
float64 oracle, the outputs come back sharded like x, and the compiled forward and gradient hold no
collective but the all-reduces the partitioning rules name (docs/sharding.md). Padded
token rows that hold values (the masks of the backwards), and the same operations inside
jax.shard_map with tokens and D split (tensor_axis).
"""

import functools
import math
import os
import re
import sys

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "run via test_sharding.py"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mhc.jax as mj  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import numpy_reference  # noqa: E402
from conftest import (  # noqa: E402
    assert_chain_matches,
    assert_matches,
    assert_sublayer_matches_reference,
    bf16_rounding,
    chain_values,
    head_loss_values,
    perturbed_chain_values,
    random_params,
    round_by_one_unit,
    tanh_sublayer_values,
)

N_STREAMS, D = 4, 32
SHAPE = (8, 6, N_STREAMS, D)  # [batch, seq, n, D]: 48 tokens
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}  # spec: Accuracy
ROUNDING = {jnp.float32: None, jnp.bfloat16: bf16_rounding}  # the oracles' rounding= per dtype

_COLLECTIVE = re.compile(
    r"= (\([^)]*\)|\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter|collective-broadcast)"
    r"(?:-start)?\("
)


def collectives(hlo: str) -> list:
    """(op, element shape) for every collective in compiled HLO text; a tuple result counts once
    per element (XLA combines independent all-reduces)."""
    found = []
    for shape, op in _COLLECTIVE.findall(hlo):
        found.extend((op, element) for element in re.findall(r"\w+\[[\d,]*\]", shape))
    return found


def make_config(mix):
    return mj.Config(n=N_STREAMS, mix=mix, sinkhorn_iters=3 if mix == "sinkhorn" else 20, pre_eps=0.1, post_scale=1.3)


@functools.cache
def inputs(mix, dtype, seed, shape=SHAPE):
    config = make_config(mix)
    kx, kp, kw, kl = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, shape).astype(dtype)
    params = random_params(kp, config, shape[-1])
    w = jax.random.normal(kw, shape)
    w_in = jax.random.normal(kl, shape[:-2] + shape[-1:])
    return config, x, params, w, w_in


def programs(config, w, w_in, constrain=None):
    """forward(x, params) -> (out, layer_in); gradient(x, params) -> (dx, dparams). Random
    cotangents; ``constrain`` reshards x first (inside jit). Everything between the mHC operations
    runs in f32 on layer_in read once, so the program rounds only at the operations' own bf16
    inputs and outputs, which programs_oracle models."""

    def forward(x, params):
        if constrain is not None:
            x = jax.lax.with_sharding_constraint(x, constrain)
        layer_in, ctx = mj.pre(x, params, config)
        wide = layer_in.astype(jnp.float32)
        return mj.post(jnp.tanh(wide).astype(layer_in.dtype), ctx), wide

    def loss(x, params):
        out, layer_in = forward(x, params)
        # exp: a cotangent that is not 0 where layer_in is 0, as on rows XLA pads.
        return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(layer_in * w_in) + jnp.sum(jnp.exp(layer_in / 4))

    return forward, jax.grad(loss, argnums=(0, 1))


def programs_oracle(config, x, params, w, w_in, noise=None, rounding=None):
    """programs' forward and gradient in float64: ((out, layer_in), (dx, dparams)); the loss's
    cotangents are w for out and w_in + exp(layer_in / 4) / 4 for layer_in. rounding: a bf16
    program's (conftest.bf16_rounding)."""
    w, w_in = (np.asarray(v, np.float64) for v in (w, w_in))
    direct = lambda li: w_in + np.exp(li / 4) / 4  # noqa: E731
    v = tanh_sublayer_values(x, params, config, 0.0, w, direct, noise, rounding)
    return (v["out"], v["layer_in"]), (v["dx"], v["dparams"])


@functools.cache
def oracle(mix, dtype, seed, shape=SHAPE):
    """programs_oracle on inputs(mix, dtype, seed, shape), and perturbed(rng): the same on inputs
    moved by one f32 unit with noise=rng (the spread of conftest.assert_matches' rule)."""
    config, x, params, w, w_in = inputs(mix, dtype, seed, shape)
    rounding = ROUNDING[dtype]

    def perturbed(rng):
        moved = (round_by_one_unit(rng, v) for v in (x, params, w, w_in))
        return programs_oracle(config, *moved, noise=rng, rounding=rounding)

    return programs_oracle(config, x, params, w, w_in, rounding=rounding), perturbed


def compare(name, got, want, perturbed, dtype, seed):
    """Each leaf of got (an f32 or bf16 evaluation on sharded arrays) against the same leaf of the
    float64 want with the one accuracy rule (conftest.assert_matches; the spec's bound for the
    case's dtype, every gradient included), perturbed(rng) giving want's tree on moved inputs."""
    leaves = jax.tree_util.tree_leaves_with_path(got)
    wanted = jax.tree.leaves(want)
    assert len(leaves) == len(wanted), f"{name}: {len(leaves)} results for {len(wanted)} oracle values"
    for index, ((path, value), expected) in enumerate(zip(leaves, wanted, strict=True)):
        assert np.shape(value) == np.shape(expected), f"{name}: {jax.tree_util.keystr(path)} shape {np.shape(value)}"

        def resample(rng, index=index):
            return jax.tree.leaves(perturbed(rng))[index]

        label = f"{name}: {jax.tree_util.keystr(path)}"
        assert_matches(label, value, expected, TOLERANCE[dtype], resample, f"(seed {seed})")


def chain_oracle(x, sublayers, target, rng=None, output=lambda v: v, rounding=None) -> dict:
    """A V4 chain (conftest.chain_values' sublayers) and the loss sum((its streams - target)^2)
    in float64: "out", "loss", "dx", "dparams" (one per sublayer), "dbranch" (the branch
    arguments' gradients, one tuple per sublayer); with rng, on inputs moved by one f32 unit and
    noise=rng (conftest.perturbed_chain_values). output: the rounding of the streams the loss
    sees (a bf16 chain's); rounding: conftest.chain_values'."""
    target = np.asarray(target, np.float64)

    def dout(out):
        return 2.0 * (output(out) - target)

    if rng is None:
        values = chain_values(x, sublayers, dout, rounding=rounding)
    else:
        values = perturbed_chain_values(rng, x, sublayers, dout, rounding=rounding)
    out, dx, dparams, dbranch = values
    return dict(out=out, loss=np.sum(np.square(out - target)), dx=dx, dparams=dparams, dbranch=dbranch)


def normalized(spec, ndim, mesh) -> tuple:
    """A spec as one tuple of axis names per dimension, without axes of size 1."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    names = ((e,) if isinstance(e, str) else tuple(e or ()) for e in entries)
    return tuple(tuple(a for a in entry if mesh.shape[a] > 1) for entry in names)


def check(label, mesh_shape, axis_names, spec, mix, dtype, seed):
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), axis_names)
    config, x, params, w, w_in = inputs(mix, dtype, seed)
    name = f"{label} mesh {dict(mesh.shape)} x {spec} {mix} {jnp.dtype(dtype).name}"
    forward, gradient = programs(config, w, w_in)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    forward_compiled = jax.jit(forward).lower(xs, params).compile()
    gradient_compiled = jax.jit(gradient).lower(xs, params).compile()
    got = forward_compiled(xs, params), gradient_compiled(xs, params)
    compare(name, got, *oracle(mix, dtype, seed), dtype, seed)

    # Outputs sharded like x: out and dx as x, layer_in as x without the streams axis.
    (out, layer_in), (dx, _) = got
    x_spec = normalized(spec, 4, mesh)
    for what, array, expected in (
        ("out", out, x_spec),
        ("dx", dx, x_spec),
        ("layer_in", layer_in, x_spec[:2] + x_spec[3:]),
    ):
        actual = normalized(array.sharding.spec, array.ndim, mesh)
        assert actual == expected, f"{name}: {what} comes back sharded {actual}, x is {expected}"

    # Only the all-reduces the rules name: the forward's [tokens, N+1] partials and the backward's
    # dh_pre [tokens, n] and dh_post|dh_res [tokens * (n + n^2)] when D is split, the parameter
    # gradients once when the tokens are; the only gathers are of parameter gradients (the
    # parameters are replicated, so are their gradients), never of anything with tokens.
    n, width = config.n, config.projection_width
    token_split = int(np.prod([mesh.shape[a] for entry in x_spec[:2] for a in entry]))
    slices = int(np.prod([mesh.shape[a] for a in x_spec[3]]))
    tokens, dl = 48 // token_split, D // slices
    partials = [("all-reduce", f"f32[{tokens},{width + 1}]")] if slices > 1 else []
    forward_collectives = collectives(forward_compiled.as_text())
    assert forward_collectives == partials, f"{name}: forward collectives {forward_collectives}"
    allowed = set(partials)
    if slices > 1:
        allowed |= {("all-reduce", f"f32[{tokens},{n}]"), ("all-reduce", f"f32[{tokens * (n + n * n)}]")}
        allowed |= {("all-gather", f"f32[{n},{D}]"), ("all-gather", f"f32[{n},{D},{width}]")}
    parameter_sum = ("all-reduce", f"f32[{n * dl * (width + 1) + 3 + width}]")
    if token_split > 1:
        allowed.add(parameter_sum)
    backward = collectives(gradient_compiled.as_text())
    assert set(backward) <= allowed, f"{name}: unexpected collectives in the gradient {set(backward) - allowed}"
    assert backward.count(parameter_sum) == (token_split > 1), f"{name}: parameter-gradient all-reduces {backward}"
    if slices > 1:
        assert backward.count(("all-reduce", f"f32[{tokens},{n}]")) == 1, f"{name}: dh_pre all-reduces {backward}"
    print(f"ok: {name}")


def check_no_raw_custom_call(seed):
    """Every FFI call sits inside a partitioned operation: none is left for XLA to gather."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
    config, x, params, w, w_in = inputs("sinkhorn", jnp.float32, seed)
    _, gradient = programs(config, w, w_in)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None, "tensor")))
    lowered = jax.jit(gradient).lower(xs, params).as_text()
    raw = sorted(set(re.findall(r"custom_call @(mhc_\w+)", lowered)))
    assert not raw, f"custom calls without a partitioning rule: {raw}"
    assert "CustomSPMDPartitioning" in lowered
    print("ok: no custom call outside a partitioning rule")


def check_padded_and_gathered(mix, seed):
    """Token counts that do not divide (XLA pads), and a mesh axis on the streams (gathered):
    values only."""
    shape = (6, 5, N_STREAMS, D)
    config, x, params, w, w_in = inputs(mix, jnp.float32, seed, shape)
    want, perturbed = oracle(mix, jnp.float32, seed, shape)
    cases = {
        "uneven tokens": ((4, 2), ("data", "seq"), P("data", "seq")),
        "uneven tokens and D": ((4, 2), ("data", "tensor"), P("data", None, None, "tensor")),
        "streams axis": ((2, 4), ("data", "streams"), P("data", None, "streams")),
    }
    for label, (mesh_shape, names, spec) in cases.items():
        mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
        forward, gradient = programs(config, w, w_in, constrain=NamedSharding(mesh, spec))
        got = jax.jit(forward)(x, params), jax.jit(gradient)(x, params)
        compare(f"{label} {mix}", got, want, perturbed, jnp.float32, seed)
        print(f"ok: {label} {mix}")


def check_boundary_chain(seed):
    """Three sublayers chained by mj.sublayer (two fused boundaries), sharded: the loss and every
    gradient against the float64 chain (conftest.chain_values). Tokens split (evenly, or padded
    by XLA): each device runs the fused boundary kernels; D split: the separate operations (no boundary custom call)."""
    config, x, _, w, _ = inputs("sinkhorn", jnp.float32, seed)
    layers = [random_params(key, config, D) for key in jax.random.split(jax.random.key(seed + 1), 3)]
    mix = jax.random.normal(jax.random.key(seed + 2), (D, D)) / np.sqrt(D)

    def loss(x, w, layers, constrain):
        x = jax.lax.with_sharding_constraint(x, constrain) if constrain is not None else x
        state = x
        for params in layers:
            state = mj.sublayer(state, params, config, lambda h: jnp.tanh(h @ mix))
        # Squares: a signed sum over the tokens can cancel far below its terms (as in check_head).
        return jnp.sum(jnp.square(mj.finish(state) - w))

    gradient = jax.value_and_grad(loss, argnums=(0, 2))
    cases = {
        "tokens": ((8,), ("data",), P("data"), 6, True),
        "uneven tokens": ((4, 2), ("data", "seq"), P("data", "seq"), 5, True),
        "tokens+D": ((2, 4), ("data", "tensor"), P("data", None, None, "tensor"), 6, False),
    }
    for label, (mesh_shape, names, spec, seq, fused) in cases.items():
        mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
        xs, ws = x[:, :seq], w[:, :seq]
        sublayers = [(params, config, lambda h, m: jnp.tanh(h @ m), (mix,)) for params in layers]

        def loss_and_gradients(rng=None, xs=xs, ws=ws, sublayers=sublayers):
            values = chain_oracle(xs, sublayers, ws, rng)
            return values["loss"], (values["dx"], values["dparams"])

        want, perturbed = loss_and_gradients(), loss_and_gradients
        compiled = jax.jit(gradient, static_argnums=3).lower(xs, ws, layers, NamedSharding(mesh, spec)).compile()
        compare(f"boundary chain {label}", compiled(xs, ws, layers), want, perturbed, jnp.float32, seed)
        has_boundary = "mhc_boundary_forward" in compiled.as_text()
        assert has_boundary == fused, f"boundary chain {label}: fused kernels present {has_boundary}"
        print(f"ok: boundary chain {label}")


def check_head(seed):
    """DeepSeek-V4's head under jit with x sharded: tokens split (evenly, or padded by XLA) run the
    head kernels on each device's tokens; D split is gathered first (the head has no split form).
    The loss and every gradient against the float64 head (numpy_reference.head_values)."""
    config = make_config("sinkhorn")
    keys = jax.random.split(jax.random.key(seed + 3), 4)
    x = jax.random.normal(keys[0], (4, 6, N_STREAMS, D), jnp.float32)
    w = jax.random.normal(keys[1], (4, 6, D), jnp.float32)
    head = mj.HeadParams(
        jax.random.normal(keys[2], (N_STREAMS, N_STREAMS * D)) / np.sqrt(N_STREAMS * D),
        jax.random.normal(keys[3], (N_STREAMS,)),
        jnp.array([0.8], jnp.float32),
    )

    def loss(x, head, constrain):
        x = jax.lax.with_sharding_constraint(x, constrain) if constrain is not None else x
        # Squares: a signed sum over the tokens can cancel far below its terms.
        return jnp.sum(jnp.square(mj.head(x, head, config) - w[:, : x.shape[1]]))

    gradient = jax.value_and_grad(loss, argnums=(0, 1))
    cases = {
        "tokens": ((8,), ("data",), P("data"), 6),
        "uneven tokens": ((4, 2), ("data", "seq"), P("data", "seq"), 5),
        "tokens+D": ((2, 4), ("data", "tensor"), P("data", None, None, "tensor"), 6),
    }
    for label, (mesh_shape, names, spec, seq) in cases.items():
        mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
        xs = x[:, :seq]

        def loss_and_gradients(rng=None, xs=xs):
            moved = (xs, head) if rng is None else (round_by_one_unit(rng, v) for v in (xs, head))
            values = head_loss_values(*moved, config, w[:, : xs.shape[1]], noise=rng)
            return values["loss"], (values["dx"], values["dhead"])

        want, perturbed = loss_and_gradients(), loss_and_gradients

        compiled = jax.jit(gradient, static_argnums=2).lower(xs, head, NamedSharding(mesh, spec)).compile()
        compare(f"head {label}", compiled(xs, head), want, perturbed, jnp.float32, seed)
        assert "mhc_head_backward" in compiled.as_text(), f"head {label}: no head kernel"
        print(f"ok: head {label}")


def check_sharded_parameters(seed):
    """Parameters held as norm_weight [n, D] and phi [n, D, N] with D on the tensor axis, reshaped
    at the call: nothing is gathered and their gradients come back sharded the same way."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    config, x, params, w, w_in = inputs("sinkhorn", jnp.float32, seed)
    n, width = config.n, config.projection_width
    _, gradient = programs(config, w, w_in)

    def shaped_gradient(x, norm_weight, phi):
        flat = params._replace(norm_weight=norm_weight.reshape(n * D), phi=phi.reshape(n * D, width))
        dx, dparams = gradient(x, flat)
        return dx, dparams.norm_weight.reshape(n, D), dparams.phi.reshape(n, D, width)

    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None, "tensor")))
    norm_weight = jax.device_put(params.norm_weight.reshape(n, D), NamedSharding(mesh, P(None, "tensor")))
    phi = jax.device_put(params.phi.reshape(n, D, width), NamedSharding(mesh, P(None, "tensor", None)))
    compiled = jax.jit(shaped_gradient).lower(xs, norm_weight, phi).compile()
    dx, dnorm_weight, dphi = compiled(xs, norm_weight, phi)
    want, perturbed = oracle("sinkhorn", jnp.float32, seed)

    def gradients(values):  # dx, dnorm_weight, dphi of programs_oracle's values
        dx, dparams = values[1]
        return dx, dparams.norm_weight, dparams.phi

    got = (dx, dnorm_weight.reshape(-1), dphi.reshape(n * D, width))
    compare("sharded parameters", got, gradients(want), lambda rng: gradients(perturbed(rng)), jnp.float32, seed)
    moved = [c for c in collectives(compiled.as_text()) if c[0] != "all-reduce"]
    assert not moved, f"sharded parameters: the gradient moves {moved}"
    assert normalized(dnorm_weight.sharding.spec, 2, mesh) == ((), ("tensor",)), dnorm_weight.sharding
    assert normalized(dphi.sharding.spec, 3, mesh) == ((), ("tensor",), ()), dphi.sharding
    print("ok: parameters sharded on D")


def _fsdp(params, mesh, axis):
    """The parameters with norm_weight's and phi's rows (n*D) sharded over ``axis`` (FSDP)."""
    return params._replace(
        norm_weight=jax.device_put(params.norm_weight, NamedSharding(mesh, P(axis))),
        phi=jax.device_put(params.phi, NamedSharding(mesh, P(axis, None))),
    )


def _dims(element: str) -> list:
    """The dimensions of an HLO element shape such as f32[7,5,4,32]."""
    return [int(size) for size in re.findall(r"\d+", element.split("[", 1)[1])]


def check_fsdp_parameters(seed):
    """FSDP: the parameters' rows sharded over a mesh axis that x does not use. Under jit the
    compiled programs hold the all-reduces of the same program with replicated parameters, and
    beyond them only collectives of the parameters (n*D x (N+1) values, gathered or moved to the
    devices' D slices): no activation moves (the partitioner once carried the parameters'
    sharding onto x, then gathered x-sized arrays twice per sublayer). Results: the bits of the
    replicated-parameter run (the same kernels on the same shards), whose own results the layout
    checks hold to the float64 oracle; pre -> post's values and gradients also against the float64
    oracle (conftest.assert_matches)."""
    # Tokens [14, 5]: every dimension of an activation on a device (7 or 14 rows, 5 positions, or
    # their products) divides by 5 or 7; no dimension of the parameters (n = 4, D = 32 and its
    # slices, N = 24) does. So a collective with such a dimension moves an activation.
    shape = (14, 5, N_STREAMS, D)
    config, x, params, _, _ = inputs("sinkhorn", jnp.float32, seed, shape)
    keys = jax.random.split(jax.random.key(seed + 9), 5)
    layer_out = jax.random.normal(keys[0], shape[:-2] + shape[-1:])
    cotangents = (jax.random.normal(keys[1], layer_out.shape), jax.random.normal(keys[2], shape))
    layers = [random_params(key, config, D) for key in jax.random.split(keys[3], 2)]
    w = jax.random.normal(keys[4], shape)

    def pre_post(x, layer_out, params, cotangents):
        def f(x, layer_out, params):
            layer_in, ctx = mj.pre(x, params, config)
            return layer_in, mj.post(layer_out, ctx)

        outputs, vjp = jax.vjp(f, x, layer_out, params)
        return outputs, vjp(cotangents)

    def chain(x, layers):
        def loss(x, layers):
            state = x
            for params in layers:
                state = mj.sublayer(state, params, config, lambda h: jnp.tanh(h) + 0.5)
            return jnp.sum(jnp.square(mj.finish(state) - w))

        return jax.grad(loss, argnums=(0, 1))(x, layers)

    meshes = {
        # label: (mesh shape, axis names, x's spec); the parameters' rows over "fsdp"
        "tokens": ((2, 4), ("data", "fsdp"), P("data")),
        "tokens+D": ((2, 2, 2), ("data", "tensor", "fsdp"), P("data", None, None, "tensor")),
    }
    for label, (mesh_shape, names, spec) in meshes.items():
        mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        runs = {
            "pre/post": (pre_post, (xs, layer_out, params, cotangents)),
            "sublayer chain": (chain, (xs, layers)),
        }
        for what, (program, args) in runs.items():
            name = f"FSDP {what}, {label} (parameters over fsdp)"
            fsdp_args = tuple(
                _fsdp(a, mesh, "fsdp")
                if isinstance(a, mj.Params)
                else [_fsdp(p, mesh, "fsdp") for p in a]
                if isinstance(a, list)
                else a
                for a in args
            )
            replicated = jax.jit(program).lower(*args).compile()
            compiled = jax.jit(program).lower(*fsdp_args).compile()
            found, before = collectives(compiled.as_text()), collectives(replicated.as_text())
            reduces = sorted(c for c in found if c[0] == "all-reduce")
            assert reduces == sorted(c for c in before if c[0] == "all-reduce"), f"{name}: all-reduces {reduces}"
            others = [c for c in found if c[0] != "all-reduce"]
            moved = [c for c in others if any(size % 5 == 0 or size % 7 == 0 for size in _dims(c[1]))]
            assert not moved, f"{name}: activations move: {moved}"
            assert others, f"{name}: the parameters were never gathered: is the mesh FSDP at all?"
            got, want = compiled(*fsdp_args), replicated(*args)
            for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
                assert np.array_equal(np.asarray(a), np.asarray(b)), f"{name}: {jax.tree_util.keystr(path)} differs"
            if program is pre_post:
                (layer_in, out), (dx, dlayer_out, dparams) = got
                values = dict(zip(numpy_reference.NAMES, (layer_in, out, dx, dlayer_out, *dparams), strict=True))
                context = f"({name}, seed {seed})"
                assert_sublayer_matches_reference(values, x, layer_out, params, config, cotangents, context)
            print(f"ok: {name}")


def check_vmap_sharded(seed):
    """jax.vmap over sharded arrays under jit (2 devices): vmap of pre -> post, the batch axis
    sharded, or the token axis inside it. The batching rule folds the batch into the token axes
    (custom_partitioning has none of its own), so the partitioning rule sees one more token
    dimension; values and every gradient against the float64 oracle (conftest.assert_matches)."""
    config = make_config("sinkhorn")
    keys = jax.random.split(jax.random.key(seed + 10), 5)
    shape = (4, 6, N_STREAMS, D)  # [vmapped, tokens, n, D]
    x = jax.random.normal(keys[0], shape)
    layer_out = jax.random.normal(keys[1], shape[:-2] + shape[-1:])
    params = random_params(keys[2], config, D)
    cotangents = (jax.random.normal(keys[3], layer_out.shape), jax.random.normal(keys[4], shape))

    def sublayer_pair(x, layer_out, params):
        layer_in, ctx = mj.pre(x, params, config)
        return layer_in, mj.post(layer_out, ctx)

    def values_and_vjp(x, layer_out, params, cotangents):
        batched = jax.vmap(sublayer_pair, in_axes=(0, 0, None))
        outputs, vjp = jax.vjp(batched, x, layer_out, params)
        return outputs, vjp(cotangents)

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    for label, spec in {"the batch axis": P("data"), "the token axis": P(None, "data")}.items():
        name = f"vmap of pre/post under jit, {label} sharded over 2 devices"
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        (layer_in, out), (dx, dlayer_out, dparams) = jax.jit(values_and_vjp)(xs, layer_out, params, cotangents)
        assert normalized(out.sharding.spec, 4, mesh) == normalized(spec, 4, mesh), f"{name}: out {out.sharding}"
        got = dict(zip(numpy_reference.NAMES, (layer_in, out, dx, dlayer_out, *dparams), strict=True))
        assert_sublayer_matches_reference(got, x, layer_out, params, config, cotangents, f"({name}, seed {seed})")
        print(f"ok: {name}")


def check_padded_rows_hold_values(seed):
    """Token counts that do not divide, with the rows XLA pads holding values, not zeros: x enters
    each operation as cos(x) (elementwise, so XLA computes it on the padded rows too: cos(0) = 1
    where GSPMD pads with zeros) and the cotangents are not zero there either. So the parameter
    gradients of the pre, boundary and head backwards match the float64 oracle only while each
    masks its padded rows (_zero_padded_rows), under either partitioner."""
    shape = (6, 5, N_STREAMS, D)  # 6 over 4 devices and 5 over 2: both padded
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "seq"))
    constrain = NamedSharding(mesh, P("data", "seq"))
    config, x, params, w, w_in = inputs("sinkhorn", jnp.float32, seed, shape)
    layers = [random_params(key, config, D) for key in jax.random.split(jax.random.key(seed + 4), 2)]
    keys = jax.random.split(jax.random.key(seed + 5), 3)
    head = mj.HeadParams(
        jax.random.normal(keys[0], (N_STREAMS, N_STREAMS * D)) / np.sqrt(N_STREAMS * D),
        jax.random.normal(keys[1], (N_STREAMS,)),
        jnp.array([0.8], jnp.float32),
    )

    def pre_post(x, params):
        layer_in, ctx = mj.pre(x, params, config)
        # exp: a cotangent that is not 0 on the padded rows.
        return jnp.sum(mj.post(jnp.tanh(layer_in), ctx) * w) + jnp.sum(jnp.exp(layer_in / 4))

    def chain(x, layers):
        state = x
        for params in layers:  # two sublayers: one fused boundary
            state = mj.sublayer(state, params, config, lambda h: jnp.tanh(h) + 0.5)
        return jnp.sum(jnp.square(mj.finish(state) - w))

    def head_loss(x, head):
        return jnp.sum(jnp.square(mj.head(x, head, config) - w_in))

    def oracle_gradient(label, rng=None):
        """The float64 gradient (dx, dparameters) of loss(cos(x), parameters); with rng, on inputs
        moved by one f32 unit and noise=rng."""
        move = (lambda v: v) if rng is None else functools.partial(round_by_one_unit, rng)
        x64 = np.asarray(move(x), np.float64)
        if label == "pre":  # programs' loss without its layer_in term
            _, (dx, dparameters) = programs_oracle(config, np.cos(x64), move(params), w, np.zeros(w_in.shape), rng)
        elif label == "boundary":
            sublayers = [(p, config, lambda h: jnp.tanh(h) + 0.5) for p in layers]
            values = chain_oracle(np.cos(x64), sublayers, w, rng)
            dx, dparameters = values["dx"], values["dparams"]
        else:
            values = head_loss_values(np.cos(x64), move(head), config, w_in, rng)
            dx, dparameters = values["dx"], values["dhead"]
        return dx * -np.sin(x64), dparameters

    cases = {"pre": (pre_post, params), "boundary": (chain, layers), "head": (head_loss, head)}
    for label, (loss, parameters) in cases.items():

        def gradient(x, parameters, constrain, loss=loss):
            if constrain is not None:
                x = jax.lax.with_sharding_constraint(x, constrain)
            return jax.grad(lambda x, p: loss(jnp.cos(x), p), argnums=(0, 1))(x, parameters)

        got = jax.jit(gradient, static_argnums=2)(x, parameters, constrain)
        want, perturbed = oracle_gradient(label), functools.partial(oracle_gradient, label)
        compare(f"padded rows with values, {label} backward", got, want, perturbed, jnp.float32, seed)
        print(f"ok: padded rows with values, {label} backward")


def check_d_not_dividing(seed):
    """D over a mesh axis whose size does not divide it: gathered (the kernels split D evenly),
    values and gradients against the float64 oracle."""
    shape = (8, 2, N_STREAMS, 6)  # D = 6 over 4 devices
    config, x, params, w, w_in = inputs("sinkhorn", jnp.float32, seed, shape)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    forward, gradient = programs(config, w, w_in, constrain=NamedSharding(mesh, P("data", None, None, "tensor")))
    got = jax.jit(forward)(x, params), jax.jit(gradient)(x, params)
    compare("D = 6 over 4 devices", got, *oracle("sinkhorn", jnp.float32, seed, shape), jnp.float32, seed)
    print("ok: D = 6 over 4 devices (gathered)")


SHARD_MAP_LAYOUTS = {
    # label: (mesh shape, axis names, x's spec, tensor_axis)
    "tokens": ((8,), ("data",), P("data"), None),
    "D": ((8,), ("tensor",), P(None, None, None, "tensor"), "tensor"),
    "tokens+D": ((2, 4), ("data", "tensor"), P("data", None, None, "tensor"), "tensor"),
}


def _without_streams(spec):
    """The spec of layer_in [batch, seq, D] from x's [batch, seq, n, D]."""
    entries = tuple(spec) + (None,) * (4 - len(spec))
    return P(*entries[:2], entries[3])


def check_shard_map(dtype, seed, layouts=tuple(SHARD_MAP_LAYOUTS), check_vma=True):
    """Inside jax.shard_map (tokens split, D split with tensor_axis, both), parameters replicated
    (in_specs P()): pre -> post, a chain of sublayers (fused boundaries) and the head: the values
    and every gradient (x, layer_out, each parameter) against the float64 oracle."""
    config, x, params, w, w_in = inputs("sinkhorn", dtype, seed)
    layers = [random_params(key, config, D) for key in jax.random.split(jax.random.key(seed + 6), 3)]
    keys = jax.random.split(jax.random.key(seed + 7), 4)
    u = (0.5 * jax.random.normal(keys[0], (3, *w_in.shape))).astype(dtype)  # layer_out = tanh(layer_in) + u
    head = mj.HeadParams(
        jax.random.normal(keys[1], (N_STREAMS, N_STREAMS * D)) / np.sqrt(N_STREAMS * D),
        jax.random.normal(keys[2], (N_STREAMS,)),
        jnp.array([0.8], jnp.float32),
    )

    # The branches' own math in f32 (conftest.bf16_rounding: a bf16 program then rounds only what it
    # passes between operations, and the oracle rounds the same).
    def branch(h, shift):  # elementwise: D may be split
        return (jnp.tanh(h.astype(jnp.float32)) + shift.astype(jnp.float32)).astype(h.dtype)

    def sublayer_pair(tensor_axis, x, params, u):
        layer_in, ctx = mj.pre(x, params, config, tensor_axis=tensor_axis)
        wide = layer_in.astype(jnp.float32)  # read once: its cotangent is summed in f32, rounded once
        layer_out = (jnp.tanh(wide) + u[0].astype(jnp.float32)).astype(layer_in.dtype)
        return mj.post(layer_out, ctx), wide

    def chain(tensor_axis, x, layers, u):
        state = x
        for index, params in enumerate(layers):
            state = mj.sublayer(
                state, params, config, functools.partial(branch, shift=u[index]), tensor_axis=tensor_axis
            )
        return (mj.finish(state),)

    def head_only(tensor_axis, x, head, u):
        return (mj.head(x, head, config, tensor_axis=tensor_axis),)

    def loss(outputs):
        # Squares of differences: no cancelling sum; every output in f32.
        out = outputs[0].astype(jnp.float32)
        total = jnp.sum(jnp.square(out - (w if out.ndim == 4 else w_in)))
        return total + sum(jnp.sum(jnp.exp(o.astype(jnp.float32) / 4)) for o in outputs[1:])

    def oracle(what, rng=None):
        """values_and_gradients in float64: (outputs, (dx, dparameters, du)); with rng, on x, the
        parameters and u moved by one f32 unit and noise=rng."""
        w64 = np.asarray(w, np.float64)

        def output(value):  # the loss reads the outputs in the case's dtype
            return np.asarray(jnp.asarray(value, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)

        if what == "sublayer chain":  # chain_oracle moves the inputs itself
            sublayers = [(p, config, lambda h, shift: jnp.tanh(h) + shift, (u[i],)) for i, p in enumerate(layers)]
            v = chain_oracle(x, sublayers, w64, rng, output, ROUNDING[dtype])
            return (v["out"],), (v["dx"], v["dparams"], np.stack([d[0] for d in v["dbranch"]]))
        move = (lambda v: v) if rng is None else functools.partial(round_by_one_unit, rng)
        x_, u_ = move(x), np.asarray(move(u), np.float64)
        if what == "pre/post":
            v = tanh_sublayer_values(
                x_,
                move(params),
                config,
                u_[0],
                lambda out: 2.0 * (output(out) - w64),
                lambda li: np.exp(output(li) / 4) / 4,
                rng,
                ROUNDING[dtype],
            )
            du = np.stack([v["dshift"], np.zeros(u_.shape[1:]), np.zeros(u_.shape[1:])])
            return (v["out"], v["layer_in"]), (v["dx"], v["dparams"], du)
        v = head_loss_values(x_, move(head), config, w_in, rng, output)
        return (v["out"],), (v["dx"], v["dhead"], np.zeros(u_.shape))

    programs_ = {"pre/post": (sublayer_pair, params), "sublayer chain": (chain, layers), "head": (head_only, head)}
    for what, (program, parameters) in programs_.items():

        def values_and_gradients(run, x, parameters, u):
            outputs = run(x, parameters, u)
            grads = jax.grad(lambda x, p, u: loss(run(x, p, u)), argnums=(0, 1, 2))(x, parameters, u)
            return outputs, grads

        want, perturbed = oracle(what), functools.partial(oracle, what)
        for label in layouts:
            mesh_shape, names, spec, tensor_axis = SHARD_MAP_LAYOUTS[label]
            mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
            layer_in_spec = _without_streams(spec)
            out_specs = (spec, layer_in_spec)[: 2 if program is sublayer_pair else 1]
            if program is head_only:
                out_specs = (layer_in_spec,)
            u_spec = P(None, *layer_in_spec)
            sharded = jax.shard_map(
                functools.partial(program, tensor_axis),
                mesh=mesh,
                in_specs=(spec, P(), u_spec),
                out_specs=out_specs,
                check_vma=check_vma,
            )
            got = jax.jit(functools.partial(values_and_gradients, sharded))(x, parameters, u)
            name = f"shard_map {what}, {label} {jnp.dtype(dtype).name}" + ("" if check_vma else " check_vma=False")
            compare(name, got, want, perturbed, dtype, seed)
            print(f"ok: {name}")


# DeepSeek-V4.1's carried mix as a shard_map input with D split: (mesh shape, axis names, x's
# token entry); D always over "tensor". 2 and 4 devices, and tokens x D on all 8.
CARRIED_MESHES = {
    "D over 2": ((2,), ("tensor",), None),
    "D over 4": ((4,), ("tensor",), None),
    "tokens+D": ((2, 4), ("data", "tensor"), "data"),
}
CARRIED_CONFIG = mj.Config(n=N_STREAMS, pre_from_previous=True, sinkhorn_iters=4)


def _carried_oracle(program, inputs, cotangents, noise=None):
    """The float64 oracle of one carried program (numpy_reference), as a dict by name.
    "pre": pre(carried=) -> post(u); "streams": sublayer(Streams(x, carried), h -> h + u) ->
    streams(), i.e. layer_out = layer_in + u, so dlayer_in = dlayer_out; "collapse"."""
    if program == "collapse":
        x, carried = inputs
        return dict(
            zip(("out", "dx", "dcarried"), numpy_reference.collapse_values(x, carried, cotangents[0]), strict=True)
        )
    x, carried, u, params = inputs
    if program == "pre":
        values = numpy_reference.carried_values(x, u, params, CARRIED_CONFIG, carried, *cotangents, noise)
        values["du"] = values.pop("dlayer_out")
        return values
    dout, dh_pre = cotangents
    zero = np.zeros(np.shape(u))
    first = numpy_reference.carried_values(x, u, params, CARRIED_CONFIG, carried, zero, dh_pre, dout, noise)
    layer_out = first["layer_in"] + np.asarray(u, np.float64)
    dlayer_out = first["dlayer_out"]  # h_post g: independent of layer_out and dlayer_in
    values = numpy_reference.carried_values(
        x, layer_out, params, CARRIED_CONFIG, carried, dlayer_out, dh_pre, dout, noise
    )
    names = ("out", "h_pre", "dx", "dcarried", "dnorm_weight", "dphi", "dalpha", "dbias")
    return {"du": values["dlayer_out"], **{name: values[name] for name in names}}


def check_carried_shard_map(seed):
    """V4.1 inside jax.shard_map with D split over 2, 4 and (with the tokens) 8 devices, the
    carried mix a shard_map input (replicated over the tensor axis): pre(carried=) -> post,
    Streams(x, carried) into a sublayer, collapse(Streams(x, carried)). Values and every gradient
    against the float64 oracle (conftest.assert_matches), f32 and bf16, with shard_map's check_vma
    and (f32) without: dcarried is summed over the devices once (it was P times too large)."""
    config, n = CARRIED_CONFIG, N_STREAMS
    keys = jax.random.split(jax.random.key(seed + 8), 8)
    lead = (4, 3)
    carried = jax.nn.sigmoid(2.0 * jax.random.normal(keys[1], (*lead, n))) + 1e-6
    params = random_params(keys[2], config, D)

    def pre_program(tensor_axis, x, carried, u, params):
        layer_in, ctx = mj.pre(x, params, config, carried=carried, tensor_axis=tensor_axis)
        return layer_in, ctx.h_pre[None], mj.post(u, ctx)

    def streams_program(tensor_axis, x, carried, u, params):
        state = mj.sublayer(mj.Streams(x, carried), params, config, lambda h: h + u, tensor_axis=tensor_axis)
        after = mj.streams(state)
        return after.x, after.carried[None]

    def collapse_program(tensor_axis, x, carried):
        return (mj.collapse(mj.Streams(x, carried), tensor_axis=tensor_axis),)

    cases = [(dtype, True) for dtype in (jnp.float32, jnp.bfloat16)] + [(jnp.float32, False)]
    for dtype, check_vma in cases:
        x = jax.random.normal(keys[0], (*lead, n, D)).astype(dtype)
        u = jax.random.normal(keys[3], (*lead, D)).astype(dtype)
        dli = jax.random.normal(keys[4], (*lead, D)).astype(dtype)
        dh_pre = jax.random.normal(keys[5], (*lead, n))
        dout = jax.random.normal(keys[6], (*lead, n, D)).astype(dtype)
        dcollapse = jax.random.normal(keys[7], (*lead, D)).astype(dtype)
        programs_ = {
            "pre": (pre_program, (x, carried, u, params), (dli, dh_pre, dout)),
            "streams": (streams_program, (x, carried, u, params), (dout, dh_pre)),
            "collapse": (collapse_program, (x, carried), (dcollapse,)),
        }
        for label, (mesh_shape, names, tokens) in CARRIED_MESHES.items():
            devices = math.prod(mesh_shape)
            mesh = Mesh(np.array(jax.devices()[:devices]).reshape(mesh_shape), names)
            slices = mesh.shape["tensor"]
            x_spec, carried_spec, d_spec = P(tokens, None, None, "tensor"), P(tokens), P(tokens, None, "tensor")
            # h_pre is typed as varying over the tensor axis: it comes out as one copy per device.
            stacked_spec = P("tensor", tokens)
            specs = {
                "pre": ((x_spec, carried_spec, d_spec, P()), (d_spec, stacked_spec, x_spec)),
                "streams": ((x_spec, carried_spec, d_spec, P()), (x_spec, stacked_spec)),
                "collapse": ((x_spec, carried_spec), (d_spec,)),
            }
            for what, (program, inputs, cotangents) in programs_.items():
                in_specs, out_specs = specs[what]
                sharded = jax.shard_map(
                    functools.partial(program, "tensor"),
                    mesh=mesh,
                    in_specs=in_specs,
                    out_specs=out_specs,
                    check_vma=check_vma,
                )
                # The cotangent of the stacked h_pre on the first copy only: the loss sees h_pre once.
                given = tuple(
                    jnp.zeros((slices, *c.shape), c.dtype).at[0].set(c) if c is dh_pre else c for c in cotangents
                )
                outputs, grads = jax.jit(functools.partial(_values_and_vjp, sharded))(inputs, given)
                names_ = {
                    "pre": ("layer_in", "h_pre", "out", "dx", "dcarried", "du", "dparams"),
                    "streams": ("out", "h_pre", "dx", "dcarried", "du", "dparams"),
                    "collapse": ("out", "dx", "dcarried"),
                }[what]
                got = dict(zip(names_, (*outputs, *grads), strict=True))
                if "h_pre" in got:
                    copies = got.pop("h_pre")
                    for copy in range(slices):
                        got[f"h_pre copy {copy}"] = copies[copy]
                if "dparams" in got:
                    got.update(zip(("dnorm_weight", "dphi", "dalpha", "dbias"), got.pop("dparams"), strict=True))
                want = _carried_oracle(what, _float64(inputs), _float64(cotangents))
                name = f"shard_map V4.1 {what}, {label} {jnp.dtype(dtype).name}" + (
                    "" if check_vma else " check_vma=False"
                )
                for key, value in got.items():
                    oracle_name = key.split(" copy")[0]

                    def perturbed(rng, oracle_name=oracle_name, inputs=inputs, what=what, cotangents=cotangents):
                        moved = tuple(round_by_one_unit(rng, v) for v in inputs)
                        noise = None if what == "collapse" else rng
                        return _carried_oracle(what, moved, _float64(cotangents), noise)[oracle_name]

                    f32_output = oracle_name in ("h_pre",) or (oracle_name == "dcarried" and what == "collapse")
                    tolerance = TOLERANCE[jnp.float32] if f32_output else TOLERANCE[dtype]
                    assert_matches(f"{name}: {key}", value, want[oracle_name], tolerance, perturbed, f"(seed {seed})")
                print(f"ok: {name}")


def _float64(values):
    return tuple(v if isinstance(v, mj.Params) else np.asarray(jnp.asarray(v, jnp.float32), np.float64) for v in values)


def _values_and_vjp(function, inputs, cotangents):
    outputs, vjp = jax.vjp(function, *inputs)
    return outputs, vjp(tuple(c.astype(o.dtype) for c, o in zip(cotangents, outputs, strict=True)))


def check_shard_map_errors():
    """Inside shard_map with D split: without tensor_axis an mhc error names it; the D slice of
    the parameters, an axis that is not the mesh's, and the plain path with tensor_axis are refused;
    tensor_axis with x's D whole on each device is named as that (without check_vma, which
    cannot tell it from a D slice of the parameters, both are named)."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    config, d = mj.Config(n=2), 8
    x = jnp.ones((4, 2, d))
    params = mj.init_params(jax.random.key(0), config, d)
    head = mj.init_head_params(jax.random.key(1), config, d)
    sliced = mj.init_params(jax.random.key(0), config, d // 4)
    split, whole = P("data", None, "tensor"), P("data")

    def pre(params, **options):
        return lambda x: mj.pre(x, params, config, **options)[0]

    missing = "pass tensor_axis=<the mesh axis that splits D>"
    not_split = "mhc.jax.pre: params.norm_weight: tensor_axis='tensor' says x's D is split over 4 devices"
    bad = [
        # (fragment of the message, call, x's spec, check_vma)
        (missing, pre(params), split, True),
        (missing, lambda x: mj.head(x, head, config), split, True),
        ("not their D slice", pre(sliced, tensor_axis="tensor"), split, True),
        (not_split, pre(params, tensor_axis="tensor"), whole, True),
        (
            "x's last axis is not split over 'tensor'",
            lambda x: mj.head(x, head, config, tensor_axis="tensor"),
            whole,
            True,
        ),
        ("If x's last axis is not split over 'tensor', leave", pre(params, tensor_axis="tensor"), whole, False),
        ("'model' is not a mesh axis of an enclosing jax.shard_map", pre(params, tensor_axis="model"), split, True),
        (
            "the plain path (use_kernel=False) has no split form",
            pre(params, tensor_axis="tensor", use_kernel=False),
            split,
            True,
        ),
    ]
    for fragment, call, spec, check_vma in bad:
        out_spec = P("data", "tensor") if spec == split else P("data")
        sharded = jax.shard_map(call, mesh=mesh, in_specs=spec, out_specs=out_spec, check_vma=check_vma)
        try:
            jax.jit(sharded)(x)
        except ValueError as error:
            assert fragment in str(error), error
            continue
        raise AssertionError(f"expected ValueError with {fragment!r}")
    print("ok: shard_map with D split and no tensor_axis, or a wrong one, raises")


def _apply_layer(graphdef, state, x):
    from flax import nnx

    return nnx.merge(graphdef, state)(lambda h: h, jnp.tanh, x)


def check_flax_layer(seed):
    """The Flax layer under nnx.jit with sharded inputs and replicated parameters: outputs and
    gradients against the float64 chain, nothing with tokens is gathered; and with its parameters
    annotated for D (feature_axis) on x's D axis, nothing moves but the named all-reduces."""
    from flax import nnx

    from mhc.flax import ManifoldConstrainedHyperConnections

    config, d = mj.Config(n=3, sinkhorn_iters=4, pre_eps=0.1, post_scale=1.3), 16
    x = jax.random.normal(jax.random.key(seed), (8, 6, 3, d))
    w = jax.random.normal(jax.random.key(seed + 2), x.shape)
    # Trained-looking parameters (alpha of order 1, random bias), the same in every layer.
    trained = random_params(jax.random.key(seed + 1), config, d)

    def with_trained(layer):
        layer.load_params(trained)
        return layer

    def loss(layer, x):
        return jnp.sum(layer(lambda h: h, jnp.tanh, x) * w)

    # Every layout against the float64 chain (spec: Accuracy), not against one device's f32 run.
    sublayer = [(trained, config, jnp.tanh)]

    def check(label, out, grads):
        got = {"dparams": [[grads[field][...] for field in mj.Params._fields]]}
        got.update({} if out is None else {"out": out})
        assert_chain_matches(got, x, sublayer, w, f"flax layer {label} (seed {seed})")

    layouts = {
        "data": ((8,), ("data",), P("data")),
        "data+seq": ((4, 2), ("data", "seq"), P("data", "seq")),
        "data+tensor": ((2, 4), ("data", "tensor"), P("data", None, None, "tensor")),
    }
    for label, (shape, names, spec) in layouts.items():
        mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
        layer = with_trained(ManifoldConstrainedHyperConnections(config, d, rngs=nnx.Rngs(seed)))
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        call = nnx.jit(lambda layer, x: layer(lambda h: h, jnp.tanh, x))
        got = call(layer, xs), nnx.jit(nnx.grad(loss))(layer, xs)
        check(label, *got)
        assert normalized(got[0].sharding.spec, 4, mesh) == normalized(spec, 4, mesh), f"flax {label}: output sharding"
        graphdef, state = nnx.split(layer)
        apply = functools.partial(_apply_layer, graphdef)
        hlo = jax.jit(apply).lower(state, xs).compile().as_text()
        moved = [c for c in collectives(hlo) if c[0] != "all-reduce"]
        assert not moved, f"flax layer {label}: the forward moves {moved}"
        print(f"ok: flax layer under nnx.jit, x sharded {label}")

    # Parameters annotated for D (logical axis "embed" -> mesh axis "tensor"), x's D on the same
    # axis: nothing but the named all-reduces, and the gradients sharded like the parameters.
    from flax.core import spmd

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    with jax.set_mesh(mesh), spmd.logical_axis_rules((("embed", "tensor"),)):
        layer = ManifoldConstrainedHyperConnections(config, d, feature_axis="embed", rngs=nnx.Rngs(seed))
    with_trained(layer)  # load_params keeps each variable's sharding
    assert normalized(layer.phi[...].sharding.spec, 3, mesh) == ((), ("tensor",), ()), layer.phi[...].sharding
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None, "tensor")))
    grads = nnx.jit(nnx.grad(loss))(layer, xs)
    check("feature_axis", None, grads)
    assert grads["phi"][...].sharding.spec == layer.phi[...].sharding.spec, grads["phi"][...].sharding
    graphdef, state = nnx.split(layer)
    gradient = jax.jit(jax.grad(lambda state, x: loss(nnx.merge(graphdef, state), x)))
    moved = [c for c in collectives(gradient.lower(state, xs).compile().as_text()) if c[0] != "all-reduce"]
    assert not moved, f"flax layer feature_axis: the gradient moves {moved}"
    print("ok: flax layer with parameters annotated for D (logical axis rules)")


LAYOUTS = {
    "tokens": ((8,), ("data",), P("data")),
    "batch+seq": ((4, 2), ("data", "seq"), P("data", "seq")),
    "tokens+D": ((2, 4), ("data", "tensor"), P("data", None, None, "tensor")),
    "D": ((8,), ("tensor",), P(None, None, None, "tensor")),
    "axis of size 1": ((8, 1), ("data", "tensor"), P("data", None, None, "tensor")),
}

# Shardy's (mix, dtype) pairs per layout: every layout sees both mixes (the projection width N, 24
# or 32, is all a mix changes in the partitioning: the partials' [tokens, N + 1] and dphi's rows)
# and both dtypes, and every pair runs on two or three layouts. The rules read neither the mix nor
# the dtype, so the four pairs on every layout (20 checks, 40 compiles) repeated the same
# partitioning; the pairs alternate between layouts.
_PAIRS = (
    (("sinkhorn", jnp.float32), ("permutations", jnp.bfloat16)),
    (("sinkhorn", jnp.bfloat16), ("permutations", jnp.float32)),
)
LAYOUT_CASES = {label: _PAIRS[index % 2] for index, label in enumerate(LAYOUTS)}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    seed, partitioner = int(sys.argv[1]), sys.argv[2]
    jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
    if sys.argv[3:] == ["padded-rows"]:  # test_sharding.py runs these on their own
        check_padded_rows_hold_values(seed)
        sys.exit(0)
    if sys.argv[3:] == ["carried"]:
        check_carried_shard_map(seed)
        sys.exit(0)
    if sys.argv[3:] == ["vmap"]:  # test_vmap_of_sharded_arrays, under both partitioners
        check_vmap_sharded(seed)
        sys.exit(0)
    if sys.argv[3:] == ["fsdp"]:  # also in the full run under Shardy; alone for a quick look
        check_fsdp_parameters(seed)
        sys.exit(0)
    # GSPMD (deprecated in JAX, kept while this jax has it) runs every layout and check once, for
    # Sinkhorn in f32; Shardy, the default, runs both mixes and both dtypes.
    full = partitioner == "shardy"
    if full:  # each layout with both mixes and both dtypes, in two of the four pairs (LAYOUT_CASES)
        for label, (mesh_shape, names, spec) in LAYOUTS.items():
            for mix, dtype in LAYOUT_CASES[label]:
                check(label, mesh_shape, names, spec, mix, dtype, seed)
    else:
        for label, (mesh_shape, names, spec) in LAYOUTS.items():
            check(label, mesh_shape, names, spec, "sinkhorn", jnp.float32, seed)
    for mix in ("sinkhorn", "permutations") if full else ("sinkhorn",):
        check_padded_and_gathered(mix, seed)
    check_no_raw_custom_call(seed)
    check_boundary_chain(seed)
    check_head(seed)
    check_sharded_parameters(seed)
    if full:  # FSDP: Shardy (the default) spread the parameters' sharding onto x; GSPMD did not
        check_fsdp_parameters(seed)
    check_d_not_dividing(seed)
    # Inside shard_map no partitioner runs: Shardy's run checks every layout in f32, tokens+D in
    # bf16 and the errors; GSPMD's, tokens+D with shard_map's check_vma=False (no varying-axis types).
    if full:
        check_shard_map(jnp.float32, seed)
        check_shard_map(jnp.bfloat16, seed, layouts=("tokens+D",))
        check_shard_map_errors()
    else:
        check_shard_map(jnp.float32, seed, layouts=("tokens+D",), check_vma=False)
    check_flax_layer(seed)

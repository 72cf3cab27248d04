"""The TPU path under plain jax.jit with the tokens sharded over two CPU devices, against the
float64 oracle (conftest.assert_matches): ``python tpu_dispatch_cases.py SEED``, run by
test_tpu_dispatch.py in a subprocess (XLA_FLAGS must be set before JAX starts). Prints one "ok:" line per passing case.

Under mhc.tpu.testing.interpret_on_cpu the partitioning rules run the TPU kernels on each
device's tokens: the forward holds no collective, the gradient only the parameter gradients'
all-reduce; the same inside jax.shard_map. ``python tpu_dispatch_cases.py SEED split``: D split
over 2 and 4 devices instead (check_d_split: the split forms' TPU kernels).
"""

import functools
import os
import re
import sys

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "run via test_tpu_dispatch.py"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mhc.jax as mj  # noqa: E402
import mhc.tpu  # noqa: E402
from mhc.tpu.testing import interpret_on_cpu  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from conftest import (  # noqa: E402
    assert_matches,
    random_params,
    relative_error,
    round_by_one_unit,
    tanh_sublayer_values,
)
from sharding_cases import collectives  # noqa: E402

CONFIG = mj.Config(n=4, sinkhorn_iters=5, pre_eps=0.1, post_scale=1.3)
SHAPE = (4, 6, 4, 130)  # [batch, seq, n, D]: 12 tokens per device


def compare(name, got, oracle, seed):
    """Each leaf of got against the same leaf of oracle() (float64) with the one accuracy rule
    (conftest.assert_matches); oracle(rng): on inputs moved by one f32 unit, noise=rng."""
    wanted = jax.tree.leaves(oracle())
    for index, (value, want) in enumerate(zip(jax.tree.leaves(got), wanted, strict=True)):

        def perturbed(rng, index=index):
            return jax.tree.leaves(oracle(rng))[index]

        assert_matches(f"{name}[{index}]", value, want, 1e-5, perturbed, f"(seed {seed})")


def main(seed: int) -> None:
    kx, kp, kw = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, SHAPE)
    params = random_params(kp, CONFIG, SHAPE[-1])
    w = jax.random.normal(kw, SHAPE)

    def forward(x, params):
        layer_in, ctx = mj.pre(x, params, CONFIG)
        return mj.post(jnp.tanh(layer_in), ctx)

    def gradient(x, params):
        return jax.grad(lambda x, params: jnp.sum(forward(x, params) * w), argnums=(0, 1))(x, params)

    def oracle_values(rng=None):
        move = (lambda v: v) if rng is None else functools.partial(round_by_one_unit, rng)
        return tanh_sublayer_values(move(x), move(params), CONFIG, 0.0, w, np.zeros(SHAPE[:-2] + SHAPE[-1:]), rng)

    def want(rng=None):
        return oracle_values(rng)["out"]

    def want_grads(rng=None):
        values = oracle_values(rng)
        return values["dx"], values["dparams"]

    mesh = Mesh(jax.devices()[:2], ("tokens",))
    x_tokens = jax.device_put(x, NamedSharding(mesh, P("tokens")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    with interpret_on_cpu():
        compiled = jax.jit(forward).lower(x_tokens, params).compile()
        # mhc's CPU kernels are custom calls with mhc_ targets; the TPU kernels run in the
        # interpreter here, named mhc_<operation>_tile<tile> but no custom call.
        cpu_kernels = set(re.findall(r'custom_call_target="(mhc_\w+)"', compiled.as_text())) - {"mhc_check_platform"}
        assert not cpu_kernels, f"CPU kernels on the TPU path: {sorted(cpu_kernels)}"
        assert collectives(compiled.as_text()) == [], collectives(compiled.as_text())
        got = compiled(x_tokens, params)
        assert got.sharding.spec == P("tokens"), got.sharding
        compare("forward", got, want, seed)
        print("ok: forward, tokens sharded, no collective")

        if {"mhc_pre_backward", "mhc_post_backward"} <= set(mhc.tpu.KERNELS):
            compiled = jax.jit(gradient).lower(x_tokens, params).compile()
            found = collectives(compiled.as_text())
            # One all-reduce of the parameter gradients (however XLA groups them), nothing x-sized.
            assert found and all(op == "all-reduce" for op, _ in found), found
            activation = re.compile(rf"\[{SHAPE[0] // 2},")
            assert not [shape for _, shape in found if activation.search(shape)], found
            compare("gradient", compiled(x_tokens, params), want_grads, seed)
            print("ok: gradient, tokens sharded, only the parameter all-reduce")
        else:
            try:
                jax.jit(gradient)(x_tokens, params)
            except NotImplementedError as error:
                assert "mhc.jax.pre: mhc has no kernel for platform 'tpu'" in str(error), error
            else:
                raise AssertionError("the gradient ran without a TPU pre backward kernel")
            print("ok: gradient raises the mhc error (no TPU pre backward kernel)")

        if {"mhc_pre_backward", "mhc_post_backward"} <= set(mhc.tpu.KERNELS):
            # The same inside jax.shard_map over the tokens (each device's kernels, check_vma on).
            by_tokens = jax.shard_map(forward, mesh=mesh, in_specs=(P("tokens"), P()), out_specs=P("tokens"))
            compare("shard_map forward", jax.jit(by_tokens)(x_tokens, params), want, seed)

            def shard_map_gradient(x, params):
                return jax.grad(lambda x, params: jnp.sum(by_tokens(x, params) * w), argnums=(0, 1))(x, params)

            compare("shard_map gradient", jax.jit(shard_map_gradient)(x_tokens, params), want_grads, seed)
            print("ok: shard_map over the tokens, forward and gradient")
        else:
            print("ok: shard_map skipped (no TPU pre backward kernel)")


# D split: [batch, seq, n, D] with D = 136, 68 or 34 features a device.
SPLIT_SHAPE = (2, 3, 4, 136)
V41_CONFIG = mj.Config(n=4, pre_from_previous=True, sinkhorn_iters=5, pre_eps=0.1, post_scale=1.3)


def _split_program(config, tensor_axis, x, carried, params):
    """pre -> tanh -> post; V4.1 (config.pre_from_previous) with the carried mix, its own h_pre an
    output too (stacked: one copy per device inside shard_map, where it varies over the axis)."""
    v41 = config.pre_from_previous
    layer_in, ctx = mj.pre(x, params, config, carried=carried if v41 else None, tensor_axis=tensor_axis)
    out = mj.post(jnp.tanh(layer_in), ctx)
    return (out, ctx.h_pre[None]) if v41 else (out,)


def _chain_program(config, tensor_axis, x, carried, layers):
    """Two sublayers of a chain (the fused boundary between them: on a D split, post then the
    pre's split forms), then the pending post."""
    state = mj.Streams(x, carried) if config.pre_from_previous else x
    for params in layers:
        state = mj.sublayer(state, params, config, jnp.tanh, tensor_axis=tensor_axis)
    return (mj.finish(state),)


def _values_and_vjp(run, inputs, cotangents):
    outputs, vjp = jax.vjp(run, *inputs)
    return outputs, vjp(cotangents)


def check_d_split(seed):
    """D split over 2 and 4 devices on the TPU path (the split forms' kernels in the interpreter:
    partials, the psum, finish), under plain jax.jit (x sharded over D; the partitioning rules
    pick the split) and inside jax.shard_map with tensor_axis: V4's and V4.1's pre -> post, the
    values and the VJP (dx, dcarried, every parameter), each within the spec's f32 bound of one
    device's TPU path. Over 2 devices also a chain of two sublayers (_chain_program)."""
    keys = jax.random.split(jax.random.key(seed + 1), 6)
    x = jax.random.normal(keys[0], SPLIT_SHAPE)
    carried = jax.random.uniform(keys[1], SPLIT_SHAPE[:-2] + SPLIT_SHAPE[2:3], minval=0.5, maxval=1.5)
    dout = jax.random.normal(keys[2], SPLIT_SHAPE)
    dh_pre = jax.random.normal(keys[3], (1, *carried.shape))
    d_spec = P(None, None, None, "tensor")
    with interpret_on_cpu():
        for label, config in (("V4", CONFIG), ("V4.1", V41_CONFIG)):
            params = random_params(keys[4], config, SPLIT_SHAPE[-1])
            cotangents = (dout, dh_pre) if config.pre_from_previous else (dout,)
            run = functools.partial(_split_program, config, None)
            want = jax.jit(functools.partial(_values_and_vjp, run))((x, carried, params), cotangents)
            for devices in (2, 4):
                mesh = Mesh(jax.devices()[:devices], ("tensor",))
                x_split = jax.device_put(x, NamedSharding(mesh, d_spec))
                replicated = jax.device_put((carried, params), NamedSharding(mesh, P()))
                inputs = (x_split, *replicated)
                program = jax.jit(functools.partial(_values_and_vjp, run))
                compiled = program.lower(inputs, cotangents).compile()
                cpu_kernels = set(re.findall(r'custom_call_target="(mhc_\w+)"', compiled.as_text()))
                assert not cpu_kernels - {"mhc_check_platform"}, f"CPU kernels on the TPU path: {sorted(cpu_kernels)}"
                found = collectives(compiled.as_text())
                # The partials' all-reduce, [T, N + 1] (the split form ran); nothing moves an
                # activation (only the parameter gradients' rows are gathered).
                tokens, width = SPLIT_SHAPE[0] * SPLIT_SHAPE[1], config.projection_width
                assert ("all-reduce", f"f32[{tokens},{width + 1}]") in found, found
                activation = re.compile(rf"\[{SPLIT_SHAPE[0]},{SPLIT_SHAPE[1]},")
                assert not [shape for _, shape in found if activation.search(shape)], found
                _compare_to_one_device(f"{label} jit, D over {devices}", compiled(inputs, cotangents), want, seed)
                print(f"ok: {label} D split over {devices} devices under jit")

                stacked = (P(None, None, None, "tensor"), P("tensor")) if config.pre_from_previous else (d_spec,)
                sharded = jax.shard_map(
                    functools.partial(_split_program, config, "tensor"),
                    mesh=mesh,
                    in_specs=(d_spec, P(), P()),
                    out_specs=stacked,
                )
                given = (dout, jnp.zeros((devices, *carried.shape)).at[0].set(dh_pre[0]))
                given = given if config.pre_from_previous else (dout,)
                outputs, grads = jax.jit(functools.partial(_values_and_vjp, sharded))(inputs, given)
                if config.pre_from_previous:  # h_pre: every device's copy is the one device's
                    copies = outputs[1]
                    outputs = (outputs[0], copies[0:1])
                    for copy in range(1, devices):
                        np.testing.assert_array_equal(np.asarray(copies[copy]), np.asarray(copies[0]))
                name = f"{label} shard_map tensor_axis, D over {devices}"
                _compare_to_one_device(name, (outputs, grads), want, seed)
                print(f"ok: {name}")
            _check_chain(config, keys[5], x, carried, dout, seed)


def _check_chain(config, key, x, carried, dout, seed):
    layers = [random_params(k, config, SPLIT_SHAPE[-1]) for k in jax.random.split(key, 2)]
    run = functools.partial(_chain_program, config, None)
    want = jax.jit(functools.partial(_values_and_vjp, run))((x, carried, layers), (dout,))
    label = "V4.1" if config.pre_from_previous else "V4"
    mesh = Mesh(jax.devices()[:2], ("tensor",))
    d_spec = P(None, None, None, "tensor")
    inputs = (
        jax.device_put(x, NamedSharding(mesh, d_spec)),
        *jax.device_put((carried, layers), NamedSharding(mesh, P())),
    )
    got = jax.jit(functools.partial(_values_and_vjp, run))(inputs, (dout,))
    _compare_to_one_device(f"{label} chain jit, D over 2", got, want, seed)
    print(f"ok: {label} chain of two sublayers, D split over 2 devices under jit")
    sharded = jax.shard_map(
        functools.partial(_chain_program, config, "tensor"), mesh=mesh, in_specs=(d_spec, P(), P()), out_specs=(d_spec,)
    )
    got = jax.jit(functools.partial(_values_and_vjp, sharded))(inputs, (dout,))
    _compare_to_one_device(f"{label} chain shard_map, D over 2", got, want, seed)
    print(f"ok: {label} chain of two sublayers, shard_map tensor_axis, D over 2")


def _compare_to_one_device(name, got, want, seed):
    """Each leaf within the spec's f32 bound (relative error 1e-5) of one device's."""
    for index, (value, expected) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        assert value.shape == expected.shape, (name, index, value.shape, expected.shape)
        error = relative_error(value, expected)
        assert error <= 1e-5, f"{name}[{index}]: relative error {error:.3g} to one device (seed {seed})"


if __name__ == "__main__":
    if sys.argv[2:] == ["split"]:
        check_d_split(int(sys.argv[1]))
    else:
        main(int(sys.argv[1]))

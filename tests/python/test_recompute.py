"""Recomputing the streams inside groups of sublayers (mhc.jax.stack / recompute_streams,
issue 29): the gradients are the same bits as keeping every stream, the backward re-runs the mhc
kernel forwards and no branch op, under scan and an outer jax.checkpoint, with tokens sharded
under jit, and the streams' memory falls (XLA's memory analysis, CPU memory scheduler)."""

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import mhc.jax as mj
from conftest import assert_chain_matches, assert_matches, random_params, round_by_one_unit, saved_residuals
from mhc.jax import _kernels
from mhc.models import causal_attention, gelu

N, D, HEADS = 4, 32, 2
CONFIG = mj.Config(n=N)
FORWARDS = (_kernels.PRE_FORWARD, _kernels.BOUNDARY_FORWARD, _kernels.POST_FORWARD)


def _problem(seed, depth, dtype, batch=2, seq=8, d=D):
    keys = jax.random.split(jax.random.key(seed), 2 * depth + 1)
    x = jax.random.normal(keys[0], (batch, seq, N, d), jnp.float32).astype(dtype)
    params = [random_params(keys[1 + i], CONFIG, d) for i in range(depth)]
    weights = [jax.random.normal(keys[1 + depth + i], (3, d, d), jnp.float32) / np.sqrt(d) for i in range(depth)]
    return x, params, weights


def _attention(weights):
    """A causal attention-like branch [B, S, D] -> [B, S, D] in layer_in's dtype (its dots are what
    must never be recomputed)."""

    def branch(h):
        wq, wk, wv = (w.astype(h.dtype) for w in weights)
        q, k, v = h @ wq, h @ wk, h @ wv
        scores = jnp.einsum("bsd,btd->bst", q, k) / np.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf).astype(jnp.float32), axis=-1).astype(h.dtype)
        return jnp.einsum("bst,btd->bsd", probs, v)

    return branch


def _pre_post_group(x, params, weights):
    """A group of sublayers, streams -> streams, each sublayer's pre and post on their own."""
    for p, w in zip(params, weights, strict=True):
        layer_in, ctx = mj.pre(x, p, CONFIG)
        x = mj.post(_attention(w)(layer_in), ctx)
    return x


def _fused_group(x, params, weights):
    """A group of sublayers, streams -> streams, chained through the fused boundaries."""
    state = x
    for p, w in zip(params, weights, strict=True):
        state = mj.sublayer(state, p, CONFIG, _attention(w))
    return mj.finish(state)


def _loss(x, params, weights, recompute, fused=True):
    if fused:
        sublayers = [(p, CONFIG, _attention(w)) for p, w in zip(params, weights, strict=True)]
        streams = mj.finish(mj.stack(x, sublayers, recompute=recompute))
    else:  # the groups by recompute_streams
        size = recompute or len(params)
        run = mj.recompute_streams(_pre_post_group) if recompute else _pre_post_group
        streams = x
        for start in range(0, len(params), size):
            streams = run(streams, params[start : start + size], weights[start : start + size])
    return jnp.sum(jnp.sin(streams.astype(jnp.float32)))


def _checkpointed_groups(x, params, weights, k, policy):
    """_loss's chain with each group of k sublayers under jax.checkpoint(policy)."""

    def group(state, params, weights):
        for p, w in zip(params, weights, strict=True):
            state = mj.sublayer(state, p, CONFIG, _attention(w))
        return state

    state = x
    for start in range(0, len(params), k):
        state = jax.checkpoint(group, policy=policy)(state, params[start : start + k], weights[start : start + k])
    return jnp.sum(jnp.sin(mj.finish(state).astype(jnp.float32)))


def _gradients(loss, *args):
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)


def _assert_same_bits(got, want, label):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
        assert np.all(np.isfinite(a)), f"{label}: {jax.tree_util.keystr(path)} not finite"
        assert np.array_equal(a, b), f"{label}: {jax.tree_util.keystr(path)} differs from keeping every stream"


@pytest.fixture(autouse=True)
def _quiet_cpu_scheduler_warning(monkeypatch):
    monkeypatch.setattr(mj, "_cpu_scheduler_warned", True)


@pytest.mark.slow  # over 5 s of CPU at -n 0 (pyproject.toml, markers; docs/testing.md, Fast tier)
@pytest.mark.parametrize("fused", [True, False], ids=["boundary", "pre-post"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gradients_with_recompute_are_the_bits_without(seed, dtype, fused):
    # depth 5: k = 2 and 3 leave a shorter last group, 16 is one group longer than the stack
    x, params, weights = _problem(seed, 5, dtype)
    want = _gradients(lambda *a: _loss(*a, recompute=None, fused=fused), x, params, weights)
    for k in (1, 2, 3, 16):
        got = _gradients(lambda *a, k=k: _loss(*a, recompute=k, fused=fused), x, params, weights)
        _assert_same_bits(got, want, f"k={k} (seed {seed})")


def _count(jaxpr, counts=None) -> dict:
    """dot_general equations and mhc kernel forwards (one platform check each, on the operand that
    decides the call) in a jaxpr and every jaxpr inside it."""
    counts = {"dots": 0, "kernel forwards": 0} if counts is None else counts
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            counts["dots"] += 1
        if eqn.primitive is _kernels._check_platform_p and eqn.params["operation"] in FORWARDS:
            counts["kernel forwards"] += 1
        for inner in jcore.jaxprs_in_params(eqn.params):
            _count(inner, counts)
    return counts


def test_the_backward_reruns_the_kernels_and_never_a_branch(seed):
    depth = 8
    x, params, weights = _problem(seed, depth, jnp.float32)
    counts = {
        k: _count(
            jax.make_jaxpr(jax.grad(lambda *a, k=k: _loss(*a, recompute=k), argnums=(0, 1, 2)))(
                x, params, weights
            ).jaxpr
        )
        for k in (None, 1, 3, depth)
    }
    kept = counts[None]
    assert kept["kernel forwards"] == depth + 1, kept  # pre, a boundary per sublayer after it, the final post
    for k in (1, 3, depth):
        # every sublayer's pre/boundary once more in the backward (the final post is outside the groups)
        assert counts[k]["kernel forwards"] == kept["kernel forwards"] + depth, (k, counts[k], kept)
        # the branches' dots: their forward and their backward, never a second forward
        assert counts[k]["dots"] == kept["dots"], (k, counts[k], kept)


@pytest.mark.parametrize("group", [_fused_group, _pre_post_group], ids=["boundary", "pre-post"])
def test_the_policy_keeps_no_stream_but_the_groups_input(seed, group):
    """What recompute_policy keeps for the backward of a group of sublayers, as
    print_saved_residuals lists it: of the streams [..., n, D] only the group's input (an
    argument, which any jax.checkpoint keeps), not the streams between its sublayers (the kernels'
    outputs, the residuals named mhc_x), which the backward rebuilds; every layer_out stays kept,
    so that no branch is re-run. The memory test sees a policy that keeps x only on a quiet CPU."""
    depth = 3
    x, params, weights = _problem(seed, depth, jnp.float32)
    lines = saved_residuals(mj.recompute_streams(group), x, params, weights)
    stream_shape = "f32[" + ",".join(str(size) for size in x.shape) + "]"
    streams = [line for line in lines if line.startswith(stream_shape)]
    assert streams == [f"{stream_shape} from the argument x"], lines
    assert not any(f"named '{_kernels.RESIDUAL_X}'" in line for line in lines), lines
    assert sum(f"named '{_kernels.RESIDUAL_LAYER_OUT}'" in line for line in lines) == depth, lines


@pytest.mark.slow  # 12 s of CPU (pyproject.toml, markers)
def test_scan_over_groups_and_an_outer_checkpoint_keep_the_bits(seed):
    depth, k = 6, 2
    x, params, weights = _problem(seed, depth, jnp.float32)

    def scanned(x, params, weights, recompute):
        # the first sublayer outside (its state is the streams, a Pending after it), then a scan
        # over groups of k with the parameters stacked per group, then the last sublayer
        state = mj.sublayer(x, params[0], CONFIG, _attention(weights[0]))
        group_params = jax.tree.map(lambda *a: jnp.stack(a).reshape(-1, k, *a[0].shape), *params[1:-1])
        group_weights = jnp.stack(weights[1:-1]).reshape(-1, k, *weights[0].shape)

        def body(state, group):
            for i in range(k):
                p, w = jax.tree.map(lambda a, i=i: a[i], group)
                state = mj.sublayer(state, p, CONFIG, _attention(w))
            return state, None

        body = mj.recompute_streams(body) if recompute else body
        state, _ = jax.lax.scan(body, state, (group_params, group_weights))
        state = mj.sublayer(state, params[-1], CONFIG, _attention(weights[-1]))
        return jnp.sum(jnp.sin(mj.finish(state)))

    # a scan compiles its body apart from the unrolled chain's code, so the reference is the same scan
    want = _gradients(lambda *a: scanned(*a, recompute=False), x, params, weights)
    _assert_same_bits(_gradients(lambda *a: scanned(*a, recompute=True), x, params, weights), want, "scan")
    want = _gradients(lambda *a: _loss(*a, recompute=None), x, params, weights)
    outer = jax.checkpoint(lambda *a: _loss(*a, recompute=k))
    _assert_same_bits(_gradients(outer, x, params, weights), want, f"outer checkpoint (seed {seed})")


def test_suggested_recompute_is_the_papers_formula():
    # sqrt(n L / (n + 2)): n = 4, L = 16 -> 3.27; L = 60 -> 6.3; L = 2 -> 1.15; n = 1 -> within [1, L]
    assert mj.suggested_recompute(4, 16) == 3
    assert mj.suggested_recompute(4, 60) == 6
    assert mj.suggested_recompute(4, 2) == 1
    assert mj.suggested_recompute(1, 1) == 1
    assert mj.suggested_recompute(8, 200) == 13  # sqrt(160) = 12.6
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="sublayers: expected a positive int"):
            mj.suggested_recompute(4, bad)
    with pytest.raises(ValueError, match="n: expected a positive int"):
        mj.suggested_recompute(0, 16)


def test_bad_recompute_is_refused_naming_it(seed):
    x, params, weights = _problem(seed, 2, jnp.float32)
    sublayers = [(p, CONFIG, _attention(w)) for p, w in zip(params, weights, strict=True)]
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(ValueError, match="recompute: expected None or a group size"):
            mj.stack(x, sublayers, recompute=bad)
    with pytest.raises(ValueError, match="recompute: the plain path"):
        mj.stack(x, sublayers, recompute=2, use_kernel=False)
    with pytest.raises(TypeError, match="fn: expected a callable"):
        mj.recompute_streams(3)
    assert mj.stack(x, [], recompute=2) is x  # no sublayer: the streams as they were


def test_the_cpu_scheduler_warning_is_given_once_without_the_flag(monkeypatch):
    monkeypatch.setattr(mj, "_cpu_scheduler_warned", False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    double = mj.recompute_streams(lambda x: 2 * x)
    with pytest.warns(UserWarning, match="xla_cpu_enable_concurrency_optimized_scheduler=false"):
        double(jnp.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        double(jnp.ones(3))  # once per process
    monkeypatch.setattr(mj, "_cpu_scheduler_warned", False)
    monkeypatch.setenv("XLA_FLAGS", mj.CPU_MEMORY_SCHEDULER_FLAG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        double(jnp.ones(3))  # the flag set: nothing to warn about


@pytest.mark.slow  # a fresh JAX process: 25 s of CPU (pyproject.toml, markers)
def test_sharded_tokens_and_memory_in_a_subprocess():
    """Two forced CPU devices and XLA's memory scheduler need XLA_FLAGS before JAX starts."""
    flags = f"--xla_force_host_platform_device_count=2 {mj.CPU_MEMORY_SCHEDULER_FLAG}"
    env = dict(os.environ, XLA_FLAGS=flags)
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "recompute subprocess: ok" in result.stdout, result.stdout


def _subprocess_cases(seed=0):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jax.device_count() == 2, jax.devices()
    # tokens (the batch) sharded over two devices under plain jit. Recomputing changes no bits
    # against the same groups under a jax.checkpoint that saves everything; against no checkpoint
    # at all the rounding differs (any jax.checkpoint does that here, XLA's SPMD partitioning of
    # the barriers): two f32 evaluations, each within the accuracy rule's f32 bound
    mesh = jax.make_mesh((2,), ("data",))
    x, params, weights = _problem(seed, 4, jnp.float32, batch=4)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = _gradients(lambda *a: _loss(*a, recompute=2), x, params, weights)
    saving_everything = jax.checkpoint_policies.everything_saveable
    want = _gradients(lambda *a: _checkpointed_groups(*a, 2, saving_everything), x, params, weights)
    _assert_same_bits(got, want, "tokens sharded")
    assert got[0].sharding.spec[0] == "data", got[0].sharding  # dx stays sharded like x
    unchecked = _gradients(lambda *a: _loss(*a, recompute=None), x, params, weights)
    # Each against the float64 chain with the one accuracy rule (loss sum(sin(out)): dout = cos(out)).
    sublayers = [(p, CONFIG, lambda h, w: _attention(w)(h), (w,)) for p, w in zip(params, weights, strict=True)]
    for label, (dx, dparams, dweights) in (("recompute=2", got), ("no recompute", unchecked)):
        got_values = {"dx": dx, "dparams": dparams, "dbranch": [[w] for w in dweights]}
        assert_chain_matches(got_values, x, sublayers, np.cos, f"({label}, tokens sharded, seed {seed})")

    # memory: XLA's temporaries of the gradient fall when the streams are recomputed (one device,
    # 16 sublayers, 512 tokens, D = 128, a one-dot branch, so that the streams dominate)
    x, params, weights = _problem(seed, 16, jnp.float32, batch=2, seq=256, d=128)

    def one_dot(x, params, weights, k):
        sublayers = [(p, CONFIG, lambda h, w=w: jnp.tanh(h @ w[0])) for p, w in zip(params, weights, strict=True)]
        return jnp.sum(jnp.sin(mj.finish(mj.stack(x, sublayers, recompute=k))))

    def temp(loss, k):
        grad = jax.jit(jax.grad(lambda *a: loss(*a, k), argnums=(0, 1, 2)))
        return grad.lower(x, params, weights).compile().memory_analysis().temp_size_in_bytes

    kept, grouped = temp(one_dot, None), temp(one_dot, mj.suggested_recompute(N, 16))
    print(f"temp MiB: every stream kept {kept / 2**20:.1f}, recomputed in groups of 3 {grouped / 2**20:.1f}")
    assert grouped < 0.75 * kept, (kept, grouped)

    # f32 attention and MLP branches as in mhc.models: its attention's one [B, H, S, S] residual
    # lets recompute save memory (jax.nn.dot_product_attention's three crossed the checkpoint's
    # barrier: 60.5 MiB with recompute against 53.5 without, here 43.7 against 53.4)
    heads = 4

    def attention_then_mlp(index, w):
        def attention(h):
            q, k, v = (jnp.einsum("bsd,de->bse", h, w[i]).reshape(*h.shape[:2], heads, -1) for i in range(3))
            return causal_attention(q, k, v).reshape(h.shape) @ w[3]

        return attention if index % 2 == 0 else (lambda h: gelu(h @ w[0]) @ w[1])

    weights = [jnp.concatenate([w, w[:1]]) for w in weights]  # 4 matrices a sublayer

    def attention_and_mlp(x, params, weights, k):
        sublayers = [
            (p, CONFIG, attention_then_mlp(i, w)) for i, (p, w) in enumerate(zip(params, weights, strict=True))
        ]
        return jnp.sum(jnp.sin(mj.finish(mj.stack(x, sublayers, recompute=k))))

    kept, grouped = temp(attention_and_mlp, None), temp(attention_and_mlp, mj.suggested_recompute(N, 16))
    print(f"attention and MLP, temp MiB: every stream kept {kept / 2**20:.1f}, groups of 3 {grouped / 2**20:.1f}")
    assert grouped < 0.9 * kept, (kept, grouped)
    print("recompute subprocess: ok")


@pytest.mark.slow  # over 5 s of CPU at -n 0 (pyproject.toml, markers; docs/testing.md, Fast tier)
def test_the_models_attention_is_jaxs_and_keeps_one_score_array(seed):
    """mhc.models' causal_attention: jax.nn.dot_product_attention's values and gradients, its
    backward keeping the probabilities as its one [B, H, S, S] residual (what lets recompute
    groups save memory around it)."""
    batch, seq, heads, head_dim = 2, 16, 2, 8
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, weight = (jax.random.normal(key, (batch, seq, heads, head_dim), jnp.float32) for key in keys)

    def loss(attention):
        return lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v)) * weight)

    def jaxs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def float64(q, k, v, weight):
        """jax's attention in float64 (x64 mode): the values and the gradients wrt q, k, v."""
        with jax.enable_x64(True):
            q, k, v, weight = (jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v, weight))
            out = jaxs(q, k, v)
            grads = jax.grad(lambda *a: jnp.sum(jnp.sin(jaxs(*a)) * weight), argnums=(0, 1, 2))(q, k, v)
            return [np.asarray(a) for a in (out, *grads)]

    # Each attention against the float64 one with the one accuracy rule, never with each other.
    want = float64(q, k, v, weight)
    for attention in (causal_attention, jaxs):
        got = [attention(q, k, v), *jax.grad(loss(attention), argnums=(0, 1, 2))(q, k, v)]
        for index, name in enumerate(("out", "dq", "dk", "dv")):
            assert_matches(
                name,
                got[index],
                want[index],
                1e-5,
                lambda rng, i=index: float64(*(round_by_one_unit(rng, a) for a in (q, k, v, weight)))[i],
                f"({attention.__name__}, seed {seed})",
            )
    _, backward = jax.vjp(causal_attention, q, k, v)  # its leaves: the residuals it keeps
    scores = [r.shape for r in jax.tree.leaves(backward) if r.shape[-2:] == (seq, seq)]
    assert len(scores) == 1, scores


if __name__ == "__main__":
    mj._cpu_scheduler_warned = True
    _subprocess_cases()


def test_the_models_gelu_is_jaxs_and_keeps_only_its_input(seed):
    """mhc.models' gelu: jax.nn.gelu's values and gradients, bit for bit, its backward keeping
    only u (what lets recompute groups save memory around the MLP)."""
    u, weight = jax.random.normal(jax.random.key(seed), (2, 16, 64), jnp.float32)
    got = jax.jit(jax.value_and_grad(lambda u: jnp.sum(jnp.sin(gelu(u)) * weight)))(u)
    want = jax.jit(jax.value_and_grad(lambda u: jnp.sum(jnp.sin(jax.nn.gelu(u)) * weight)))(u)
    _assert_same_bits(got, want, f"gelu (seed {seed})")
    _, backward = jax.vjp(gelu, u)
    assert [r.shape for r in jax.tree.leaves(backward)] == [u.shape]

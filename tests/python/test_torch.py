"""mhc.torch: each path against the float64 oracle, the kernel path bitwise against mhc.jax's,
the custom ops through torch.library.opcheck and torch.compile(fullgraph=True), checkpoint,
determinism and bad input."""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mhc.torch needs torch (pip install mhc[torch])")

import jax.numpy as jnp  # noqa: E402

import mhc.jax as mj  # noqa: E402
import mhc.torch as mt  # noqa: E402
import numpy_reference  # noqa: E402
from conftest import (  # noqa: E402
    assert_matches,
    assert_sublayer_matches_reference,
    random_numpy_params,
    round_by_one_unit,
    sublayer_values,
)
from mhc._config import PreApply  # noqa: E402
from mhc.torch import _ops  # noqa: E402

DTYPES = {"float32": (torch.float32, jnp.float32), "bfloat16": (torch.bfloat16, jnp.bfloat16)}


def to_torch(value, dtype=torch.float32, grad=False):
    tensor = torch.from_numpy(np.array(value, np.float32)).to(dtype)
    return tensor.requires_grad_(grad)


def to_jax(tensor):
    """A torch tensor as a jax array of the same dtype (bf16 through f32: exact)."""
    dtype = DTYPES[str(tensor.dtype).removeprefix("torch.")][1]
    return jnp.asarray(tensor.detach().float().numpy()).astype(dtype)


def problem(seed, config, lead=(2, 3), d=16, dtype="float32"):
    rng = np.random.default_rng(seed)
    jdtype = DTYPES[dtype][1]
    shape = (*lead, config.n, d)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(jdtype)
    layer_out = jnp.asarray(rng.standard_normal((*lead, d)), jnp.float32).astype(jdtype)
    params = mj.Params(*(jnp.asarray(p) for p in random_numpy_params(rng, config, d)))
    cotangents = (
        jnp.asarray(rng.standard_normal((*lead, d)), jnp.float32).astype(jdtype),
        jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(jdtype),
    )
    return rng, x, layer_out, params, cotangents


def torch_sublayer_values(x, layer_out, params, config, cotangents, use_kernel=True) -> dict:
    """pre -> post in mhc.torch and its VJP at (dlayer_in, dout), by numpy_reference.NAMES."""
    dtype = DTYPES[str(x.dtype)][0]
    tx, tlo = to_torch(x, dtype, True), to_torch(layer_out, dtype, True)
    tparams = mt.Params(*(to_torch(p, grad=True) for p in params))
    layer_in, ctx = mt.pre(tx, tparams, config, use_kernel=use_kernel)
    out = mt.post(tlo, ctx)
    torch.autograd.backward([layer_in, out], [to_torch(c, dtype) for c in cotangents])
    values = (layer_in, out, tx.grad, tlo.grad, *(p.grad for p in tparams))
    return {name: to_jax(v) for name, v in zip(numpy_reference.NAMES, values, strict=True)}


# A fresh interpreter where jax cannot be imported, as where it was never installed (mhc[torch]):
# mhc.torch imports and runs a sublayer forward and backward on the kernels; mhc.jax then fails.
WITHOUT_JAX = """
import importlib.abc
import sys

class NoJax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib"):
            raise ImportError(f"{name} blocked by the test")
        return None

sys.meta_path.insert(0, NoJax())
import torch
import mhc.torch as mt

config = mt.Config(n=4)
x = torch.randn(3, 4, 8, requires_grad=True)
layer_in, ctx = mt.pre(x, mt.init_params(config, 8), config)
mt.post(torch.tanh(layer_in), ctx).sum().backward()
assert torch.isfinite(x.grad).all()
try:
    import mhc.jax
except ImportError as error:
    print("mhc.jax:", error)
"""


def test_mhc_torch_runs_without_jax():
    result = subprocess.run([sys.executable, "-c", WITHOUT_JAX], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "mhc.jax: jax blocked by the test" in result.stdout, result.stdout  # the finder is live


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "plain"])
@pytest.mark.parametrize("mix", ["sinkhorn", "permutations"])
def test_sublayer_matches_float64(seed, dtype, use_kernel, mix):
    """Outputs and gradients of x, layer_out and every parameter within the spec's bound of the
    float64 oracle ."""
    config = mj.Config(n=3, mix=mix)
    _, x, layer_out, params, cotangents = problem(seed, config, dtype=dtype)
    got = torch_sublayer_values(x, layer_out, params, config, cotangents, use_kernel)
    assert_sublayer_matches_reference(got, x, layer_out, params, config, cotangents, f"seed={seed}")


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "plain"])
@pytest.mark.parametrize("one_hot", [False, True], ids=["carried", "one_hot"])
def test_carried_sublayer_matches_float64(seed, use_kernel, one_hot):
    """V4.1: layer_in from the carried mix, the sublayer's own h_pre handed on, and the VJP at
    (dlayer_in, dh_pre, dout) including dcarried, against numpy_reference.carried_values."""
    config = mj.Config(n=4, pre_from_previous=True)
    rng, x, layer_out, params, (dlayer_in, dout) = problem(seed, config)
    carried = None if one_hot else rng.uniform(0.1, 1.0, (*x.shape[:-2], 4)).astype(np.float32)
    dh_pre = rng.standard_normal((*x.shape[:-2], 4)).astype(np.float32)
    tx, tlo = to_torch(x, grad=True), to_torch(layer_out, grad=True)
    tcarried = None if carried is None else to_torch(carried, grad=True)
    tparams = mt.Params(*(to_torch(p, grad=True) for p in params))
    layer_in, ctx = mt.pre(tx, tparams, config, carried=tcarried, use_kernel=use_kernel)
    out = mt.post(tlo, ctx)
    torch.autograd.backward([layer_in, ctx.h_pre, out], [to_torch(dlayer_in), to_torch(dh_pre), to_torch(dout)])
    got = dict(layer_in=layer_in, h_pre=ctx.h_pre, out=out, dx=tx.grad, dlayer_out=tlo.grad)
    got.update(zip(("dnorm_weight", "dphi", "dalpha", "dbias"), (p.grad for p in tparams), strict=True))
    if carried is not None:
        got["dcarried"] = tcarried.grad
    args = (x, layer_out, params, config, carried, dlayer_in, dh_pre, dout)
    want = numpy_reference.carried_values(*args)
    for name, value in got.items():

        def perturbed(rng, name=name):
            x_, lo_, p_ = (round_by_one_unit(rng, v) for v in (x, layer_out, params))
            c_ = None if carried is None else round_by_one_unit(rng, carried)
            return numpy_reference.carried_values(x_, lo_, p_, config, c_, dlayer_in, dh_pre, dout, noise=rng)[name]

        assert_matches(name, value.detach().numpy(), want[name], 1e-5, perturbed, f"seed={seed}")


def _chain(x, sublayers, use_kernel=True, carried=False):
    state = x
    for params, config, branch in sublayers:
        state = mt.sublayer(state, params, config, branch, use_kernel=use_kernel)
    return mt.collapse(state) if carried else mt.finish(state)


def _torch_chain_problem(seed, carried, count=3, n=4, d=16):
    rng = np.random.default_rng(seed)
    config = mt.Config(n=n, pre_from_previous=carried)
    params = [mt.Params(*(to_torch(p, grad=True) for p in random_numpy_params(rng, config, d))) for _ in range(count)]
    x = to_torch(rng.standard_normal((2, 5, n, d)), grad=True)
    weights = [to_torch(rng.standard_normal((d, d)) / d**0.5) for _ in range(count)]
    branches = [lambda h, w=w: torch.tanh(h @ w.to(h.dtype)) for w in weights]
    sublayers = [(p, config, branch) for p, branch in zip(params, branches, strict=True)]
    return x, sublayers


def _grads(x, sublayers, run):
    for leaf in [x, *(t for p, _, _ in sublayers for t in p)]:
        leaf.grad = None
    out = run()
    (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return [out.detach(), x.grad.clone(), *(t.grad.clone() for p, _, _ in sublayers for t in p)]


def _float64_chain_grads(x, sublayers, carried, rng=None):
    """The chain and its gradients in float64: mhc.torch.reference's formulas on float64 tensors
    (inputs moved by one f32 unit when rng is given: assert_matches' spread), differentiated by
    torch. The oracle of the kernel path's chain, which runs the fused boundary ops."""

    def wide(t):
        value = t.detach().double()
        if rng is not None:
            value = value * (1 + torch.from_numpy(rng.uniform(-(2.0**-24), 2.0**-24, tuple(value.shape))))
        return value.requires_grad_()

    x64 = wide(x)
    params64 = [mt.Params(*(wide(t) for t in p)) for p, _, _ in sublayers]
    state, mix = x64, None
    for p, (_, config, branch) in zip(params64, sublayers, strict=True):
        h_pre, h_post, h_res = mt.reference.coefficients(state, p, config)
        layer_out = branch(mt.reference.pre_apply(PreApply.of(config, mix), state, h_pre, mix))
        state, mix = mt.reference.post(state, layer_out, h_post, h_res), h_pre
    out = mt.reference.collapse(state, mix) if carried else state
    (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)).sum().backward()
    return [out.detach(), x64.grad, *(t.grad for p in params64 for t in p)]


@pytest.mark.parametrize("carried", [False, True], ids=["v4", "v41"])
def test_fused_chain_matches_float64(seed, carried):
    """A chain of three sublayers (pre, two fused boundaries, post; V4.1: then collapse), its
    output and the gradients of x and every parameter against the float64 chain."""
    x, sublayers = _torch_chain_problem(seed, carried)
    got = _grads(x, sublayers, lambda: _chain(x, sublayers, carried=carried))
    want = _float64_chain_grads(x, sublayers, carried)
    for index, (value, reference_value) in enumerate(zip(got, want, strict=True)):

        def perturbed(rng, index=index):
            return _float64_chain_grads(x, sublayers, carried, rng)[index].numpy()

        assert_matches(f"tensor {index}", value.numpy(), reference_value.numpy(), 1e-5, perturbed, f"seed={seed}")


@pytest.mark.parametrize("carried", [False, True], ids=["v4", "v41"])
def test_checkpointed_stack_gives_the_same_gradients(seed, carried):
    """stack(recompute=2) re-runs each group's forward (the same ops on the same inputs) in the
    backward: every output and gradient the same bits as without."""
    x, sublayers = _torch_chain_problem(seed, carried)

    def run(recompute):
        state = mt.stack(x, sublayers, recompute=recompute)
        return mt.collapse(state) if carried else mt.finish(state)

    want = _grads(x, sublayers, lambda: run(None))
    got = _grads(x, sublayers, lambda: run(2))
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"tensor {index} differs with recompute=2 (seed={seed})"


@pytest.mark.parametrize("carried", [False, True], ids=["v4", "v41"])
def test_compiled_chain_has_no_graph_break_and_no_recompile(seed, carried):
    """torch.compile(fullgraph=True) traces the chain through the ops' fake implementations (a
    graph break raises), and new values of the same shapes run the same graph (a recompile raises),
    forward and backward; the results are those of eager mode."""
    import torch._dynamo

    x, sublayers = _torch_chain_problem(seed, carried)
    params = [p for p, _, _ in sublayers]
    config = sublayers[0][1]
    weights = [to_torch(np.eye(16, dtype=np.float32) * (1 + i)) for i in range(len(params))]

    def model(x, params, weights):
        state = x
        for p, w in zip(params, weights, strict=True):
            state = mt.sublayer(state, p, config, lambda h, w=w: torch.tanh(h @ w))
        out = mt.collapse(state) if carried else mt.finish(state)
        return out.square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(3):
            xs = (x.detach() * (1 + 0.1 * step)).requires_grad_()
            loss = compiled(xs, params, weights)
            (dx,) = torch.autograd.grad(loss, [xs])
            xe = xs.detach().requires_grad_()
            want_loss = model(xe, params, weights)
            (want_dx,) = torch.autograd.grad(want_loss, [xe])
            assert torch.equal(loss, want_loss) and torch.equal(dx, want_dx), f"step {step} (seed={seed})"


def _sample(name: str, dtype, t=3, n=4, d=8, width=None, carried_width=None):
    """A sample operand of the ops' table by its name, f32 unless an activation."""
    width = width or 2 * n + n * n
    shapes = {
        "x": (t, n, d),
        "g": (t, n, d),
        "dx_partial": (t, n, d),
        "next_dx_partial": (t, n, d),
        "layer_out": (t, d),
        "dlayer_in": (t, d),
        "next_dlayer_in": (t, d),
        "dout": (t, d),
        "norm_weight": (n * d,),
        "phi": (n * d, width),
        "alpha": (3,),
        "bias": (width,),
        "fn": (n, n * d),
        "base": (n,),
        "scale": (1,),
        "h_res": (t, n, n),
        "dh_res": (t, n, n),
        "next_dh_res": (t, n, n),
        "carried": (t, n if carried_width is None else carried_width),
        "partials": (t, width + 1),
    }
    shape = shapes.get(name, (t, n))  # h_pre, h_post and their cotangents
    activation = name in ("x", "g", "dx_partial", "next_dx_partial", "layer_out", "dlayer_in", "next_dlayer_in", "dout")
    value = torch.randn(shape, dtype=torch.float32)
    if name in ("h_res", "carried", "h_pre", "h_post", "partials"):  # partials end with a sum of squares
        value = value.abs() / n
    return value.to(dtype) if activation else value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(_ops.OPERATIONS))
def test_opcheck_every_op(name, dtype):
    """torch.library.opcheck: schema, autograd registration, fake tensor and AOT dispatch of each op."""
    inputs = [_sample(arg, dtype) for arg in _ops.OPERATIONS[name]["inputs"]]
    torch.library.opcheck(_ops.OPS[name], (*inputs, *_ops.scalars(mt.Config(4))))


def test_one_hot_carried_is_an_empty_mix():
    """V4.1's first sublayer: carried of shape [T, 0] is the one-hot; dcarried keeps that shape."""
    inputs = [_sample(arg, torch.float32, carried_width=0) for arg in _ops.OPERATIONS["pre_backward_carried"]["inputs"]]
    torch.library.opcheck(_ops.OPS["pre_backward_carried"], (*inputs, *_ops.scalars(mt.Config(4))))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sublayer_bits_equal_mhc_jax(seed, dtype):
    """The same kernels behind both bindings: every output and gradient the same bits."""
    config = mj.Config(n=4)
    _, x, layer_out, params, cotangents = problem(seed, config, dtype=dtype)
    got = torch_sublayer_values(x, layer_out, params, config, cotangents)
    want = sublayer_values(x, layer_out, params, config, cotangents)
    for name in numpy_reference.NAMES:
        assert np.array_equal(np.asarray(got[name], np.float32), np.asarray(want[name], np.float32)), name


def test_results_do_not_depend_on_the_thread_count(seed):
    """Same bits run to run and with 1 or 2 threads (mhc's fixed reduction order)."""
    import mhc

    x, sublayers = _torch_chain_problem(seed, carried=False)
    before = mhc.num_threads()
    try:
        results = []
        for threads in (1, 2, 2):
            mhc.set_num_threads(threads)
            results.append(_grads(x, sublayers, lambda: _chain(x, sublayers)))
    finally:
        mhc.set_num_threads(before)
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0], strict=True))


# Bad input: each raises naming the function and the argument.


def _valid(dtype=torch.float32):
    config = mt.Config(n=4)
    return torch.randn(2, 4, 8, dtype=dtype), mt.init_params(config, 8), config


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        (lambda x, p, c: (x.double(), p, c), TypeError, r"mhc.torch.pre: x: expected dtype float32 or bfloat16"),
        (lambda x, p, c: (x[:, :3], p, c), ValueError, r"mhc.torch.pre: x: expected a contiguous tensor"),
        (lambda x, p, c: (x[:, :3].contiguous(), p, c), ValueError, r"mhc.torch.pre: x: expected 4 streams"),
        (lambda x, p, c: (x[..., ::2], p, c), ValueError, r"mhc.torch.pre: x: expected a contiguous"),
        (lambda x, p, c: (x.numpy(), p, c), TypeError, r"mhc.torch.pre: x: expected a torch.Tensor"),
        (lambda x, p, c: (x, p._replace(phi=p.phi[:, :5]), c), ValueError, r"mhc.torch.pre: params.phi: expected"),
        (lambda x, p, c: (x, p._replace(alpha=p.alpha.half()), c), TypeError, r"params.alpha: expected dtype float32"),
        (lambda x, p, c: (x, tuple(p), c), TypeError, r"mhc.torch.pre: params: expected mhc.torch.Params"),
        (lambda x, p, c: (x, p, 4), TypeError, r"mhc.torch.pre: config: expected mhc.torch.Config"),
    ],
)
def test_bad_input_to_pre_names_the_argument(change, error, pattern):
    with pytest.raises(error, match=pattern):
        mt.pre(*change(*_valid()))


def test_a_cuda_tensor_raises_no_verified_cuda_kernel():
    """The CUDA backend has never run: the kernel path refuses CUDA tensors by name."""
    from mhc.torch import _checks

    class OnCuda:
        device = torch.device("cuda", 0)

    with pytest.raises(TypeError, match=r"x: a CUDA tensor, and mhc has no verified CUDA kernel"):
        _checks.check_device("x", OnCuda(), use_kernel=True)
    _checks.check_device("x", OnCuda(), use_kernel=False)  # the plain path runs anywhere
    if torch.cuda.is_available():
        x, params, config = _valid()
        with pytest.raises(TypeError, match=r"mhc.torch.pre: x: a CUDA tensor"):
            mt.pre(x.cuda(), params, config)


def test_bad_input_to_post_and_collapse():
    x, params, config = _valid()
    layer_in, ctx = mt.pre(x, params, config)
    with pytest.raises(ValueError, match=r"mhc.torch.post: layer_out: expected shape \(2, 8\)"):
        mt.post(layer_in[:, :4], ctx)
    with pytest.raises(TypeError, match=r"mhc.torch.post: ctx: expected the Context"):
        mt.post(layer_in, tuple(ctx))
    with pytest.raises(ValueError, match=r"mhc.torch.collapse: state: collapse is DeepSeek-V4.1's end"):
        mt.collapse(mt.Pending(layer_in, ctx))
    with pytest.raises(ValueError, match=r"mhc.torch.pre: carried: a carried mix is read only by"):
        mt.pre(x, params, config, carried=torch.ones(2, 4))


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "plain"])
def test_head_matches_float64(seed, use_kernel):
    """DeepSeek-V4's head: out and the gradients of x and its parameters against head_values."""
    rng = np.random.default_rng(seed)
    config, d = mj.Config(n=4), 16
    x = rng.standard_normal((2, 3, 4, d)).astype(np.float32)
    head = mj.HeadParams(
        rng.standard_normal((4, 4 * d)).astype(np.float32) / 8,
        rng.standard_normal(4).astype(np.float32),
        rng.uniform(0.5, 1.5, 1).astype(np.float32),
    )
    dout = rng.standard_normal((2, 3, d)).astype(np.float32)
    tx = to_torch(x, grad=True)
    thead = mt.HeadParams(*(to_torch(p, grad=True) for p in head))
    out = mt.head(tx, thead, config, use_kernel=use_kernel)
    out.backward(to_torch(dout))
    got = [out, tx.grad, *(p.grad for p in thead)]
    want = numpy_reference.head_values(x, head, config, dout)
    for index, (value, reference_value) in enumerate(zip(got, want, strict=True)):

        def perturbed(rng, index=index):
            x_, head_ = round_by_one_unit(rng, x), round_by_one_unit(rng, head)
            return numpy_reference.head_values(x_, head_, config, dout, noise=rng)[index]

        assert_matches(f"head {index}", value.detach().numpy(), reference_value, 1e-5, perturbed, f"seed={seed}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_v41_chain_and_head_bits_equal_mhc_jax(seed, dtype):
    """V4.1's chain (carried pre, fused carried boundaries, collapse) and V4's head: the same bits
    as mhc.jax's kernel path, forward and gradients."""
    import jax

    rng = np.random.default_rng(seed)
    config, d = mj.Config(n=4, pre_from_previous=True), 16
    x = rng.standard_normal((5, 4, d)).astype(np.float32)
    params = [random_numpy_params(rng, config, d) for _ in range(3)]
    tdtype, jdtype = DTYPES[dtype]

    def halve(h):  # a branch both frameworks compute exactly (a library's tanh may differ in its last bit)
        return h * 0.5

    def jax_loss(x, params):
        state = x.astype(jdtype)
        for p in params:
            state = mj.sublayer(state, p, config, halve)
        return mj.collapse(state).astype(jnp.float32).sum()

    want = jax.grad(jax_loss, argnums=(0, 1))(jnp.asarray(x), [mj.Params(*map(jnp.asarray, p)) for p in params])
    tx = to_torch(x, grad=True)
    tparams = [mt.Params(*(to_torch(v, grad=True) for v in p)) for p in params]
    state = tx.to(tdtype)
    for p in tparams:
        state = mt.sublayer(state, p, config, halve)
    mt.collapse(state).float().sum().backward()
    assert np.array_equal(tx.grad.numpy(), np.asarray(want[0]))
    for got_p, want_p in zip(tparams, want[1], strict=True):
        for a, b in zip(got_p, want_p, strict=True):
            assert np.array_equal(a.grad.numpy(), np.asarray(b))

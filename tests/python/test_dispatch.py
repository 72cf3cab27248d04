"""Dispatch per platform: use_kernel=True runs mhc kernels or raises an mhc error that names the
operation, the platform and the way out; the one documented fallback (the boundary as its post
and pre kernels where only those are registered: a GPU) warns once per process unless told not to.

The platform is only known when XLA lowers the program, so these tests lower for other platforms
with jax.export (no TPU or GPU needed): the errors come from lowering, as they would on the machine.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import mhc.jax as mj
from conftest import random_params
from mhc import _ffi
from mhc.jax import _kernels

# The kernels each backend has, written out, so that a kernel lost from a backend (a row gone from
# mhc.tpu.KERNELS, a registration dropped) fails here instead of the tests adapting to it.
V4_KERNELS = frozenset(
    f"mhc_{operation}_{direction}"
    for operation in ("pre", "post", "boundary", "head")
    for direction in ("forward", "backward")
)
V41_KERNELS = frozenset(
    {
        "mhc_pre_forward_carried",
        "mhc_pre_backward_carried",
        "mhc_boundary_forward_carried",
        "mhc_boundary_backward_carried",
        "mhc_collapse_forward",
        "mhc_collapse_backward",
    }
)
# The D-split (tensor-parallel) forms.
SPLIT_KERNELS = frozenset(
    {
        "mhc_pre_forward_partials",
        "mhc_pre_forward_finish",
        "mhc_pre_forward_finish_carried",
        "mhc_pre_backward_partials",
        "mhc_pre_backward_finish",
        "mhc_pre_backward_finish_carried",
    }
)
EXPECTED_KERNELS = {
    "cpu": V4_KERNELS | V41_KERNELS | SPLIT_KERNELS,
    # The CUDA backend: V4's pre and post and their split forms, no boundary, head or V4.1.
    "cuda": frozenset(
        {
            "mhc_pre_forward",
            "mhc_pre_backward",
            "mhc_post_forward",
            "mhc_post_backward",
            "mhc_pre_forward_partials",
            "mhc_pre_forward_finish",
            "mhc_pre_backward_partials",
            "mhc_pre_backward_finish",
        }
    ),
    # The TPU backend: every fused kernel and the split forms (V4's and V4.1's).
    "tpu": V4_KERNELS | V41_KERNELS | SPLIT_KERNELS,
}

CONFIG = mj.Config(n=4)
T, D = 6, 16
OPERATIONS = ("pre", "post", "boundary", "head")


def _problem(operation: str, config: mj.Config = CONFIG, dtype=jnp.float32):
    """(loss(*args), args) for one public operation alone: its forward and its backward."""
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (T, config.n, D), dtype)
    layer_out = jax.random.normal(keys[1], (T, D), dtype)
    h_post = jax.random.uniform(keys[2], (T, config.n), jnp.float32)
    h_res = jax.random.uniform(keys[3], (T, config.n, config.n), jnp.float32)
    params = random_params(keys[4], config, D)

    def context(x, h_post, h_res, use_kernel):
        return mj.Context(x, h_post, h_res, config, use_kernel)

    if operation == "pre":
        return (
            lambda x, params, *, use_kernel, **kw: (
                mj.pre(x, params, config, use_kernel=use_kernel)[0].astype(jnp.float32).sum()
            )
        ), (x, params)
    if operation == "post":
        return (
            lambda x, lo, hp, hr, *, use_kernel, **kw: (
                mj.post(lo, context(x, hp, hr, use_kernel)).astype(jnp.float32).sum()
            ),
            (x, layer_out, h_post, h_res),
        )
    if operation == "boundary":

        def boundary(x, lo, hp, hr, params, *, use_kernel, **kw):
            layer_in, _ = mj.boundary(lo, context(x, hp, hr, use_kernel), params, config, use_kernel=use_kernel, **kw)
            return layer_in.astype(jnp.float32).sum()

        return boundary, (x, layer_out, h_post, h_res, params)
    head = mj.init_head_params(keys[4], config, D)
    return (
        lambda x, head, *, use_kernel, **kw: mj.head(x, head, config, use_kernel=use_kernel).astype(jnp.float32).sum()
    ), (x, head)


def _export(operation: str, platforms, use_kernel: bool = True, config=CONFIG, dtype=jnp.float32, **keywords):
    """Exports the value and gradient of `operation` for `platforms`; the mhc custom calls are
    allowed in the artifact (they have no compatibility guarantee, which export checks)."""
    loss, args = _problem(operation, config, dtype)
    checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in _ffi.TARGET_NAMES]
    function = jax.jit(jax.value_and_grad(lambda *a: loss(*a, use_kernel=use_kernel, **keywords)))
    return jax.export.export(function, platforms=platforms, disabled_checks=checks)(*args)


def _has_kernels(operation: str, platform: str) -> bool:
    targets = {"pre": ("mhc_pre_forward", "mhc_pre_backward"), "post": ("mhc_post_forward", "mhc_post_backward")}
    targets["boundary"] = ("mhc_boundary_forward", "mhc_boundary_backward")
    targets["head"] = ("mhc_head_forward", "mhc_head_backward")
    return set(targets[operation]) <= _kernels.registered_targets(platform)


@pytest.mark.parametrize("platform", sorted(EXPECTED_KERNELS))
def test_each_backend_has_exactly_its_kernels(platform):
    """The kernels the dispatch finds per platform, against the sets written above (CUDA's only
    where this build has the CUDA backend)."""
    if platform == "cuda" and not _ffi.CUDA_TARGETS:
        assert _kernels.registered_targets("cuda") == frozenset()
        return
    assert _kernels.registered_targets(platform) == EXPECTED_KERNELS[platform]


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The warn-once record emptied, as in a fresh process."""
    monkeypatch.setattr(_kernels.dispatch, "_warned", set())


def _tpu_runs(operation: str) -> tuple[bool, bool]:
    """(forward, backward): whether a TPU runs them, from the TPU's expected kernels (which
    test_each_backend_has_exactly_its_kernels holds mhc.tpu.KERNELS to): the operation's own
    kernel, or for the boundary its post and pre ones."""
    tpu = EXPECTED_KERNELS["tpu"]
    own = {f"mhc_{operation}_forward"} <= tpu, {f"mhc_{operation}_backward"} <= tpu
    if operation != "boundary":
        return own
    fallback_forward = {"mhc_post_forward", "mhc_pre_forward"} <= tpu
    fallback_backward = {"mhc_pre_backward", "mhc_post_backward", "mhc_post_forward"} <= tpu
    return own[0] or fallback_forward, own[1] or fallback_backward


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mix", ["sinkhorn", "permutations"])
@pytest.mark.parametrize("operation", OPERATIONS)
def test_a_tpu_runs_the_tpu_kernels_or_gets_the_mhc_error(operation, mix, dtype):
    """Every configuration the dispatch can choose (operation, mix, dtype; value and gradient),
    exported for a TPU through the public API: Mosaic kernels and no C++ custom call where
    mhc.tpu.KERNELS has the operation's kernels, else the mhc error naming it."""
    config = mj.Config(n=4, mix=mix)
    forward, backward = _tpu_runs(operation)
    value = jax.jit(lambda *a: _problem(operation, config, dtype)[0](*a, use_kernel=True, fallback="allow"))
    args = _problem(operation, config, dtype)[1]
    error = pytest.raises(NotImplementedError, match=rf"mhc\.jax\.{operation}: .*'tpu'.*use_kernel=False")
    if not forward:
        with error:
            jax.export.export(value, platforms=["tpu"])(*args)
        return
    text = jax.export.export(value, platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in text and "@mhc_" not in text
    if not backward:
        with error:
            _export(operation, ["tpu"], config=config, dtype=dtype, fallback="allow")
        return
    text = _export(operation, ["tpu"], config=config, dtype=dtype, fallback="allow").mlir_module()
    assert "tpu_custom_call" in text and "@mhc_" not in text


def test_a_tpu_runs_its_kernels_inside_shard_map_with_the_tokens_split():
    """jax.shard_map (check_vma on) over the tokens: each device's kernels, typed like the FFI
    calls' results. Value and gradient exported for a TPU."""
    mesh = jax.sharding.AbstractMesh((2,), ("data",))
    x, params = _problem("pre")[1]
    spec = jax.sharding.PartitionSpec

    def sublayer(x, params):
        layer_in, ctx = mj.pre(x, params, CONFIG)
        return mj.post(jnp.tanh(layer_in), ctx)

    def loss(x, params):
        sharded = jax.shard_map(sublayer, mesh=mesh, in_specs=(spec("data"), spec()), out_specs=spec("data"))
        return jnp.sum(sharded(x, params) ** 2)

    function = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    text = jax.export.export(function, platforms=["tpu"])(x, params).mlir_module()
    assert text.count("tpu_custom_call") >= 4 and "@mhc_" not in text


@pytest.mark.parametrize("carried", [False, True], ids=["V4", "V4.1"])
def test_a_d_split_on_a_tpu_lowers_to_the_split_kernels(carried):
    """On a TPU, D split over a mesh axis (inside shard_map with tensor_axis) runs the split forms'
    Pallas kernels, forward and backward (their values: test_tpu_split.py, tpu_dispatch_cases.py)."""
    config = mj.Config(n=4, pre_from_previous=carried)
    mesh = jax.sharding.AbstractMesh((2,), ("model",))
    x, params = _problem("pre", config)[1]

    def loss(x, params, mix):
        layer_in, ctx = mj.pre(x, params, config, carried=mix if carried else None, tensor_axis="model")
        return jax.lax.psum(jnp.sum(jnp.square(layer_in)) + jnp.sum(ctx.h_post), "model")

    spec = jax.sharding.PartitionSpec
    sharded = jax.shard_map(loss, mesh=mesh, in_specs=(spec(None, None, "model"), spec(), spec()), out_specs=spec())
    # The gradient of V4.1's carried mix too: its backward partials are dcarried's.
    gradient = jax.jit(jax.grad(sharded, argnums=(0, 1, 2)))
    text = jax.export.export(gradient, platforms=["tpu"])(x, params, jnp.ones(x.shape[:-1])).mlir_module()
    finish = "_carried" if carried else ""
    for kernel in (
        "pre_forward_partials",
        f"pre_forward_finish{finish}",
        "pre_backward_partials",
        f"pre_backward_finish{finish}",
    ):
        assert re.search(rf'kernel_name = "mhc_{kernel}_tile\d+"', text), kernel
    assert "@mhc_" not in text


def test_a_kernel_call_in_the_callers_cpu_branch_exports_for_several_platforms():
    """Exported for several platforms at once, JAX lowers every platform_dependent branch for all
    of them: the kernel path in the caller's CPU branch must not raise for the TPU, whose own
    branch (the plain path) is the one that runs there."""
    x, params = _problem("pre")[1]

    def f(x, params):
        kernel = lambda x, p: mj.pre(x, p, CONFIG)[0]  # noqa: E731
        plain = lambda x, p: mj.pre(x, p, CONFIG, use_kernel=False)[0]  # noqa: E731
        return jax.lax.platform_dependent(x, params, cpu=kernel, default=plain)

    checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in _ffi.TARGET_NAMES]
    exported = jax.export.export(jax.jit(f), platforms=["cpu", "tpu"], disabled_checks=checks)(x, params)
    assert "mhc_pre_forward" in exported.mlir_module()


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("operation", OPERATIONS)
def test_the_plain_path_lowers_anywhere(operation, platform):
    exported = _export(operation, [platform], use_kernel=False)
    assert "mhc_" not in exported.mlir_module()


@pytest.mark.parametrize("operation", OPERATIONS)
def test_the_cpu_runs_every_kernel(operation):
    text = _export(operation, ["cpu"]).mlir_module()
    assert f"mhc_{operation}_forward" in text and f"mhc_{operation}_backward" in text


def test_the_head_on_a_gpu_raises():
    """No CUDA head kernel: use_kernel=True raises, it never runs the plain formulas unasked."""
    with pytest.raises(NotImplementedError, match=r"mhc\.jax\.head: .*'cuda'.*use_kernel=False"):
        _export("head", ["cuda"])


@pytest.mark.parametrize("operation", ["pre", "post"])
def test_pre_and_post_on_a_gpu(operation):
    """The CUDA kernels where this build has them (the _mhc_cuda module), else the mhc error."""
    if _has_kernels(operation, "cuda"):
        text = _export(operation, ["cuda"]).mlir_module()
        assert f"mhc_{operation}_forward" in text and f"mhc_{operation}_backward" in text
    else:
        assert _ffi._mhc_cuda is None
        with pytest.raises(NotImplementedError, match=rf"mhc\.jax\.{operation}: .*'cuda'"):
            _export(operation, ["cuda"])


def _needs_the_boundary_fallback():
    if not (_has_kernels("pre", "cuda") and _has_kernels("post", "cuda")):
        pytest.skip("built without CUDA (no _mhc_cuda module): the GPU has no mhc kernel to fall back on")
    assert not _has_kernels("boundary", "cuda"), "a CUDA boundary kernel: the fallback tests are stale"


@pytest.mark.usefixtures("fresh_warnings")
def test_the_boundary_on_a_gpu_warns_once_per_process():
    _needs_the_boundary_fallback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = _export("boundary", ["cuda"]).mlir_module()  # forward and backward
        _export("boundary", ["cuda"])  # a second program
    messages = [str(w.message) for w in caught if "mhc" in str(w.message)]
    assert len(messages) == 1, messages
    assert "mhc.jax.boundary" in messages[0] and "'cuda'" in messages[0] and "fallback='allow'" in messages[0]
    # What runs: the post and pre kernels, no boundary kernel.
    assert "mhc_boundary" not in text
    for target in ("mhc_post_forward", "mhc_pre_forward", "mhc_pre_backward", "mhc_post_backward"):
        assert target in text, target


@pytest.mark.usefixtures("fresh_warnings")
def test_fallback_allow_silences_the_warning():
    _needs_the_boundary_fallback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = _export("boundary", ["cuda"], fallback="allow").mlir_module()
    assert not [w for w in caught if "mhc" in str(w.message)]
    assert "mhc_pre_forward" in text and "mhc_boundary" not in text


@pytest.mark.usefixtures("fresh_warnings")
def test_fallback_error_refuses_the_fallback():
    _needs_the_boundary_fallback()
    with pytest.raises(NotImplementedError, match=r"mhc\.jax\.boundary: .*'cuda'.*fallback='error'"):
        _export("boundary", ["cuda"], fallback="error")


@pytest.mark.usefixtures("fresh_warnings")
def test_the_cpu_runs_the_fused_boundary_without_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _export("boundary", ["cpu"], fallback="error")
    assert not [w for w in caught if "mhc" in str(w.message)]


def test_sublayer_passes_the_fallback_on():
    _needs_the_boundary_fallback()
    params = random_params(jax.random.key(1), CONFIG, D)
    x = jnp.ones((T, CONFIG.n, D), jnp.float32)

    def chain(x, params):
        state = mj.sublayer(x, params, CONFIG, jnp.tanh, fallback="error")
        return mj.finish(mj.sublayer(state, params, CONFIG, jnp.tanh, fallback="error")).sum()

    with pytest.raises(NotImplementedError, match="fallback='error'"):
        jax.export.export(jax.jit(chain), platforms=["cuda"])(x, params)


def test_a_bad_fallback_is_refused():
    loss, args = _problem("boundary")
    message = r"fallback: expected one of \('warn', 'allow', 'error'\), got 'quiet'"
    with pytest.raises(ValueError, match=message):
        loss(*args, use_kernel=True, fallback="quiet")
    with pytest.raises(ValueError, match=message):  # the first sublayer of a chain, which runs pre
        mj.sublayer(args[0], args[4], CONFIG, jnp.tanh, fallback="quiet")

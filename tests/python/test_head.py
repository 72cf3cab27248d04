"""DeepSeek-V4's head (mhc.jax.head, spec: Head): the kernel path under jit against the float64
NumPy oracle (numpy_reference.head_values, itself pinned to central differences here), the plain
path against the same oracle, bad input, T = 0, vmap and a sharded jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mhc.jax as mj
import numpy_reference
from conftest import assert_matches, round_by_one_unit

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
NAMES = ("out", "dx", "dfn", "dbase", "dscale")


def random_head(rng, n, d, pre_eps=None):
    """scale of order 1 with either sign and a random base: gates away from 0 and 1."""
    m = n * d
    return mj.HeadParams(
        fn=(rng.standard_normal((n, m)) / np.sqrt(m)).astype(np.float32),
        base=rng.standard_normal(n).astype(np.float32),
        scale=(rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5, size=1)).astype(np.float32),
    )


@functools.partial(jax.jit, static_argnames=("config", "use_kernel"))
def head_and_vjp(x, head, config, dout, use_kernel=True):
    out, vjp = jax.vjp(lambda x, head: mj.head(x, head, config, use_kernel=use_kernel), x, head)
    dx, grads = vjp(dout)
    return (out, dx, *grads)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "plain"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,d", [(1, 1), (3, 130), (4, 64), (4, 512)])
def test_matches_float64(seed, use_kernel, dtype, n, d):
    rng = np.random.default_rng(seed)
    config = mj.Config(n=n, pre_eps=0.05, rms_eps=1e-3)  # non-default scalars reach the kernel
    lead = (2, 7)
    x = jnp.asarray(rng.standard_normal((*lead, n, d)), dtype).at[1, 3].set(0)  # an all-zero token
    dout = jnp.asarray(rng.standard_normal((*lead, d)), dtype)
    head = random_head(rng, n, d)
    got = head_and_vjp(x, head, config, dout, use_kernel)
    assert got[0].dtype == dtype and got[1].dtype == dtype
    want = numpy_reference.head_values(x, head, config, dout)

    def moved(index, rng):
        x_, head_, dout_ = (round_by_one_unit(rng, v) for v in (x, head, dout))
        return numpy_reference.head_values(x_, head_, config, dout_, noise=rng)[index]

    for index, name in enumerate(NAMES):
        tolerance = 1e-5 if name in ("dfn", "dbase", "dscale") else TOLERANCE[dtype]
        if not use_kernel:
            tolerance = max(tolerance, 1e-4)  # XLA's f32 reductions are not blocked
        perturbed = lambda rng, i=index: moved(i, rng)  # noqa: E731
        assert_matches(name, got[index], want[index], tolerance, perturbed, f"(seed {seed})")


def test_oracle_backward_matches_central_differences(seed):
    rng = np.random.default_rng(seed)
    config = mj.Config(n=3)
    x = rng.standard_normal((4, 3, 5))
    head = mj.HeadParams(*(np.asarray(p, np.float64) for p in random_head(rng, 3, 5)))
    dout = rng.standard_normal((4, 5))
    _, dx, dfn, dbase, dscale = numpy_reference.head_values(x, head, config, dout)

    def loss(x, head):
        return float((numpy_reference.head_values(x, head, config, dout)[0] * dout).sum())

    step = 1e-6
    for name, array, grad, place in [
        ("x", x, dx, lambda a: (a, head)),
        ("fn", head.fn, dfn, lambda a: (x, head._replace(fn=a))),
        ("base", head.base, dbase, lambda a: (x, head._replace(base=a))),
        ("scale", head.scale, dscale, lambda a: (x, head._replace(scale=a))),
    ]:
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            up, down = array.copy(), array.copy()
            up[index] += step
            down[index] -= step
            numeric[index] = (loss(*place(up)) - loss(*place(down))) / (2 * step)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7, err_msg=name)


def test_kernel_and_plain_paths_agree_and_vmap(seed):
    rng = np.random.default_rng(seed)
    config = mj.Config(n=4)
    x = jnp.asarray(rng.standard_normal((3, 5, 4, 16)), jnp.float32)
    head = random_head(rng, 4, 16)
    kernel = jax.vmap(lambda xs: mj.head(xs, head, config))(x)
    plain = mj.head(x, head, config, use_kernel=False)
    # Each against the float64 head with the one accuracy rule, never the two f32 paths together.
    no_cotangent = np.zeros(x.shape[:-2] + x.shape[-1:])
    want = numpy_reference.head_values(x, head, config, no_cotangent)[0].reshape(kernel.shape)

    def perturbed(rng):
        moved = round_by_one_unit(rng, x), round_by_one_unit(rng, head), config, no_cotangent, rng
        return numpy_reference.head_values(*moved)[0].reshape(kernel.shape)

    for label, out in (("kernel, vmapped", kernel), ("plain", plain)):
        assert_matches("out", out, want, 1e-5, perturbed, f"({label}, seed {seed})")


def test_no_tokens():
    config = mj.Config(n=3)
    head = random_head(np.random.default_rng(0), 3, 8)
    x = jnp.zeros((0, 3, 8), jnp.bfloat16)
    out, dx, dfn, dbase, dscale = head_and_vjp(x, head, config, jnp.zeros((0, 8), jnp.bfloat16))
    assert out.shape == (0, 8) and dx.shape == (0, 3, 8)
    for grad in (dfn, dbase, dscale):
        np.testing.assert_array_equal(grad, 0)


def test_bad_input_names_the_argument():
    config = mj.Config(n=3)
    head = random_head(np.random.default_rng(0), 3, 8)
    x = jnp.zeros((5, 3, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"params.fn: expected shape \(3, 24\)"):
        mj.head(x, head._replace(fn=jnp.zeros((3, 23), jnp.float32)), config)
    with pytest.raises(TypeError, match="params.scale: expected dtype float32"):
        mj.head(x, head._replace(scale=jnp.zeros((1,), jnp.bfloat16)), config)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., 3, D\]"):
        mj.head(jnp.zeros((5, 4, 8), jnp.float32), head, config)
    with pytest.raises(TypeError, match="x: expected dtype float32 or bfloat16"):
        mj.head(jnp.zeros((5, 3, 8), jnp.float16), head, config)
    with pytest.raises(TypeError, match="params: expected mhc.jax.HeadParams"):
        mj.head(x, tuple(head), config)


def test_kernel_path_calls_the_head_kernels():
    config = mj.Config(n=2)
    head = random_head(np.random.default_rng(0), 2, 8)
    x = jnp.ones((3, 2, 8), jnp.float32)

    def loss(x, head, use_kernel):
        return mj.head(x, head, config, use_kernel=use_kernel).sum()

    def hlo(use_kernel):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
        return step.lower(x, head, use_kernel).compile().as_text()

    kernel = hlo(True)
    assert kernel.count('custom_call_target="mhc_head_forward"') == 1
    assert kernel.count('custom_call_target="mhc_head_backward"') == 1
    assert "mhc_" not in hlo(False)

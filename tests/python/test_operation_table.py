"""The declared operations (src/ffi/operations.h) as mhc._mhc_cpu exposes them: operations()
matches the FFI registrations one to one, run() gives the bits of the JAX kernel path on the same
inputs (both call the same C++ functions), and bad input raises a ValueError naming the operation
and the argument, never a crash."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhc import _ffi, _mhc_cpu
from mhc._config import Config, PreApply
from mhc._operations import OPERATIONS, output_specs
from mhc.jax._kernels.dispatch import _attributes, _ffi_call

N_STREAMS, TOKENS, FEATURES = 4, 5, 24

# The operations that exist, written out (not read from the table): a row removed from or added
# to src/ffi/operations.h fails here until this list says so.
PINNED_CUDA = (
    "pre_forward", "post_forward", "post_backward", "pre_backward",
    "pre_forward_partials", "pre_forward_finish", "pre_backward_partials", "pre_backward_finish",
)  # fmt: skip
PINNED_CPU = PINNED_CUDA + (
    "boundary_forward", "boundary_backward", "head_forward", "head_backward",
    "pre_forward_carried", "pre_backward_carried", "collapse_forward", "collapse_backward",
    "boundary_forward_carried", "boundary_backward_carried",
    "pre_forward_finish_carried", "pre_backward_finish_carried",
)  # fmt: skip
CONFIG = Config(n=N_STREAMS)


def _config_args(config: Config, slices: int = 1) -> dict:
    return {name: value.item() for name, value in _attributes(config, slices).items()}


def _input(name: str, rng: np.random.Generator, dtype, carried_width: int, config: Config) -> np.ndarray:
    """A random input named as the declarations name it, shaped for [T, n, D] = [5, 4, 24]."""
    t, n, d = TOKENS, N_STREAMS, FEATURES
    width = config.projection_width
    base = name.removeprefix("next_")
    shapes = {
        "x": (t, n, d), "g": (t, n, d), "dx_partial": (t, n, d),
        "layer_out": (t, d), "dlayer_in": (t, d), "dout": (t, d),
        "h_pre": (t, n), "h_post": (t, n), "dh_pre": (t, n), "dh_post": (t, n),
        "h_res": (t, n, n), "dh_res": (t, n, n), "carried": (t, carried_width),
        "norm_weight": (n * d,), "phi": (n * d, width), "alpha": (3,), "bias": (width,),
        "partials": (t, width + 1), "fn": (n, n * d), "base": (n,), "scale": (1,),
    }  # fmt: skip
    values = rng.standard_normal(shapes[base]) / (np.sqrt(n * d) if base in ("phi", "fn") else 1.0)
    if base == "partials":  # the last column is a sum of squares
        values[:, -1] = np.abs(values[:, -1]) * n * d
    activation = base in ("x", "g", "dx_partial", "layer_out", "dlayer_in", "dout")
    return values.astype(dtype if activation else np.float32)


def _inputs(operation: dict, rng, dtype=np.float32, carried_width: int = N_STREAMS, config: Config = CONFIG) -> list:
    return [_input(name, rng, dtype, carried_width, config) for name in operation["inputs"]]


def _run(operation: dict, inputs: list, config: Config = CONFIG) -> list:
    outputs = [np.full(shape, np.nan, dtype) for shape, dtype in output_specs(operation, inputs, np.float32)]
    _mhc_cpu.run(operation["name"], inputs, outputs, **_config_args(config))
    return outputs


def test_operations_are_the_pinned_ones_on_their_platforms():
    assert sorted(OPERATIONS) == sorted(PINNED_CPU)
    assert sorted(name for name, op in OPERATIONS.items() if "cuda" in op["platforms"]) == sorted(PINNED_CUDA)
    assert all(op["platforms"] in (("cpu",), ("cpu", "cuda")) for op in OPERATIONS.values())


def test_operations_match_the_registrations_one_to_one():
    targets = [operation["target"] for operation in OPERATIONS.values()]
    assert sorted(targets) == sorted(_mhc_cpu.registrations()) == list(_ffi.TARGET_NAMES)
    assert all(operation["target"] == "mhc_" + name for name, operation in OPERATIONS.items())
    for operation in OPERATIONS.values():
        assert len(operation["outputs"]) == len(operation["output_shapes"]) == len(operation["output_dtypes"])
        assert "x" in operation["inputs"], operation["name"]
    cuda = {operation["target"] for operation in OPERATIONS.values() if "cuda" in operation["platforms"]}
    if _ffi.CUDA_TARGETS:
        assert cuda == set(_ffi.CUDA_TARGETS)


@pytest.mark.parametrize("mix", ["sinkhorn", "permutations"])
@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_run_gives_the_bits_of_the_ffi_call(name, mix, seed):
    operation, config = OPERATIONS[name], Config(n=N_STREAMS, mix=mix)
    inputs = _inputs(operation, np.random.default_rng(seed), config=config)
    got = _run(operation, inputs, config)
    types = tuple(jax.ShapeDtypeStruct(s, d) for s, d in output_specs(operation, inputs, jnp.float32))
    want = _ffi_call(*inputs, target=operation["target"], config=config, result_types=types, slices=1)
    assert len(got) == len(want) == len(operation["outputs"])
    for output, g, w in zip(operation["outputs"], got, want, strict=True):
        assert np.all(np.isfinite(g)), f"{name}: {output} is not finite (or not written)"
        np.testing.assert_array_equal(g, np.asarray(w), err_msg=f"{name}: {output}")


@pytest.mark.parametrize("mix", ["sinkhorn", "permutations"])
def test_partials_are_as_wide_as_the_projection_of_either_mix(mix, seed):
    """N in the rules is phi's width: 2n + n^2 for the Sinkhorn mix, 2n + n! for the permutations
    (24 + 8 at n = 4, not 16 + 8): the partials the split forward writes are [T, N + 1]."""
    config = Config(n=N_STREAMS, mix=mix)
    width = 2 * N_STREAMS + (N_STREAMS * N_STREAMS if mix == "sinkhorn" else 24)
    assert width == config.projection_width
    rng = np.random.default_rng(seed)
    d = FEATURES
    inputs = [
        rng.standard_normal((TOKENS, N_STREAMS, d)).astype(np.float32),
        rng.standard_normal(N_STREAMS * d).astype(np.float32),
        (rng.standard_normal((N_STREAMS * d, width)) / np.sqrt(N_STREAMS * d)).astype(np.float32),
    ]
    operation = OPERATIONS["pre_forward_partials"]
    (spec,) = output_specs(operation, inputs, np.float32)
    assert spec[0] == (TOKENS, width + 1)
    partials = np.full(spec[0], np.nan, np.float32)
    _mhc_cpu.run("pre_forward_partials", inputs, [partials], **_config_args(config))
    assert np.all(np.isfinite(partials))


@pytest.mark.parametrize("name", ["pre_forward_carried", "collapse_backward"])
def test_run_takes_the_one_hot_carried_mix_as_t_by_0(name, seed):
    operation = OPERATIONS[name]
    inputs = _inputs(operation, np.random.default_rng(seed), carried_width=0)
    outputs = _run(operation, inputs)
    x = inputs[operation["inputs"].index("x")]
    if name == "pre_forward_carried":
        np.testing.assert_array_equal(outputs[0], x[:, 0])  # layer_in: stream 0
    else:
        assert outputs[1].shape == (TOKENS, 0)  # dcarried


def test_run_takes_bfloat16_torch_tensors(seed):
    torch = pytest.importorskip("torch")
    operation = OPERATIONS["post_forward"]
    inputs = _inputs(operation, np.random.default_rng(seed))
    tensors = [torch.from_numpy(a) for a in inputs]
    tensors[0], tensors[1] = tensors[0].bfloat16(), tensors[1].bfloat16()
    out = torch.empty(tensors[0].shape, dtype=torch.bfloat16)
    _mhc_cpu.run("post_forward", tensors, [out], **_config_args(CONFIG))
    types = (jax.ShapeDtypeStruct(tuple(out.shape), jnp.bfloat16),)
    bf16 = torch.bfloat16
    args = [jnp.asarray(t.float().numpy()).astype(jnp.bfloat16 if t.dtype == bf16 else jnp.float32) for t in tensors]
    (want,) = _ffi_call(*args, target="mhc_post_forward", config=CONFIG, result_types=types, slices=1)
    np.testing.assert_array_equal(out.float().numpy(), np.asarray(want.astype(jnp.float32)))


def _bad_call(case: str, rng):
    operation = OPERATIONS["pre_forward"]
    inputs = _inputs(operation, rng)
    outputs = [np.zeros(shape, dtype) for shape, dtype in output_specs(operation, inputs, np.float32)]
    config = _config_args(CONFIG)
    if case == "input count":
        inputs.pop()
    elif case == "output count":
        outputs.append(outputs[0])
    elif case == "dtype":
        inputs[0] = inputs[0].astype(np.float64)
    elif case == "not contiguous":
        inputs[0] = np.asfortranarray(inputs[0])
    elif case == "not an array":
        inputs[2] = "phi"
    elif case == "read-only output":
        outputs[1].setflags(write=False)
    elif case == "shape":
        outputs[3] = np.zeros((TOKENS, N_STREAMS), np.float32)
    elif case == "rank":
        inputs[0] = inputs[0][:, :, :, None, None]
    elif case == "mix":
        config["mix"] = 7
    elif case == "name":
        return ("pre_forwards", inputs, outputs, config)
    return ("pre_forward", inputs, outputs, config)


@pytest.mark.parametrize(
    "case, message",
    [
        ("input count", "mhc::pre_forward: inputs: expected 5 arrays, got 4"),
        ("output count", "mhc::pre_forward: outputs: expected 4 arrays, got 5"),
        ("dtype", "mhc::pre_forward: x: expected dtype float32 or bfloat16"),
        ("not contiguous", "mhc::pre_forward: x: expected a C-contiguous array"),
        ("not an array", "mhc::pre_forward: phi: expected an array"),
        ("read-only output", "mhc::pre_forward: h_pre: expected a writable array"),
        ("shape", r"mhc::pre_forward: h_res: expected shape \[5, 4, 4\], got \[5, 4\]"),
        ("rank", "mhc::pre_forward: x: expected at most 4 dimensions"),
        ("mix", r"mhc::pre_forward: mix: expected 0 \(sinkhorn\) or 1 \(permutations\)"),
        ("name", "no operation named 'pre_forwards'"),
    ],
)
def test_run_rejects_bad_input_naming_the_operation_and_argument(case, message, seed):
    name, inputs, outputs, config = _bad_call(case, np.random.default_rng(seed))
    with pytest.raises(ValueError, match=message):
        _mhc_cpu.run(name, inputs, outputs, **config)


def test_run_rejects_an_array_outside_host_memory(seed):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for a device tensor")
    name, inputs, outputs, config = _bad_call("valid", np.random.default_rng(seed))
    inputs[0] = torch.from_numpy(inputs[0]).cuda()
    with pytest.raises(ValueError, match="mhc::pre_forward: x: expected an array in host memory"):
        _mhc_cpu.run(name, inputs, outputs, **config)


def test_pre_apply_is_derived_once_from_the_public_arguments():
    v4, v41 = Config(n=4), Config(n=4, pre_from_previous=True)
    mix = np.full((TOKENS, 4), 0.25, np.float32)
    assert PreApply.of(v4, None) is PreApply.OWN_GATES
    assert PreApply.of(v41, None) is PreApply.ONE_HOT
    assert PreApply.of(v41, mix) is PreApply.CARRIED


def test_pre_apply_has_the_values_of_the_cpp_enum():
    """mhc._config.PreApply and mhc::PreApply (include/mhc/config.h) are one value: same names and
    numbers, read from the header's declaration."""
    header = (Path(__file__).resolve().parents[2] / "include" / "mhc" / "config.h").read_text()
    body = re.search(r"enum class PreApply : int32_t \{(.*?)\};", header, re.S).group(1)
    cpp = {name.upper(): int(value) for name, value in re.findall(r"(\w+) = (\d+),", body)}
    assert cpp == {mode.name: mode.value for mode in PreApply}

"""python -m mhc.bench on tiny shapes: both paths compute the same thing, each held to the float64
oracle with the one accuracy rule (so the ratio compares like with like), the table and the JSON
carry every column, byte counts follow the spec, and bad flags are rejected."""

import dataclasses
import functools
import json
import re

import jax
import numpy as np
import pytest

import conftest
import mhc
import mhc.jax as mj
import numpy_reference
from mhc import bench


@pytest.fixture
def tune_calls(monkeypatch):
    """Records mhc.tune_allocator() calls instead of changing this test process's allocator for
    every later test (test_allocator.py checks the real call in a subprocess)."""
    calls = []
    monkeypatch.setattr(mhc, "tune_allocator", lambda: calls.append(1) or True)
    return calls


def _sublayer_oracle(op, data, config, noise):
    """pre -> post with the branch layer_out = layer_in (bench's sublayer), and its VJP at g."""
    identity = [(data["params"], config, lambda layer_in: layer_in)]
    out, dx, (dparams,), _ = conftest.chain_values(data["x_sublayer"], identity, data["g_sublayer"], noise)
    return out if op == "sublayer_fwd" else (dx, dparams)


def _pre_post_oracle(op, data, config, noise):
    """The four operations alone: each output of the kernel path (pre_forward's h_pre too)."""
    x, params, layer_out, h_post, h_res = (data[name] for name in ("x", "params", "layer_out", "h_post", "h_res"))
    post = numpy_reference.post_values(x, layer_out, h_post, h_res, data["g"])
    gates = np.zeros(np.shape(x)[:-1])
    coefficients, (dx, dparams, _) = numpy_reference.pre_values(
        x, params, config, data["dlayer_in"], gates, data["dh_post"], data["dh_res"], noise=noise
    )
    return {
        "pre_forward": coefficients,
        "post_forward": post[0],
        "post_backward": post[1:],
        "pre_backward": (dx + data["g"], dparams),  # g: the dx_partial the pre's dx adds to
    }[op]


def _boundary_oracle(op, data, config, noise):
    """post, then the next sublayer's pre on its out (V4.1: mixing by the carried h_pre); the
    backward at the next pre's cotangents and g on the streams."""
    v41 = op.startswith("v41")
    config = dataclasses.replace(config, pre_from_previous=v41)
    x, layer_out, h_post, h_res = (data[name] for name in ("x", "layer_out", "h_post", "h_res"))
    out = numpy_reference.post_values(x, layer_out, h_post, h_res, np.zeros(np.shape(x)))[0]
    carried, dh_pre = (data["carried"], data["dh_pre"]) if v41 else (None, np.zeros(np.shape(x)[:-1]))
    (layer_in, *coefficients), (dnext, dparams, dcarried) = numpy_reference.pre_values(
        out, data["params"], config, data["dlayer_in"], dh_pre, data["dh_post"], data["dh_res"], carried, noise
    )
    if not v41:
        coefficients = coefficients[1:]  # V4's next context holds no h_pre
    if op.endswith("_fwd"):
        return (layer_in, out, *coefficients)
    _, dx, dlayer_out, dh_post, dh_res = numpy_reference.post_values(x, layer_out, h_post, h_res, data["g"] + dnext)
    return (dx, dlayer_out, *([dcarried] if v41 else []), dh_post, dh_res, dparams)


def _v41_pre_oracle(op, data, config, noise):
    config = dataclasses.replace(config, pre_from_previous=True)
    coefficients, gradients = numpy_reference.pre_values(
        data["x"],
        data["params"],
        config,
        *(data[name] for name in ("dlayer_in", "dh_pre", "dh_post", "dh_res")),
        carried=data["carried"],
        noise=noise,
    )
    return coefficients if op == "v41_pre_fwd" else gradients


def _head_oracle(op, data, config, noise):
    out, *gradients = numpy_reference.head_values(data["x"], data["head_params"], config, data["dlayer_in"], noise)
    return out if op == "head_fwd" else (gradients[0], mj.HeadParams(*gradients[1:]))


def _collapse_oracle(op, data, config, noise):
    out, dx, dcarried = numpy_reference.collapse_values(data["x"], data["carried"], data["dlayer_in"])
    return out if op == "collapse_fwd" else (dx, dcarried)


# Each of bench.OPS: its float64 value in the kernel path's output structure, from bench._inputs'
# arrays (in float64, params included) and the bench's config; noise: numpy_reference's.
ORACLES = {
    **dict.fromkeys(("sublayer_fwd", "sublayer_fwd_bwd"), _sublayer_oracle),
    **dict.fromkeys(bench.OPS[:4], _pre_post_oracle),
    **dict.fromkeys(bench.BOUNDARY_OPS, _boundary_oracle),
    **dict.fromkeys(("v41_pre_fwd", "v41_pre_fwd_bwd"), _v41_pre_oracle),
    **dict.fromkeys(("head_fwd", "head_fwd_bwd"), _head_oracle),
    **dict.fromkeys(("collapse_fwd", "collapse_fwd_bwd"), _collapse_oracle),
}


def _oracle_leaves(op, data, config, noise=None):
    return jax.tree.leaves(ORACLES[op](op, data, config, noise))


# slow: the cases over 5 s of CPU at -n 0 (7.9, 7.1, 7.8, 6.6, 6.0 and 5.7 s; pyproject.toml's
# markers, docs/testing.md's "Fast tier"); the other 26 take 2-5 s.
SLOW_AGREEMENT_CASES = {
    ("sublayer_fwd_bwd", False),
    ("sublayer_fwd_bwd", True),
    ("pre_backward", False),
    ("boundary_fwd_bwd", False),
    ("v41_pre_fwd_bwd", False),
    ("v41_boundary_fwd_bwd", False),
}
assert {op for op, _ in SLOW_AGREEMENT_CASES} <= set(bench.OPS), "a renamed operation would fall into make check"


@pytest.mark.parametrize(
    "op,batch_axis",
    [
        pytest.param(
            op,
            batch_axis,
            id=f"{op}-{batch_axis}",
            marks=pytest.mark.slow if (op, batch_axis) in SLOW_AGREEMENT_CASES else (),
        )
        for op in bench.OPS
        for batch_axis in (False, True)
    ],
)
def test_kernel_and_plain_functions_agree(op, batch_axis, seed):
    """Both paths against the float64 oracle with the one rule (so the ratio compares like with
    like); the fused boundary and its two separate kernel calls: the same bits."""
    if batch_axis and not op.startswith("sublayer"):
        pytest.skip("only the sublayer ops take a batch axis")
    shape = bench.Shape(tokens=5, n=3, dim=16, dtype="f32", mix="sinkhorn", batch_axis=batch_axis)
    config, params, data = bench._inputs(shape, seed=seed)
    data["params"] = params
    results = {}
    for use_kernel in (True, False):
        function, names = bench._functions(op, use_kernel, config)
        results["kernel" if use_kernel else "plain"] = function(*(data[name] for name in names))
    if op in bench.BOUNDARY_OPS:
        function, names = bench._functions(op, True, config, fused=False)
        separate = function(*(data[name] for name in names))
        for got, want in zip(jax.tree.leaves(results["kernel"]), jax.tree.leaves(separate), strict=True):
            assert np.array_equal(np.asarray(got), np.asarray(want)), op
    data64 = jax.tree.map(lambda v: np.asarray(v, np.float64), data)
    want = _oracle_leaves(op, data64, config)

    def perturbed(index, rng):
        moved = {name: conftest.round_by_one_unit(rng, value) for name, value in data.items()}
        return _oracle_leaves(op, moved, config, noise=rng)[index]

    for path, result in results.items():
        got = jax.tree.leaves(result)
        wanted = list(range(len(want)))
        if op == "pre_forward" and path == "plain":  # the plain pre returns no h_pre
            wanted.remove(1)
        assert len(got) == len(wanted), f"{op} {path}: {len(got)} outputs, the oracle's {len(wanted)}"
        for value, index in zip(got, wanted, strict=True):
            name = f"{op} {path} output {index}"
            assert np.shape(value) == np.shape(want[index]), f"{name}: shape {np.shape(value)}, {np.shape(want[index])}"
            resample = functools.partial(perturbed, index)
            conftest.assert_matches(name, value, want[index], 1e-5, resample, f"seed {seed}")


def test_byte_and_flop_counts_follow_the_spec():
    s = bench.Shape(tokens=3, n=4, dim=8, dtype="bf16", mix="sinkhorn")
    phi = 4 * (4 * 8) * 24  # read by each pre operation; pre_backward also writes dphi
    assert bench.minimum_bytes("pre_forward", s) == (4 + 1) * 8 * 2 * 3 + phi
    assert bench.minimum_bytes("post_forward", s) == (2 * 4 + 1) * 8 * 2 * 3
    assert bench.minimum_bytes("pre_backward", s) == (3 * 4 + 1) * 8 * 2 * 3 + 2 * phi
    assert bench.minimum_bytes("sublayer_fwd_bwd", s) == (5 + 9 + 14 + 13) * 8 * 2 * 3 + 4 * phi
    # Boundary: (2n+2)De forward and (3n+3)De backward fused, against the two calls'.
    assert bench.minimum_bytes("boundary_fwd", s) == (2 * 4 + 2) * 8 * 2 * 3 + phi
    assert bench.minimum_bytes("boundary_fwd", s, separate=True) == (5 + 9) * 8 * 2 * 3 + phi
    assert bench.minimum_bytes("boundary_fwd_bwd", s) == (10 + 15) * 8 * 2 * 3 + 4 * phi
    assert bench.minimum_bytes("boundary_fwd_bwd", s, separate=True) == (5 + 9 + 14 + 13) * 8 * 2 * 3 + 4 * phi
    # Head: (n+1)De forward, + (2n+1)De backward; fn [n, nD] read, and in the backward read again
    # and dfn written.
    head_fn = 4 * 4 * (4 * 8)
    assert bench.minimum_bytes("head_fwd", s) == (4 + 1) * 8 * 2 * 3 + head_fn
    assert bench.minimum_bytes("head_fwd_bwd", s) == (5 + 9) * 8 * 2 * 3 + 3 * head_fn
    # DeepSeek-V4.1: the pre and the boundary move V4's bytes; the pre differentiated alone has no
    # dx_partial to read ((2n+1)De backward); the collapse (n+1)De forward, (2n+1)De backward.
    assert bench.minimum_bytes("v41_pre_fwd", s) == bench.minimum_bytes("pre_forward", s)
    assert bench.minimum_bytes("v41_pre_fwd_bwd", s) == (5 + 9) * 8 * 2 * 3 + 3 * phi
    assert bench.minimum_bytes("v41_boundary_fwd", s) == bench.minimum_bytes("boundary_fwd", s)
    assert bench.minimum_bytes("v41_boundary_fwd_bwd", s, separate=True) == (5 + 9 + 14 + 13) * 8 * 2 * 3 + 4 * phi
    assert bench.minimum_bytes("v41_boundary_fwd_bwd", s) == (10 + 15) * 8 * 2 * 3 + 4 * phi
    assert bench.minimum_bytes("collapse_fwd", s) == (4 + 1) * 8 * 2 * 3
    assert bench.minimum_bytes("collapse_fwd_bwd", s) == (5 + 9) * 8 * 2 * 3
    assert bench.projection_width(4, "sinkhorn") == 24 and bench.projection_width(4, "permutations") == 32
    assert bench.flop_count("pre_forward", s) == (2 * 4 * 8 * 24 + 2 * 4 * 8) * 3


@pytest.mark.slow  # main() end to end: over 10 s of CPU (pyproject.toml, markers)
def test_main_prints_the_table_and_writes_json(tmp_path, capsys, tune_calls):
    # Three kinds of row (an operation, a boundary with its two-call time, the head): the table and
    # JSON plumbing; test_kernel_and_plain_functions_agree compiles every operation.
    ops = ["pre_forward", "boundary_fwd", "head_fwd_bwd"]
    path = tmp_path / "bench.json"
    argv = ["--table", "roofline", "--tokens", "4", "--dims", "8", "--dtypes", "bf16", "--repeats", "1"]
    argv += ["--ops", *ops, "--json", str(path)]
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    for op in ops:
        assert op in table
    assert "Peak memory" in table and "kernel" in table and "plain" in table
    # --allocator both (the default): every case again after one tune_allocator() call.
    assert len(tune_calls) == 1 and "tuned k ms" in table
    assert result_allocator(path) == "both"
    result = json.loads(path.read_text())
    assert result["machine"]["copy_gbs"] > 0 and result["machine"]["fma_peak_gflops"] > 0
    timed = [r for r in result["rows"] if r["op"] in bench.OPS]
    assert [r["op"] for r in timed] == ops
    for row in timed:
        assert row["kernel_ms"] > 0 and row["plain_ms"] > 0 and row["roofline_fraction"] > 0
        assert ("separate_ms" in row) == (row["op"] in bench.BOUNDARY_OPS), row
        if "separate_ms" in row:  # timed in turns: the ratio is the median per-round one
            assert row["fused_interleaved_ms"] > 0 and row["fused_speedup"] > 0
        assert row["kernel_tuned_ms"] > 0 and row["plain_tuned_ms"] > 0
    assert "two kernel calls" in table
    memory = [r for r in result["rows"] if r["op"] == "memory_fwd_bwd"]
    assert {(r["path"], r["allocator"]) for r in memory} == {
        (path, allocator) for path in ("kernel", "plain") for allocator in ("default", "tuned")
    }
    assert all("peak_added_bytes" in r for r in memory), memory


def result_allocator(path):
    return json.loads(path.read_text())["machine"]["allocator"]


@pytest.mark.slow  # main() end to end: over 10 s of CPU (pyproject.toml, markers)
def test_decode_table_reports_microseconds_against_the_floor(tmp_path, capsys, tune_calls):
    path = tmp_path / "bench.json"
    # An operation, V4.1's boundary (timed in turns with V4's) and the collapse;
    # test_kernel_and_plain_functions_agree compiles every operation.
    ops = ["pre_backward", "v41_boundary_fwd", "collapse_fwd"]
    argv = ["--table", "decode", "--decode-tokens", "2", "--decode-dims", "8", "--dtypes", "f32"]
    argv += ["--allocator", "default", "--ops", *ops, "head_fwd"]  # head_fwd: not a decode op
    assert bench.main(argv + ["--json", str(path)]) == 0
    table = capsys.readouterr().out
    assert "Decode" in table and "kernel us" in table and "floor us" in table
    assert re.search(r"in turns.*\n.*\nT=2 n=4 D=8 f32 +v41_boundary_fwd +boundary_fwd ", table)  # V4.1 vs V4
    rows = json.loads(path.read_text())["decode"]["rows"]
    assert [(r["tokens"], r["op"]) for r in rows] == [(2, op) for op in ops]
    assert set(ops) <= set(bench.DECODE_OPS) and "head_fwd" not in bench.DECODE_OPS
    (v41,) = [r for r in rows if "v41_over_v4" in r]
    assert v41["op"] == "v41_boundary_fwd" and v41["v4_op"] == "boundary_fwd" and v41["v41_over_v4"] > 0
    assert all(r["kernel_ms"] > 0 and r["minimum_bytes"] > 0 for r in rows)
    # One setting only: the allocator left alone, no tuned columns.
    assert not tune_calls and "tuned" not in table and all("kernel_tuned_ms" not in r for r in rows)


@pytest.mark.parametrize(
    "argv",
    [
        ["--tokens", "0"],
        ["--repeats", "0"],
        ["--dtypes", "f16"],
        ["--decode-dims", "0"],
        ["--table", "x"],
        ["--torch-tokens", "0"],
    ]
    + [["--allocator", "glibc"], ["--touch-memory", "-1"], ["--torch-decode-repeats", "0"]],
)
def test_bad_flags_are_rejected(argv):
    with pytest.raises(SystemExit):
        bench.main(argv)


def test_touch_memory_writes_and_frees():
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert bench.touch_memory(0.25) > 0
    # Every page written: at least 0.25 GiB of 4 KiB pages faulted in (fewer with huge pages).
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before >= (1 << 28) // (2 << 20)


def _torch_outputs(results):
    """A path's outputs as a flat list of f64 tensors (transformers' fn gradient is phi's
    transposed: put back into phi's layout)."""
    return [value.detach().double() for value in results]


@pytest.mark.parametrize("op", bench.TORCH_OPS)
def test_torch_table_paths_compute_the_same(op):
    """The torch table compares like with like: transformers' module, the plain and the compiled
    path give the kernel's outputs and gradients (f32, to rounding) on the bench's own inputs."""
    torch = pytest.importorskip("torch")
    from mhc import _bench_torch

    case, missing = _bench_torch.make_case(bench.Shape(tokens=5, n=4, dim=16, dtype="f32", mix="sinkhorn"))
    assert missing is None, missing
    functions = _bench_torch.functions(case, op, bench.TORCH_PATHS, compile_backend="eager")
    results = {path: list(function()) for path, function in functions.items()}
    if op.endswith("_bwd"):  # transformers' fn is phi transposed: its gradient too
        results["hf"][1] = results["hf"][1].t()
    want = results["kernel"]
    assert len(want) == (1 if op == "sublayer_fwd" else 3 if op == "pre_fwd" else 4), len(want)
    for path in ("hf", "plain", "compiled"):
        assert len(results[path]) == len(want), path
        for index, (got, expected) in enumerate(zip(results[path], want, strict=True)):
            assert got.shape == expected.shape, (path, index, got.shape, expected.shape)
            torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-5, msg=f"{op} {path} output {index}")


def test_torch_table_prints_and_writes_json(tmp_path, capsys):
    """--table torch end to end on tiny shapes: every path's column, the forward+backward rows only
    at T >= TORCH_BACKWARD_MIN_TOKENS, the decode overhead at T = 1, the JSON rows."""
    pytest.importorskip("torch")
    path = tmp_path / "bench.json"
    argv = ["--table", "torch", "--torch-tokens", "1", "64", "--torch-dims", "8", "--dtypes", "f32"]
    argv += ["--torch-ops", "pre_fwd", "sublayer_fwd_bwd", "--repeats", "1", "--torch-decode-repeats", "2"]
    argv += ["--torch-compile-backend", "eager", "--json", str(path)]
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    for column in ("kernel ms", "hf ms", "plain ms", "compiled ms", "hf/k", "roofline", "Per-call overhead"):
        assert column in table, column
    result = json.loads(path.read_text())["torch"]
    assert [(r["tokens"], r["op"]) for r in result["rows"]] == [
        (1, "pre_fwd"),
        (64, "pre_fwd"),
        (64, "sublayer_fwd_bwd"),
    ]
    for row in result["rows"]:
        assert row["repeats"] == (1 if row["tokens"] >= bench.TORCH_BACKWARD_MIN_TOKENS else 2), row
        for name in ("kernel_ms", "hf_ms", "plain_ms", "compiled_ms", "hf_over_kernel", "compile_s"):
            assert row[name] > 0, (name, row)
        assert row["minimum_bytes"] > 0 and row["roofline_fraction"] > 0, row
    (overhead,) = result["overhead"]
    assert overhead["tokens"] == 1 and all(overhead[f"{k}_us"] > 0 for k in ("run", "op", "pre", "pre_autograd", "hf"))
    assert result["machine"]["torch_threads"] >= 1 and result["machine"]["compile_backend"] == "eager"


def test_bench_imports_without_torch():
    """torch is imported by the torch table alone: mhc.bench imports (and its other tables run)
    where torch is not installed."""
    import subprocess
    import sys

    code = "import sys, mhc.bench; assert 'torch' not in sys.modules, 'mhc.bench imported torch'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr

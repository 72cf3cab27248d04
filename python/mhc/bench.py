"""python -m mhc.bench: the fused kernels against the jitted plain-JAX path, on the roofline.

For each shape and each operation (the four C++ operations, a whole sublayer pre -> identity
branch -> post, the fused boundary post -> pre between two sublayers, V4's head, and
DeepSeek-V4.1's pre with the carried mix, its boundary and its final collapse, each forward and
forward+backward) it measures the median time of the kernel path and of the jitted
``use_kernel=False`` path side by side (the boundary also against the two separate kernel calls,
timed in turns with the fused call: ``separate_ms``, ``fused_interleaved_ms`` and the median
per-round ratio ``fused_speedup``), and reports their ratio, the achieved GB/s
(the spec's minimum bytes) and GFLOP/s, and the fraction of the roofline floor
max(bytes / copy bandwidth, FLOPs / FMA peak), with both ceilings measured in the same run.
Peak memory of the sublayer's forward+backward is measured per path in a fresh subprocess.

The allocator (``--allocator``): by default every case runs first with glibc's default malloc
settings, then again after ``mhc.tune_allocator()`` (which cannot be undone within a process, hence
this order), and the table shows both kernel and plain times side by side; ``default`` or
``tuned`` measures one setting only.

    python -m mhc.bench                          # the decode table, then the roofline table
    python -m mhc.bench --table roofline         # T in {2048, 8192}, n = 4, D in {1024, 4096}, f32 and bf16
    python -m mhc.bench --table decode           # T in {1, 8, 64}, D in {4096, 7168}: latency in us
    python -m mhc.bench --table torch            # mhc.torch against transformers' module, plain torch
                                                 # and torch.compile; T in {1, 8, 8192}, D = 4096
    python -m mhc.bench --ops v41_pre_fwd v41_pre_fwd_bwd boundary_fwd boundary_fwd_bwd \
        v41_boundary_fwd v41_boundary_fwd_bwd collapse_fwd collapse_fwd_bwd   # V4.1 against V4
    python -m mhc.bench --tokens 1 --dims 64     # the small-shape case
    python -m mhc.bench --batch-axis             # the sublayer with x [1, T, n, D] instead of [T, n, D]
    python -m mhc.bench --allocator tuned        # only after mhc.tune_allocator() (default: both)
    python -m mhc.bench --json results.json
    python -m mhc.bench --touch-memory 16        # first on a freshly booted VM (see touch_memory)
    python -m mhc.bench --tpu-estimate [ARGS]    # the TPU kernels' static time estimate (no TPU needed)

``--tpu-estimate`` measures nothing on this host: it runs the source tree's
``python -m mhc.tpu.compile_report --estimate`` (the remaining arguments are that module's, e.g. ``--chips v6e
--mix permutations``), which compiles each mhc.tpu kernel for v5e and v6e and prices its compiled
schedule against the HBM floor (docs/tpu.md, "Speed by the compiled schedule").

``--table torch`` (mhc._bench_torch, the only code here that imports torch; it needs no jax):
mhc.torch's kernel path against Hugging Face transformers' eager ``DeepseekV4HyperConnection`` and
against the same math in plain torch, eager and ``torch.compile``d, the paths timed in turns, with
the kernel's roofline fraction, and the per-call overhead of the pre at decode in microseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

OPS = (
    "pre_forward",
    "post_forward",
    "post_backward",
    "pre_backward",
    "sublayer_fwd",
    "sublayer_fwd_bwd",
    "boundary_fwd",
    "boundary_fwd_bwd",
    "head_fwd",
    "head_fwd_bwd",
    # DeepSeek-V4.1 (spec: Single-pass schedule): the pre reading a carried mix (and returning its
    # own h_pre), the boundary whose next pre reads this sublayer's h_pre, and the model's end,
    # the collapse by the last h_pre (mhc.jax.pre(carried=...), boundary, collapse).
    "v41_pre_fwd",
    "v41_pre_fwd_bwd",
    "v41_boundary_fwd",
    "v41_boundary_fwd_bwd",
    "collapse_fwd",
    "collapse_fwd_bwd",
)
V41_OPS = OPS[OPS.index("v41_pre_fwd") :]
# The fused boundary (post of one sublayer, pre of the next): timed also as the two separate
# kernel calls, reported as separate_ms.
BOUNDARY_OPS = ("boundary_fwd", "boundary_fwd_bwd", "v41_boundary_fwd", "v41_boundary_fwd_bwd")
# The V4.1 rows and the V4 rows they are set against at the same shape.
V41_VERSUS_V4 = {
    "v41_boundary_fwd": "boundary_fwd",
    "v41_boundary_fwd_bwd": "boundary_fwd_bwd",
    "v41_pre_fwd": "pre_forward",
}
# The decode table: the four operations, and a boundary (V4's and V4.1's) and V4.1's pre and
# collapse, forward only (inference).
DECODE_OPS = (*OPS[:4], "boundary_fwd", "v41_pre_fwd", "v41_boundary_fwd", "collapse_fwd")
DECODE_TOKENS = (1, 8, 64)
DECODE_DIMS = (4096, 7168)
ALLOCATORS = ("both", "default", "tuned")
# The torch table (mhc._bench_torch): the pre alone (transformers' DeepseekV4HyperConnection) and
# a sublayer, forward and forward+backward; the paths; forward+backward rows only at training token
# counts (decode is inference).
TORCH_OPS = ("pre_fwd", "pre_fwd_bwd", "sublayer_fwd", "sublayer_fwd_bwd")
TORCH_PATHS = ("kernel", "hf", "plain", "compiled")
TORCH_TOKENS = (1, 8, 8192)
TORCH_DIMS = (4096,)
TORCH_BACKWARD_MIN_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class Shape:
    tokens: int
    n: int
    dim: int
    dtype: str
    mix: str
    batch_axis: bool = False  # the sublayer ops take x [1, T, n, D]

    @property
    def label(self) -> str:
        return f"{'1x' if self.batch_axis else ''}T={self.tokens} n={self.n} D={self.dim} {self.dtype}"


def projection_width(n: int, mix: str) -> int:
    import math

    return 2 * n + (n * n if mix == "sinkhorn" else math.factorial(n))


def minimum_bytes(op: str, s: Shape, separate: bool = False) -> float:
    """The spec's minimum memory traffic (sections "Minimum memory traffic" and "Boundary") for T
    tokens, plus the parameters the spec leaves out because they vanish at large T but dominate at
    decode sizes: each pre operation reads phi [nD, N] (f32) once, and pre_backward also writes
    dphi. ``separate``: the boundary as two calls (post, then pre; pre_backward, post_backward)."""
    e = 2 if s.dtype == "bf16" else 4
    phi = 4.0 * s.n * s.dim * projection_width(s.n, s.mix)
    parameters = {"pre_forward": phi, "post_forward": 0.0, "post_backward": 0.0, "pre_backward": 2 * phi}
    parameters["sublayer_fwd"] = parameters["pre_forward"]
    parameters["sublayer_fwd_bwd"] = 2 * parameters["pre_forward"] + parameters["pre_backward"]
    parameters["boundary_fwd"] = parameters["sublayer_fwd"]
    parameters["boundary_fwd_bwd"] = parameters["sublayer_fwd_bwd"]
    # The head (spec: Head): fn [n, nD] read once forward, read once and dfn written backward.
    head_fn = 4.0 * s.n * s.n * s.dim
    parameters["head_fwd"], parameters["head_fwd_bwd"] = head_fn, 3 * head_fn
    # V4.1: the pre's, and the boundary's, parameters as V4's; the collapse has none.
    parameters["v41_pre_fwd"] = parameters["pre_forward"]
    parameters["v41_pre_fwd_bwd"] = parameters["pre_forward"] + parameters["pre_backward"]
    parameters["v41_boundary_fwd"] = parameters["boundary_fwd"]
    parameters["v41_boundary_fwd_bwd"] = parameters["boundary_fwd_bwd"]
    parameters["collapse_fwd"] = parameters["collapse_fwd_bwd"] = 0.0
    per_token = {
        "pre_forward": (s.n + 1),
        "post_forward": (2 * s.n + 1),
        "post_backward": (3 * s.n + 2),
        "pre_backward": (3 * s.n + 1),
    }
    per_token["sublayer_fwd"] = per_token["pre_forward"] + per_token["post_forward"]
    per_token["sublayer_fwd_bwd"] = sum(per_token[k] for k in OPS[:4])
    if separate:
        per_token["boundary_fwd"] = per_token["sublayer_fwd"]
        per_token["boundary_fwd_bwd"] = per_token["sublayer_fwd_bwd"]
    else:  # x_next written once, never read back; the backward recomputes it, never stores dx_next
        per_token["boundary_fwd"] = 2 * s.n + 2
        per_token["boundary_fwd_bwd"] = (2 * s.n + 2) + (3 * s.n + 3)
    # Forward: read x, write out; backward: read x and dout, write dx (gates recomputed).
    per_token["head_fwd"] = s.n + 1
    per_token["head_fwd_bwd"] = (s.n + 1) + (2 * s.n + 1)
    # V4.1 moves the same activations as V4 (the carried mix, 4n bytes a token, is one of the small
    # coefficient tensors the spec leaves out). The pre alone, differentiated: its backward reads
    # x and dlayer_in and writes dx, (2n+1)De; the dx_partial of the spec's pre backward is the
    # post's, which a pre on its own does not have.
    per_token["v41_pre_fwd"] = per_token["pre_forward"]
    per_token["v41_pre_fwd_bwd"] = per_token["pre_forward"] + (2 * s.n + 1)
    per_token["v41_boundary_fwd"] = per_token["boundary_fwd"]
    per_token["v41_boundary_fwd_bwd"] = per_token["boundary_fwd_bwd"]
    # The collapse: read x, write h; backward: read dh and x, write dx.
    per_token["collapse_fwd"] = s.n + 1
    per_token["collapse_fwd_bwd"] = (s.n + 1) + (2 * s.n + 1)
    return float(per_token[op] * s.dim * e * s.tokens) + parameters[op]


def flop_count(op: str, s: Shape) -> float:
    """FLOPs from the spec's formulas; the projection (2 n D N per token, once forward and three
    times backward: recompute, weight gradient, input gradient) dominates."""
    n, d, big_n = s.n, s.dim, projection_width(s.n, s.mix)
    projection = 2 * n * d * big_n
    per_token = {
        "pre_forward": projection + 2 * n * d,  # + the pre-apply
        "post_forward": 2 * n * (n + 1) * d,  # H_res^T x + H_post layer_out
        "post_backward": 4 * n * d + 4 * n * n * d,  # dlayer_out, dh_post, dx_partial, dh_res
        "pre_backward": 3 * projection + 8 * n * d,  # + dh_pre, pre-apply grad, RMS term, sum of squares
    }
    per_token["sublayer_fwd"] = per_token["pre_forward"] + per_token["post_forward"]
    per_token["sublayer_fwd_bwd"] = sum(per_token[k] for k in OPS[:4])
    # The boundary's backward recomputes x_next: one more post forward.
    per_token["boundary_fwd"] = per_token["sublayer_fwd"]
    per_token["boundary_fwd_bwd"] = per_token["sublayer_fwd_bwd"] + per_token["post_forward"]
    # The head: the projection with N = n columns, its gates and the collapse; the backward
    # recomputes the projection and takes its two gradients.
    head_projection = 2 * n * d * n
    per_token["head_fwd"] = head_projection + 2 * n * d
    per_token["head_fwd_bwd"] = 4 * head_projection + 8 * n * d
    # V4.1: as V4's pre and boundary.
    per_token["v41_pre_fwd"] = per_token["pre_forward"]
    per_token["v41_pre_fwd_bwd"] = per_token["pre_forward"] + per_token["pre_backward"]
    per_token["v41_boundary_fwd"] = per_token["boundary_fwd"]
    per_token["v41_boundary_fwd_bwd"] = per_token["boundary_fwd_bwd"]
    # The collapse: the mix forward; dx and dcarried backward.
    per_token["collapse_fwd"] = 2 * n * d
    per_token["collapse_fwd_bwd"] = 6 * n * d
    return float(per_token[op] * s.tokens)


def _inputs(s: Shape, seed: int = 0):
    import jax
    import jax.numpy as jnp

    import mhc.jax as mj

    config = mj.Config(n=s.n, mix=s.mix)
    dtype = jnp.bfloat16 if s.dtype == "bf16" else jnp.float32
    keys = jax.random.split(jax.random.key(seed), 11)
    t, n, d = s.tokens, s.n, s.dim
    params = mj.init_params(keys[0], config, d)
    params = params._replace(alpha=jnp.array([0.8, -0.6, 1.1], jnp.float32))
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)  # noqa: E731
    h_post = jax.random.uniform(keys[5], (t, n), jnp.float32)
    h_res = jax.nn.softmax(jax.random.normal(keys[6], (t, n, n)), axis=-1)
    x, g = normal(keys[1], (t, n, d)), normal(keys[3], (t, n, d))
    lead = (1,) if s.batch_axis else ()
    return (
        config,
        params,
        dict(
            x=x,
            x_sublayer=x.reshape(*lead, t, n, d),
            layer_out=normal(keys[2], (t, d)),
            g=g,
            g_sublayer=g.reshape(*lead, t, n, d),
            dlayer_in=normal(keys[4], (t, d)),
            h_post=h_post,
            h_res=h_res,
            head_params=mj.init_head_params(keys[0], config, d)._replace(scale=jnp.array([0.9], jnp.float32)),
            dh_post=jax.random.normal(keys[7], (t, n)),
            dh_res=jax.random.normal(keys[8], (t, n, n)),
            # V4.1: a carried mix (a previous sublayer's pre gates, sigmoid + eps in (0, 1)) and the
            # cotangent of this sublayer's own h_pre.
            carried=jax.nn.sigmoid(jax.random.normal(keys[9], (t, n))),
            dh_pre=jax.random.normal(keys[10], (t, n)),
        ),
    )


def _functions(op: str, use_kernel: bool, config, fused: bool = True):
    """(jitted function, names of its inputs) for one operation on one path; ``fused=False``: the
    boundary as two separate calls."""
    import jax

    import mhc.jax as mj
    from mhc.jax import _kernels, reference
    from mhc.jax._types import Context

    if op in V41_OPS:
        return _v41_functions(op, use_kernel, config, fused)

    def sublayer(x, params):
        layer_in, ctx = mj.pre(x, params, config, use_kernel=use_kernel)
        return mj.post(layer_in, ctx)

    def plain_pre(x, params):
        layer_in, ctx = reference.pre(x, params, config)
        return layer_in, ctx.h_post, ctx.h_res

    def plain_post(x, layer_out, h_post, h_res):
        return reference.post(layer_out, Context(x, h_post, h_res, config, False))

    def boundary(x, layer_out, h_post, h_res, params):
        ctx = Context(x, h_post, h_res, config, use_kernel)
        if fused:
            layer_in, next_ctx = mj.boundary(layer_out, ctx, params, config, use_kernel=use_kernel)
        else:
            layer_in, next_ctx = mj.pre(mj.post(layer_out, ctx), params, config, use_kernel=use_kernel)
        return layer_in, next_ctx.x, next_ctx.h_post, next_ctx.h_res

    def head(x, head_params):
        return mj.head(x, head_params, config, use_kernel=use_kernel)

    if op == "head_fwd":
        return jax.jit(head), ("x", "head_params")
    if op == "head_fwd_bwd":
        return jax.jit(lambda x, hp, dout: jax.vjp(head, x, hp)[1](dout)), ("x", "head_params", "dlayer_in")

    boundary_inputs = ("x", "layer_out", "h_post", "h_res", "params")
    if op == "boundary_fwd":
        return jax.jit(boundary), boundary_inputs
    if op == "boundary_fwd_bwd":
        return (
            jax.jit(lambda *a: jax.vjp(boundary, *a[:5])[1](a[5:])),
            (*boundary_inputs, "dlayer_in", "g", "dh_post", "dh_res"),
        )
    if op == "sublayer_fwd":
        return jax.jit(sublayer), ("x_sublayer", "params")
    if op == "sublayer_fwd_bwd":
        return jax.jit(lambda x, params, g: jax.vjp(sublayer, x, params)[1](g)), ("x_sublayer", "params", "g_sublayer")
    if use_kernel:
        table = {
            "pre_forward": (lambda x, params: _kernels.pre_forward(config, x, params), ("x", "params")),
            "post_forward": (
                lambda x, lo, hp, hr: _kernels.post_forward(config, x, lo, hp, hr),
                ("x", "layer_out", "h_post", "h_res"),
            ),
            "post_backward": (
                lambda g, x, lo, hp, hr: _kernels.post_backward(config, g, x, lo, hp, hr),
                ("g", "x", "layer_out", "h_post", "h_res"),
            ),
            "pre_backward": (
                lambda dli, dxp, dhp, dhr, x, params: _kernels.pre_backward(config, dli, dxp, dhp, dhr, x, params),
                ("dlayer_in", "g", "dh_post", "dh_res", "x", "params"),
            ),
        }
    else:

        def post_backward(g, x, lo, hp, hr):
            return jax.vjp(plain_post, x, lo, hp, hr)[1](g)

        def pre_backward(dli, dxp, dhp, dhr, x, params):
            dx, dparams = jax.vjp(plain_pre, x, params)[1]((dli, dhp, dhr))
            return dx + dxp, dparams

        table = {
            "pre_forward": (plain_pre, ("x", "params")),
            "post_forward": (plain_post, ("x", "layer_out", "h_post", "h_res")),
            "post_backward": (post_backward, ("g", "x", "layer_out", "h_post", "h_res")),
            "pre_backward": (pre_backward, ("dlayer_in", "g", "dh_post", "dh_res", "x", "params")),
        }
    function, names = table[op]
    return jax.jit(function), names


def _v41_functions(op: str, use_kernel: bool, config, fused: bool):
    """``_functions`` for DeepSeek-V4.1's operations (V41_OPS), with ``config``'s schedule switched
    to V4.1's (``pre_from_previous``)."""
    import jax

    import mhc.jax as mj
    from mhc.jax._types import Context

    v41 = dataclasses.replace(config, pre_from_previous=True)

    def v41_pre(x, params, carried):
        layer_in, ctx = mj.pre(x, params, v41, carried=carried, use_kernel=use_kernel)
        return layer_in, ctx.h_pre, ctx.h_post, ctx.h_res

    def v41_boundary(x, layer_out, h_pre, h_post, h_res, params):
        ctx = Context(x, h_post, h_res, v41, use_kernel, h_pre=h_pre)
        if fused:
            layer_in, next_ctx = mj.boundary(layer_out, ctx, params, v41, use_kernel=use_kernel)
        else:
            layer_in, next_ctx = mj.pre(mj.post(layer_out, ctx), params, v41, carried=h_pre, use_kernel=use_kernel)
        return layer_in, next_ctx.x, next_ctx.h_pre, next_ctx.h_post, next_ctx.h_res

    def collapse(x, carried):
        return mj.collapse(mj.Streams(x, carried), use_kernel=use_kernel)

    v41_table = {
        "v41_pre_fwd": (v41_pre, ("x", "params", "carried")),
        "v41_pre_fwd_bwd": (
            lambda x, params, carried, *cotangents: jax.vjp(v41_pre, x, params, carried)[1](cotangents),
            ("x", "params", "carried", "dlayer_in", "dh_pre", "dh_post", "dh_res"),
        ),
        "v41_boundary_fwd": (v41_boundary, ("x", "layer_out", "carried", "h_post", "h_res", "params")),
        "v41_boundary_fwd_bwd": (
            lambda *a: jax.vjp(v41_boundary, *a[:6])[1](a[6:]),
            ("x", "layer_out", "carried", "h_post", "h_res", "params", "dlayer_in", "g", "dh_pre", "dh_post", "dh_res"),
        ),
        "collapse_fwd": (collapse, ("x", "carried")),
        "collapse_fwd_bwd": (
            lambda x, carried, dout: jax.vjp(collapse, x, carried)[1](dout),
            ("x", "carried", "dlayer_in"),
        ),
    }
    function, names = v41_table[op]
    return jax.jit(function), names


def _median_seconds(function, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(function(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_in_turns(functions: dict, repeats: int) -> dict:
    """Each function called once to warm up (its time kept: the compile, for a compiled path),
    then ``repeats`` rounds of one call each: name -> (median seconds, median per-round ratio to
    the first function's time, first-call seconds). Per-round ratios are what a shared machine's
    drift between two separately timed medians does not reach. Imports no framework: each
    function blocks until its result is ready (the torch table uses it too)."""
    first_call = {}
    for name, function in functions.items():
        start = time.perf_counter()
        function()
        first_call[name] = time.perf_counter() - start
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    reference = times[next(iter(functions))]
    return {
        name: (
            statistics.median(kept),
            statistics.median([t / r for t, r in zip(kept, reference, strict=True)]),
            first_call[name],
        )
        for name, kept in times.items()
    }


def _interleaved(first, first_args, second, second_args, repeats: int) -> tuple[float, float, float]:
    """Two jitted functions timed in turns (time_in_turns): the median time of each and the median
    per-round ratio first / second."""
    import jax

    timed = time_in_turns(
        {
            "second": lambda: jax.block_until_ready(second(*second_args)),
            "first": lambda: jax.block_until_ready(first(*first_args)),
        },
        repeats,
    )
    (first_s, first_over_second, _), (second_s, _, _) = timed["first"], timed["second"]
    return first_s, second_s, first_over_second


def _memory_probe(s: Shape, use_kernel: bool, tuned: bool) -> dict:
    """Peak resident memory added by one sublayer forward+backward (run in a fresh process, after
    ``mhc.tune_allocator()`` if ``tuned``)."""
    import jax

    import mhc

    if tuned:
        mhc.tune_allocator()
    config, params, data = _inputs(s)
    function, _ = _functions("sublayer_fwd_bwd", use_kernel, config)
    args = (data["x_sublayer"], params, data["g_sublayer"])
    compiled = function.lower(*args).compile()
    jax.block_until_ready(function(*args))

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    jax.block_until_ready(function(*args))
    analysis = compiled.memory_analysis()
    return {
        "peak_added_bytes": max(status("VmHWM") - before, 0),
        "xla_temp_bytes": int(getattr(analysis, "temp_size_in_bytes", 0)),
    }


def _measure_memory(s: Shape, use_kernel: bool, tuned: bool) -> dict:
    command = [sys.executable, "-m", "mhc.bench", "--_probe", json.dumps([dataclasses.asdict(s), use_kernel, tuned])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "probe failed"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def machine_info(threads: int) -> dict:
    import jax

    from mhc import _ffi

    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    device = jax.devices()[0]
    if device.platform == "gpu" and _ffi._mhc_cuda is not None:
        # The GPU roofline here is the copy bandwidth alone; no compute ceiling is measured.
        return {
            "cpu": device.device_kind,
            "threads": 0,
            "simd": "cuda",
            "copy_gbs": _ffi._mhc_cuda.copy_bandwidth_gbs(1 << 30, 10),
            "fma_peak_gflops": None,
            "date": date,
        }
    return cpu_machine_info(threads)


def cpu_machine_info(threads: int) -> dict:
    """The host CPU and its two ceilings (copy bandwidth, FMA peak), measured by the C++
    extension; imports no jax (the torch table uses it too)."""
    from mhc import _mhc_cpu

    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    simd = _mhc_cpu.widest_simd()
    if simd == "avx512" and os.environ.get("MHC_NO_AVX512", "").startswith("1"):
        # The switch reaches the projection kernels only; the loops compiled as target_clones pick
        # their AVX-512 clone from the CPU whatever the environment says.
        simd = "avx512 with the 8-lane projection kernels (MHC_NO_AVX512=1)"
    return {
        "cpu": model,
        "threads": threads,
        "simd": simd,
        "copy_gbs": _mhc_cpu.copy_bandwidth_gbs(256 << 20, threads),
        "fma_peak_gflops": _mhc_cpu.fma_peak_gflops(threads),
        "huge_pages": transparent_huge_pages(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def transparent_huge_pages() -> str:
    """Linux's transparent huge page mode: "always", "madvise" or "never" ("unavailable" where the
    kernel has none, as on macOS). mhc asks for huge pages on its large CPU outputs and scratch
    (madvise), which takes effect under "always" or "madvise": with "never", each call's fresh
    outputs are first touched 4 KiB page by page, unless mhc.tune_allocator() keeps them."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            modes = f.read().split()
    except OSError:
        return "unavailable"
    return next((mode.strip("[]") for mode in modes if mode.startswith("[")), "unavailable")


def touch_memory(gib: float) -> float:
    """Writes ``gib`` GiB once, all held together, then frees it; returns the seconds it took.

    A freshly booted virtual machine backs its memory on first touch: on the project's VM the
    first write of 8 GiB took 24 s and the second 1.2 s, and a bench run right after boot
    charged that to whichever case first allocated new memory (post_forward f32 at T = 8192,
    D = 4096 read 634 ms instead of 63). Once touched, the pages stay backed for the process's
    later allocations and every other process's.
    """
    import numpy as np

    started = time.perf_counter()
    block_bytes = 1 << 28
    blocks = []
    for _ in range(round(gib * (1 << 30) / block_bytes)):
        block = np.empty(block_bytes, np.uint8)
        block.fill(1)
        blocks.append(block)
    del blocks
    return time.perf_counter() - started


def run(shapes, ops, repeats: int, memory: bool, progress: bool = True, allocator: str = "both") -> dict:
    """Every case under the allocator setting(s) ``allocator`` (ALLOCATORS): with "both", all of
    them with glibc's defaults first, then after mhc.tune_allocator(), the tuned times added to
    the same rows as ``kernel_tuned_ms`` and ``plain_tuned_ms``."""
    import mhc
    from mhc import _mhc_cpu

    machine = machine_info(_mhc_cpu.num_threads())
    machine["allocator"] = allocator
    if allocator == "tuned":
        mhc.tune_allocator()
    rows = _run_cases(shapes, ops, repeats, memory, progress, machine, tuned=allocator == "tuned")
    if allocator == "both":
        mhc.tune_allocator()
        tuned_rows = _run_cases(shapes, ops, repeats, memory, progress, machine, tuned=True)
        timed = [r for r in rows if r["op"] != "memory_fwd_bwd"]
        for row, tuned in zip(timed, [r for r in tuned_rows if r["op"] != "memory_fwd_bwd"], strict=True):
            row["kernel_tuned_ms"], row["plain_tuned_ms"] = tuned["kernel_ms"], tuned["plain_ms"]
        rows += [r for r in tuned_rows if r["op"] == "memory_fwd_bwd"]
    return {"machine": machine, "repeats": repeats, "rows": rows}


def _run_cases(shapes, ops, repeats: int, memory: bool, progress: bool, machine: dict, tuned: bool) -> list:
    rows = []
    work = [(s, op) for s in shapes for op in ops]
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(work), disable=not progress, unit="case", file=sys.stderr)
    except ImportError:  # tqdm is a dev requirement; the benchmark works without it
        bar = None
    for s in shapes:
        config, params, data = _inputs(s)
        data["params"] = params
        for op in ops:
            if bar is not None:
                bar.set_description(f"{s.label} {op}{' (tuned allocator)' if tuned else ''}")
            times = {}
            for use_kernel in (True, False):
                function, names = _functions(op, use_kernel, config)
                args = tuple(data[name] for name in names)
                times[use_kernel] = _median_seconds(function, args, repeats)
            extra = {}
            if op in BOUNDARY_OPS:  # the fused call against the two separate calls, timed in turns
                separate_fn, separate_names = _functions(op, True, config, fused=False)
                fused_fn, fused_names = _functions(op, True, config)
                separate, fused, ratio = _interleaved(
                    separate_fn,
                    tuple(data[name] for name in separate_names),
                    fused_fn,
                    tuple(data[name] for name in fused_names),
                    repeats,
                )
                extra = {
                    "separate_ms": separate * 1e3,
                    "fused_interleaved_ms": fused * 1e3,
                    "separate_bytes": minimum_bytes(op, s, separate=True),
                    "fused_speedup": ratio,
                }
            if op in V41_VERSUS_V4:  # V4.1's kernels against V4's counterpart, timed in turns
                v41, v41_names = _functions(op, True, config)
                v4, v4_names = _functions(V41_VERSUS_V4[op], True, config)
                v41_s, v4_s, ratio = _interleaved(
                    v41, tuple(data[n] for n in v41_names), v4, tuple(data[n] for n in v4_names), repeats
                )
                extra |= {
                    "v4_op": V41_VERSUS_V4[op],
                    "v41_interleaved_ms": v41_s * 1e3,
                    "v4_interleaved_ms": v4_s * 1e3,
                    "v41_over_v4": ratio,
                }
            nbytes, flops = minimum_bytes(op, s), flop_count(op, s)
            memory_floor = nbytes / (machine["copy_gbs"] * 1e9)
            peak = machine["fma_peak_gflops"]
            compute_floor = flops / (peak * 1e9) if peak is not None else 0.0
            floor = max(memory_floor, compute_floor)
            rows.append(
                {
                    **dataclasses.asdict(s),
                    "op": op,
                    "kernel_ms": times[True] * 1e3,
                    "plain_ms": times[False] * 1e3,
                    "speedup": times[False] / times[True],
                    "minimum_bytes": nbytes,
                    "kernel_gbs": nbytes / times[True] / 1e9,
                    "kernel_gflops": flops / times[True] / 1e9,
                    "roofline_floor_ms": floor * 1e3,
                    "bound": "memory" if memory_floor >= compute_floor else "compute",
                    "roofline_fraction": floor / times[True],
                    **extra,
                }
            )
            if bar is not None:
                bar.update()
        if memory:
            for use_kernel, path in ((True, "kernel"), (False, "plain")):
                rows.append(
                    {
                        **dataclasses.asdict(s),
                        "op": "memory_fwd_bwd",
                        "path": path,
                        "allocator": "tuned" if tuned else "default",
                        **_measure_memory(s, use_kernel, tuned),
                    }
                )
    if bar is not None:
        bar.close()
    return rows


def _allocator_note(result: dict) -> str:
    return {
        "both": "glibc's default allocator; 'tuned': the same after mhc.tune_allocator()",
        "default": "glibc's default allocator",
        "tuned": "after mhc.tune_allocator()",
    }[result["machine"].get("allocator", "default")]


def _tuned_columns(r: dict, scale: float, width: int) -> str:
    """The kernel and plain times after mhc.tune_allocator(), where measured (--allocator both)."""
    if "kernel_tuned_ms" not in r:
        return ""
    digits = 1 if scale > 1 else 3
    return f" {r['kernel_tuned_ms'] * scale:>{width}.{digits}f} {r['plain_tuned_ms'] * scale:>{width}.{digits}f}"


def format_decode_table(result: dict) -> str:
    """Latency in microseconds next to the time of reading the op's minimum bytes once."""
    both = result["machine"].get("allocator") == "both"
    tuned_header = f" {'tuned k us':>10} {'tuned p us':>10}" if both else ""
    lines = [
        "Decode (latency in us; floor = minimum bytes, phi included, at the copy bandwidth; "
        f"{_allocator_note(result)}):",
        f"{'shape':<26} {'op':<17} {'kernel us':>10} {'plain us':>10} {'speedup':>8} {'floor us':>9} {'of floor':>9}"
        + tuned_header,
    ]
    copy = result["machine"]["copy_gbs"]
    for r in result["rows"]:
        if r["op"] not in DECODE_OPS:
            continue
        shape = f"T={r['tokens']} n={r['n']} D={r['dim']} {r['dtype']}"
        floor_us = r["minimum_bytes"] / (copy * 1e9) * 1e6
        lines.append(
            f"{shape:<26} {r['op']:<17} {r['kernel_ms'] * 1e3:>10.1f} {r['plain_ms'] * 1e3:>10.1f} "
            f"{r['speedup']:>7.2f}x {floor_us:>9.1f} {floor_us / (r['kernel_ms'] * 1e3):>8.0%}"
            + _tuned_columns(r, 1e3, 10)
        )
    lines += _v41_versus_v4(result["rows"], 1e3, "us")
    return "\n".join(lines)


def _v41_versus_v4(rows: list, scale: float, unit: str) -> list[str]:
    """DeepSeek-V4.1's rows against V4's counterpart at the same shape (kernel path), the two
    timed in turns: the median of each and the median per-round ratio; the spec's bytes are the
    same for both."""
    pairs = [r for r in rows if "v41_over_v4" in r]
    if not pairs:
        return []
    digits = 1 if scale > 1 else 3
    lines = [
        "",
        f"DeepSeek-V4.1 against V4 at the same shape (kernel path, {unit}, the two timed in turns; "
        "V4.1/V4: the median per-round ratio; bytes: the spec's minimum, the same for both):",
        f"{'shape':<26} {'V4.1 op':<21} {'V4 op':<17} {'V4.1':>9} {'V4':>9} {'V4.1/V4':>8} {'MiB':>8}",
    ]
    for r in pairs:
        shape = f"T={r['tokens']} n={r['n']} D={r['dim']} {r['dtype']}"
        lines.append(
            f"{shape:<26} {r['op']:<21} {r['v4_op']:<17} "
            f"{r['v41_interleaved_ms'] * scale:>9.{digits}f} {r['v4_interleaved_ms'] * scale:>9.{digits}f} "
            f"{r['v41_over_v4']:>7.2f}x {r['minimum_bytes'] / 2**20:>8.2f}"
        )
    return lines


def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"{m['cpu']}, {m['threads']} threads, {m['simd']}: copy {m['copy_gbs']:.1f} GB/s, "
        + (
            f"FMA peak {m['fma_peak_gflops']:.1f} GFLOP/s"
            if m["fma_peak_gflops"] is not None
            else "compute ceiling not measured (GPU: floor = bytes / copy bandwidth)"
        )
        + f" ({m['date']}; medians of {result['repeats']}; {_allocator_note(result)}"
        + (f"; transparent huge pages: {m['huge_pages']}" if "huge_pages" in m else "")
        + ")",
        "",
        f"{'shape':<26} {'op':<20} {'kernel ms':>10} {'plain ms':>10} {'speedup':>8} {'GB/s':>7} "
        f"{'GFLOP/s':>8} {'floor ms':>9} {'bound':>8} {'roofline':>9}"
        + (f" {'tuned k ms':>10} {'tuned p ms':>10}" if m.get("allocator") == "both" else ""),
    ]
    shape_of = lambda r: f"{'1x' if r.get('batch_axis') else ''}T={r['tokens']} n={r['n']} D={r['dim']} {r['dtype']}"  # noqa: E731
    for r in result["rows"]:
        if r["op"] == "memory_fwd_bwd":
            continue
        lines.append(
            f"{shape_of(r):<26} {r['op']:<20} {r['kernel_ms']:>10.3f} {r['plain_ms']:>10.3f} {r['speedup']:>7.2f}x "
            f"{r['kernel_gbs']:>7.2f} {r['kernel_gflops']:>8.2f} {r['roofline_floor_ms']:>9.3f} {r['bound']:>8} "
            f"{r['roofline_fraction']:>8.0%}" + _tuned_columns(r, 1.0, 10)
        )
    boundary = [r for r in result["rows"] if "separate_ms" in r]
    if boundary:
        lines += ["", "The fused boundary against post + pre as two kernel calls (bytes: the spec's Boundary section):"]
        lines.append(f"{'shape':<26} {'op':<20} {'fused ms':>10} {'2 calls ms':>10} {'speedup':>8} {'bytes':>15}")
        for r in boundary:
            nbytes = f"{r['minimum_bytes'] / 2**20:.0f} / {r['separate_bytes'] / 2**20:.0f} MiB"
            lines.append(
                f"{shape_of(r):<26} {r['op']:<20} {r['fused_interleaved_ms']:>10.3f} {r['separate_ms']:>10.3f} "
                f"{r['fused_speedup']:>7.2f}x {nbytes:>15}"
            )
    lines += _v41_versus_v4(result["rows"], 1.0, "ms")
    memory = [r for r in result["rows"] if r["op"] == "memory_fwd_bwd"]
    if memory:
        lines += ["", "Peak memory added by one sublayer forward+backward (fresh process; XLA temp buffers):"]
        for r in memory:
            if "error" in r:
                lines.append(f"{shape_of(r):<26} {r['path']:<7} {r['allocator']:<8} error: {r['error']}")
            else:
                lines.append(
                    f"{shape_of(r):<26} {r['path']:<7} {r['allocator']:<8} {r['peak_added_bytes'] / 2**20:>9.1f} MiB"
                    f"   (XLA temp {r['xla_temp_bytes'] / 2**20:.1f} MiB)"
                )
    return "\n".join(lines)


def _tpu_estimate(arguments: list[str]) -> int:
    """--tpu-estimate: mhc.tpu.compile_report --estimate, in a fresh process (libtpu reads its dump
    flags once, when it loads)."""
    command = [sys.executable, "-m", "mhc.tpu.compile_report", "--estimate", *arguments]
    return subprocess.run(command, check=False).returncode


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--tpu-estimate"]:
        return _tpu_estimate(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m mhc.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--table",
        default="both",
        choices=["decode", "roofline", "both", "torch"],
        help="decode: T in {1, 8, 64}, D in {4096, 7168}, the four operations, the boundaries, V4.1's pre and "
        "collapse (forward); roofline: --tokens x --dims; both: decode then roofline; torch: mhc.torch against "
        "transformers' module and plain torch, eager and compiled (--torch-tokens x --torch-dims)",
    )
    parser.add_argument(
        "--decode-tokens", type=int, nargs="+", default=list(DECODE_TOKENS), help="T of the decode table"
    )
    parser.add_argument("--decode-dims", type=int, nargs="+", default=list(DECODE_DIMS), help="D of the decode table")
    parser.add_argument("--torch-tokens", type=int, nargs="+", default=list(TORCH_TOKENS), help="T of the torch table")
    parser.add_argument("--torch-dims", type=int, nargs="+", default=list(TORCH_DIMS), help="D of the torch table")
    parser.add_argument(
        "--torch-ops",
        nargs="+",
        default=list(TORCH_OPS),
        choices=TORCH_OPS,
        help=f"the torch table's ops (the _fwd_bwd ones at T >= {TORCH_BACKWARD_MIN_TOKENS} only)",
    )
    parser.add_argument(
        "--torch-paths",
        nargs="+",
        default=list(TORCH_PATHS),
        choices=TORCH_PATHS,
        help="the torch table's paths (kernel is always timed, first)",
    )
    parser.add_argument(
        "--torch-decode-repeats",
        type=int,
        default=50,
        help=f"the torch table's rounds at T < {TORCH_BACKWARD_MIN_TOKENS} (at least --repeats; short calls, noisy "
        "medians), and a quarter of the decode overhead's calls",
    )
    parser.add_argument(
        "--torch-compile-backend", default="inductor", help="torch.compile's backend for the compiled path"
    )
    parser.add_argument("--batch-axis", action="store_true", help="the sublayer ops take x [1, T, n, D]")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="T values")
    parser.add_argument("--streams", type=int, default=4, help="n")
    parser.add_argument("--dims", type=int, nargs="+", default=[1024, 4096], help="D values")
    parser.add_argument("--dtypes", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16"])
    parser.add_argument("--mix", default="sinkhorn", choices=["sinkhorn", "permutations"])
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per median")
    parser.add_argument("--threads", type=int, default=0, help="mhc threads (default: MHC_NUM_THREADS or all)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument(
        "--allocator",
        default="both",
        choices=ALLOCATORS,
        help="both: every case with glibc's default malloc settings, then after mhc.tune_allocator(); "
        "default or tuned: that setting only",
    )
    parser.add_argument(
        "--touch-memory",
        type=float,
        default=0.0,
        metavar="GIB",
        help="first write and free this many GiB (a freshly booted VM pays for first touches; see touch_memory)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--_probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._probe:
        shape, use_kernel, tuned = json.loads(args._probe)
        print(json.dumps(_memory_probe(Shape(**shape), use_kernel, tuned)))
        return 0
    for name in ("tokens", "dims", "decode_tokens", "decode_dims", "torch_tokens", "torch_dims"):
        if any(v < 1 for v in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')}: expected positive values, got {getattr(args, name)}")
    if args.torch_decode_repeats < 1:
        parser.error(f"--torch-decode-repeats: expected >= 1, got {args.torch_decode_repeats}")
    if args.repeats < 1:
        parser.error(f"--repeats: expected >= 1, got {args.repeats}")
    if not 0 <= args.touch_memory < 1024:
        parser.error(f"--touch-memory: expected GiB in [0, 1024), got {args.touch_memory}")
    if args.touch_memory:
        seconds = touch_memory(args.touch_memory)
        print(f"touched {args.touch_memory:g} GiB in {seconds:.1f} s", file=sys.stderr)

    from mhc import _mhc_cpu

    if args.threads:
        _mhc_cpu.set_num_threads(args.threads)
    output = {}
    if args.table in ("decode", "both"):
        shapes = [
            Shape(t, args.streams, d, dtype, args.mix)
            for dtype in args.dtypes
            for d in args.decode_dims
            for t in args.decode_tokens
        ]
        ops = [op for op in args.ops if op in DECODE_OPS]
        # More repeats: each call is short, and the median of few is noisy.
        output["decode"] = run(shapes, ops, max(args.repeats, 50), memory=False, allocator=args.allocator)
        print(format_decode_table(output["decode"]))
    if args.table in ("roofline", "both"):
        shapes = [
            Shape(t, args.streams, d, dtype, args.mix, args.batch_axis)
            for dtype in args.dtypes
            for t in args.tokens
            for d in args.dims
        ]
        output["roofline"] = run(shapes, args.ops, args.repeats, memory=not args.no_memory, allocator=args.allocator)
        if "decode" in output:
            print()
        print(format_table(output["roofline"]))
    if args.table == "torch":
        from mhc import _bench_torch  # imports torch: only for this table

        shapes = [
            Shape(t, args.streams, d, dtype, "sinkhorn")
            for dtype in args.dtypes
            for d in args.torch_dims
            for t in args.torch_tokens
        ]
        paths = ["kernel", *(p for p in args.torch_paths if p != "kernel")]
        output["torch"] = _bench_torch.run(
            shapes,
            args.torch_ops,
            args.repeats,
            paths,
            compile_backend=args.torch_compile_backend,
            decode_repeats=args.torch_decode_repeats,
        )
        print(_bench_torch.format_table(output["torch"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(output["roofline"] if args.table == "roofline" else output, f, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())

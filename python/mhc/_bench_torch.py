"""``python -m mhc.bench --table torch``: mhc.torch's kernel path against Hugging Face's eager module
and the same math in plain torch, eager and ``torch.compile``d; and the per-call overhead at decode.

The rows (``OPS``): the pre alone (Hugging Face's ``DeepseekV4HyperConnection``: the coefficients
and the collapsed layer input) and a whole sublayer, pre -> identity branch -> post (the post as
transformers' ``DeepseekV4DecoderLayer`` writes it), forward and forward+backward (the gradients of
x and of the parameters). The paths (``PATHS``), on the same inputs [1, T, n, D]:

- ``kernel``: ``mhc.torch`` with ``use_kernel=True`` (the C++ kernels as torch custom ops);
- ``hf``: transformers' ``DeepseekV4HyperConnection`` with the same parameters (``fn`` = phi^T,
  ``base`` = bias, ``scale`` = alpha), run eagerly as transformers runs it;
- ``plain``: ``mhc.torch.reference`` (``use_kernel=False``), eager;
- ``compiled``: the same plain function under ``torch.compile`` (its compile time kept apart).

Each case times its paths in turns, one call of each per round, so that a shared machine's drift
reaches all alike: the median time of each path and the median per-round ratio path / kernel. The
forward rows run under ``torch.no_grad()`` (inference); the forward+backward rows only at
``BACKWARD_MIN_TOKENS`` tokens and more (decode is inference). The kernel's roofline fraction uses
mhc.bench's spec byte and FLOP counts and the same measured ceilings.

Importing this module imports torch: mhc.bench imports it only for ``--table torch``.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

import mhc.torch as mt
from mhc import bench

# Declared in mhc.bench (its flags' choices, without importing torch).
OPS, PATHS, BACKWARD_MIN_TOKENS = bench.TORCH_OPS, bench.TORCH_PATHS, bench.TORCH_BACKWARD_MIN_TOKENS
# Each op's minimum bytes and FLOPs: mhc.bench's op of the same work. The pre differentiated alone
# reads x and dlayer_in and writes dx backward, (2n+1)De, phi read twice and dphi written: V4.1's
# pre row counts exactly that.
SPEC_OP = {
    "pre_fwd": "pre_forward",
    "pre_fwd_bwd": "v41_pre_fwd_bwd",
    "sublayer_fwd": "sublayer_fwd",
    "sublayer_fwd_bwd": "sublayer_fwd_bwd",
}
# The decode overhead: the same pre at T = 1, from the bare C++ call up to the public function.
OVERHEAD_LAYERS = ("run", "op", "pre", "pre_autograd", "hf")


def transformers_module(config: mt.Config, dim: int):
    """transformers' ``DeepseekV4HyperConnection`` class and a config for n, D and mhc's epsilons,
    or (None, reason) where transformers has no DeepSeek-V4."""
    try:
        import transformers
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection
    except ImportError as error:
        return None, f"transformers with DeepSeek-V4 not importable ({error})"
    # transformers' one hc_eps is mhc's sinkhorn_eps and pre_eps; its post is 2 sigmoid.
    if config.sinkhorn_eps != config.pre_eps or config.post_scale != 2.0 or config.mix != "sinkhorn":
        return None, "transformers' module has one eps, post_scale 2 and the Sinkhorn mix only"
    hf_config = transformers.DeepseekV4Config(
        hidden_size=dim,
        hc_mult=config.n,
        hc_sinkhorn_iters=config.sinkhorn_iters,
        hc_eps=config.pre_eps,
        rms_norm_eps=config.rms_eps,
    )
    return (DeepseekV4HyperConnection, hf_config), None


@dataclasses.dataclass
class Case:
    """One shape's inputs: x [1, T, n, D], the parameters (mhc's and transformers' module sharing
    their values), and the cotangents of the pre's outputs and of the sublayer's."""

    shape: bench.Shape
    config: mt.Config
    x: torch.Tensor
    params: mt.Params
    hf_module: torch.nn.Module | None
    dlayer_in: torch.Tensor
    dh_post: torch.Tensor
    dh_res: torch.Tensor
    g: torch.Tensor


def make_case(s: bench.Shape, seed: int = 0) -> tuple[Case, str | None]:
    """The inputs of one shape (non-trivial coefficients: alpha of order 1, random biases), and why
    the ``hf`` path is missing (None when it is there)."""
    config = mt.Config(n=s.n, mix=s.mix)
    generator = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if s.dtype == "bf16" else torch.float32
    params = mt.init_params(config, s.dim, generator=generator)
    params = params._replace(
        alpha=torch.tensor([0.8, -0.6, 1.1]), bias=0.5 * torch.randn(config.projection_width, generator=generator)
    )
    # DeepSeek-V4's RMS norm has no weight: ones, not differentiated on any path.
    for p in (params.phi, params.alpha, params.bias):
        p.requires_grad_(True)
    lead = (1, s.tokens)

    def normal(*shape):
        return torch.randn((*lead, *shape), generator=generator).to(dtype)

    hf_module = None
    found, missing = transformers_module(config, s.dim)
    if found is not None:
        module_class, hf_config = found
        hf_module = module_class(hf_config).to(torch.float32)
        with torch.no_grad():
            hf_module.fn.copy_(params.phi.t())
            hf_module.base.copy_(params.bias)
            hf_module.scale.copy_(params.alpha)
    case = Case(
        shape=s,
        config=config,
        x=normal(s.n, s.dim),
        params=params,
        hf_module=hf_module,
        dlayer_in=normal(s.dim),
        dh_post=torch.randn((*lead, s.n), generator=generator),
        dh_res=torch.randn((*lead, s.n, s.n), generator=generator),
        g=normal(s.n, s.dim),
    )
    return case, missing


def _mhc_pre(case: Case, use_kernel: bool):
    def pre(x, params):
        layer_in, ctx = mt.pre(x, params, case.config, use_kernel=use_kernel)
        return layer_in, ctx.h_post, ctx.h_res

    def sublayer(x, params):
        layer_in, ctx = mt.pre(x, params, case.config, use_kernel=use_kernel)
        return mt.post(layer_in, ctx)  # the identity branch: layer_out = layer_in

    return pre, sublayer


def _hf_pre(case: Case):
    module = case.hf_module

    def pre(x, params):  # params: the module's own (the same values)
        post, comb, collapsed = module(x)
        return collapsed, post, comb

    def sublayer(x, params):
        post, comb, collapsed = module(x)
        # transformers' DeepseekV4DecoderLayer.forward: the post and the comb rounded to x's dtype.
        dtype = x.dtype
        return post.to(dtype).unsqueeze(-1) * collapsed.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), x
        )

    return pre, sublayer


def functions(case: Case, op: str, paths, compile_backend: str = "inductor") -> dict:
    """path -> a function of no arguments running ``op`` once on ``case`` (forward under no_grad;
    forward+backward: torch.autograd.grad of x and the parameters at fixed cotangents)."""
    result = {}
    for path in paths:
        if path == "hf":
            pre, sublayer = _hf_pre(case)
            differentiated = [case.x, case.hf_module.fn, case.hf_module.scale, case.hf_module.base]  # mhc.Params order
        else:
            pre, sublayer = _mhc_pre(case, use_kernel=path == "kernel")
            differentiated = [case.x, case.params.phi, case.params.alpha, case.params.bias]
        forward = pre if op.startswith("pre") else sublayer
        if path == "compiled":
            # dynamic=False: one graph per shape, as a serving stack compiles it.
            forward = torch.compile(forward, backend=compile_backend, dynamic=False, fullgraph=True)
        if op.endswith("_fwd"):

            def run(forward=forward):
                with torch.no_grad():
                    return forward(case.x, case.params)
        else:
            cotangents = (case.dlayer_in, case.dh_post, case.dh_res) if op.startswith("pre") else (case.g,)

            def run(forward=forward, differentiated=differentiated, cotangents=cotangents):
                x = case.x.detach().requires_grad_(True)
                inputs = [x, *differentiated[1:]]
                outputs = forward(x, case.params)
                outputs = outputs if isinstance(outputs, tuple) else (outputs,)
                return torch.autograd.grad(outputs, inputs, cotangents)

        result[path] = run
    return result


def overhead(case: Case, repeats: int) -> dict:
    """The pre at decode, layer by layer: ``run`` the bare C++ call on preallocated outputs, ``op``
    the custom op (dispatch and allocation), ``pre`` mhc.torch.pre under no_grad (checks, reshapes,
    the autograd Function), ``pre_autograd`` the same recording the graph, ``hf`` transformers'
    module under no_grad. Seconds, the median of ``repeats`` calls timed in turns."""
    from mhc import _mhc_cpu
    from mhc.torch import _ops

    x = _ops.tokens(case.x, 2).contiguous()
    params = [p.detach() for p in case.params]
    scalars = _ops.scalars(case.config)
    operation = _ops.OPERATIONS["pre_forward"]
    outputs = _ops._allocate(operation, (x, *params))
    pre_op = _ops.OPS["pre_forward"]

    def bare():
        _mhc_cpu.run("pre_forward", [x, *params], outputs, case.config.n, *scalars, 1)

    def op():
        pre_op(x, *params, *scalars)

    def public():
        with torch.no_grad():
            mt.pre(case.x, case.params, case.config)

    def recorded():
        mt.pre(case.x, case.params, case.config)

    layers = {"run": bare, "op": op, "pre": public, "pre_autograd": recorded}
    if case.hf_module is not None:

        def hf():
            with torch.no_grad():
                case.hf_module(case.x)

        layers["hf"] = hf
    return {layer: median for layer, (median, _, _) in bench.time_in_turns(layers, repeats).items()}


def run(
    shapes,
    ops,
    repeats: int,
    paths=PATHS,
    progress: bool = True,
    compile_backend: str = "inductor",
    decode_repeats: int = 50,
) -> dict:
    """Every (shape, op) with its paths timed in turns; then the decode overhead at each dtype's
    T = 1 shape (when one is in ``shapes``), 4 max(repeats, decode_repeats) calls. The
    forward+backward ops run only at BACKWARD_MIN_TOKENS tokens and more; cases at
    T < BACKWARD_MIN_TOKENS take max(repeats, decode_repeats) rounds (their calls are short, the
    median of few noisy)."""
    from mhc import _mhc_cpu

    # One compiled graph per shape and op: more than torch's default of 8 recompiles of one
    # function; hitting the limit must fail, not fall back to eager unnoticed.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 1024
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    machine = bench.cpu_machine_info(_mhc_cpu.num_threads())
    machine["torch"] = torch.__version__
    machine["torch_threads"] = torch.get_num_threads()
    machine["compile_backend"] = compile_backend
    notes = []
    work = [(s, op) for s in shapes for op in ops if op.endswith("_fwd") or s.tokens >= BACKWARD_MIN_TOKENS]
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(work), disable=not progress, unit="case", file=sys.stderr)
    except ImportError:  # tqdm is a dev requirement; the benchmark works without it
        bar = None
    rows, overheads = [], []
    for s in shapes:
        case, missing = make_case(s)
        case_paths = [p for p in paths if not (p == "hf" and case.hf_module is None)]
        if missing and "hf" in paths and missing not in notes:
            notes.append(f"hf path left out: {missing}")
        for op in [op for shape, op in work if shape == s]:
            if bar is not None:
                bar.set_description(f"torch {s.label} {op}")
            case_repeats = repeats if s.tokens >= BACKWARD_MIN_TOKENS else max(repeats, decode_repeats)
            timed = bench.time_in_turns(functions(case, op, case_paths, compile_backend), case_repeats)
            kernel = timed["kernel"][0]
            spec_op = SPEC_OP[op]
            nbytes, flops = bench.minimum_bytes(spec_op, s), bench.flop_count(spec_op, s)
            memory_floor = nbytes / (machine["copy_gbs"] * 1e9)
            compute_floor = flops / (machine["fma_peak_gflops"] * 1e9)
            floor = max(memory_floor, compute_floor)
            row = {**dataclasses.asdict(s), "op": op, "repeats": case_repeats}
            for path, (median, ratio, _) in timed.items():
                row[f"{path}_ms"] = median * 1e3
                if path != "kernel":
                    row[f"{path}_over_kernel"] = ratio
            if "compiled" in timed:
                row["compile_s"] = timed["compiled"][2]
            row |= {
                "minimum_bytes": nbytes,
                "kernel_gbs": nbytes / kernel / 1e9,
                "roofline_floor_ms": floor * 1e3,
                "bound": "memory" if memory_floor >= compute_floor else "compute",
                "roofline_fraction": floor / kernel,
            }
            rows.append(row)
            if bar is not None:
                bar.update()
        if s.tokens == 1:
            seconds = overhead(case, 4 * max(repeats, decode_repeats))
            overheads.append({**dataclasses.asdict(s), **{f"{k}_us": v * 1e6 for k, v in seconds.items()}})
        del case
    if bar is not None:
        bar.close()
    return {
        "machine": machine,
        "repeats": repeats,
        "decode_repeats": max(repeats, decode_repeats),
        "paths": list(paths),
        "notes": notes,
        "rows": rows,
        "overhead": overheads,
    }


def format_table(result: dict) -> str:
    m = result["machine"]
    paths = [p for p in result["paths"] if any(f"{p}_ms" in r for r in result["rows"])] or ["kernel"]
    others = [p for p in paths if p != "kernel"]
    lines = [
        f"torch {m['torch']} ({m['torch_threads']} threads) on {m['cpu']}, mhc {m['threads']} threads, "
        f"{m['simd']}: copy {m['copy_gbs']:.1f} GB/s, FMA peak {m['fma_peak_gflops']:.1f} GFLOP/s "
        f"({m['date']}; the paths timed in turns, medians of {result['repeats']} rounds, "
        f"{result['decode_repeats']} at T < {BACKWARD_MIN_TOKENS}; x/k: the median per-round ratio to the kernel; "
        "compiled: torch.compile "
        f"backend {m['compile_backend']}, compile time apart):",
        f"{'shape':<26} {'op':<17} "
        + " ".join(f"{p + ' ms':>11}" for p in paths)
        + " "
        + " ".join(f"{p[:4] + '/k':>7}" for p in others)
        + f" {'floor ms':>9} {'roofline':>8}",
    ]
    for r in result["rows"]:
        shape = f"T={r['tokens']} n={r['n']} D={r['dim']} {r['dtype']}"
        times = " ".join(f"{r[p + '_ms']:>11.3f}" if p + "_ms" in r else f"{'-':>11}" for p in paths)
        ratios = " ".join(f"{r[p + '_over_kernel']:>6.2f}x" if p + "_over_kernel" in r else f"{'-':>7}" for p in others)
        lines.append(
            f"{shape:<26} {r['op']:<17} {times} {ratios} {r['roofline_floor_ms']:>9.3f} {r['roofline_fraction']:>7.0%}"
        )
    compiles = [r for r in result["rows"] if "compile_s" in r]
    if compiles:
        lines.append(
            "torch.compile's first call (s): "
            + ", ".join(f"T={r['tokens']} {r['dtype']} {r['op']} {r['compile_s']:.1f}" for r in compiles)
        )
    if result["overhead"]:
        layers = [k for k in OVERHEAD_LAYERS if f"{k}_us" in result["overhead"][0]]
        lines += [
            "",
            "Per-call overhead of the pre at decode (us, medians, timed in turns; run: the bare C++ call on "
            "preallocated outputs; op: torch.ops.mhc.pre_forward; pre: mhc.torch.pre under no_grad; "
            "pre_autograd: recording the graph; hf: transformers' module under no_grad; +: over run):",
            f"{'shape':<26} " + " ".join(f"{k:>13}" for k in layers),
        ]
        for r in result["overhead"]:
            shape = f"T={r['tokens']} n={r['n']} D={r['dim']} {r['dtype']}"
            cells = [f"{r['run_us']:>13.1f}"] + [
                f"{r[k + '_us']:>6.1f} {r[k + '_us'] - r['run_us']:+6.1f}" for k in layers[1:]
            ]
            lines.append(f"{shape:<26} " + " ".join(cells))
    lines += result["notes"]
    return "\n".join(lines)

"""scripts/gpu_check.sh's torch stage: mhc.torch on a CUDA device. UNVERIFIED: written without a GPU;
only its CPU dry run (--device cpu) has run.

mhc.torch registers no CUDA kernel (mhc's CUDA backend has never run on a GPU), so today:

1. the kernel path on CUDA tensors must be refused with the documented error naming the argument;
   if it is not refused (CUDA ops registered since), its outputs and gradients are compared with the
   CPU kernels' instead, and the report says so;
2. the plain-torch path (``use_kernel=False``) runs on the GPU: a sublayer forward and backward in
   f32 and bf16 against mhc's CPU kernels on the same inputs, within the tolerance below (TF32 off);
3. the Hugging Face drop-in's module on a CUDA tensor (it runs the plain formulas there) against the
   CPU kernels.

Writes a JSON report (--json) and exits 1 when a check fails or no CUDA device is there (unless
--device cpu: the same comparisons on the CPU, a dry run of this script's logic, the refusal check
left out).

    PYTHONPATH=BUILD/python_pkg python scripts/gpu_check_torch.py --json logs/torch_check.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import mhc.torch as mt

# The largest relative error ||got - want|| / ||want|| over the output and the gradients. Both paths
# compute the spec's formulas with f32 coefficient math and differ in summation order (the GPU's
# matmul against the kernel's blocked sums): on the CPU the two paths are 1e-6 apart in f32 and
# 3e-3 in bf16 (x's gradient, a few bf16 roundings; the rest under 5e-5).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def problem(dtype, seed=0, tokens=37, n=4, dim=160):
    """x [tokens, n, dim], a branch input's cotangent, and parameters with non-trivial coefficients."""
    generator = torch.Generator().manual_seed(seed)
    config = mt.Config(n=n)
    params = mt.init_params(config, dim, generator=generator)
    params = params._replace(
        alpha=torch.tensor([0.8, -0.6, 1.1]), bias=0.5 * torch.randn(config.projection_width, generator=generator)
    )
    x = torch.randn((tokens, n, dim), generator=generator).to(dtype)
    g = torch.randn((tokens, n, dim), generator=generator).to(dtype)
    return config, params, x, g


def sublayer_values(config, params, x, g, device, use_kernel):
    """pre -> tanh branch -> post on ``device``: the output and the gradients of x and the
    parameters, on the CPU as f32."""
    # copy=True: fresh leaves each call (on the CPU, .to would return the very tensor and its .grad).
    x = x.to(device, copy=True).requires_grad_(True)
    params = mt.Params(*(p.to(device, copy=True).requires_grad_(True) for p in params))
    layer_in, ctx = mt.pre(x, params, config, use_kernel=use_kernel)
    out = mt.post(torch.tanh(layer_in), ctx)
    out.backward(g.to(device))
    return [t.detach().float().cpu() for t in (out, x.grad, *(p.grad for p in params))]


def compare(name, got, want, dtype) -> dict:
    worst = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, want, strict=True))
    return {"check": name, "dtype": str(dtype), "worst_relative_error": worst, "ok": worst <= TOLERANCE[dtype]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    report = {"torch": torch.__version__, "device": args.device, "checks": []}
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(f"torch {torch.__version__}: no CUDA device (torch.cuda.is_available() is False)")
            report["error"] = "no CUDA device"
            _write(args.json, report)
            return 1
        report["device_name"] = torch.cuda.get_device_name(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # f32 matmuls in f32, as the kernels
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    checks = report["checks"]
    for dtype in (torch.float32, torch.bfloat16):
        config, params, x, g = problem(dtype)
        cpu_kernel = sublayer_values(config, params, x, g, "cpu", use_kernel=True)
        checks.append(
            compare(
                "plain path on the device vs the CPU kernels",
                sublayer_values(config, params, x, g, device, False),
                cpu_kernel,
                dtype,
            )
        )
        if args.device == "cuda":
            try:
                on_device = sublayer_values(config, params, x, g, device, True)
            except TypeError as error:
                refused = "no verified CUDA kernel" in str(error) and "x" in str(error)
                checks.append(
                    {
                        "check": "kernel path on CUDA tensors refused (unverified)",
                        "dtype": str(dtype),
                        "error": str(error),
                        "ok": refused,
                    }
                )
            else:
                result = compare(
                    "kernel path on CUDA tensors (ran: CUDA ops registered) vs the CPU kernels",
                    on_device,
                    cpu_kernel,
                    dtype,
                )
                checks.append(result | {"note": "not refused: the CUDA ops ran; update docs/torch.md"})
    checks.append(_drop_in(device))
    for check in checks:
        worst = f" relative error {check['worst_relative_error']:.1e}" if "worst_relative_error" in check else ""
        error = f" ({check['error']})" if "error" in check else ""
        print(f"{'ok  ' if check['ok'] else 'FAIL'} {check['check']} {check['dtype']}{worst}{error}")
    report["passed"] = all(check["ok"] for check in checks)
    _write(args.json, report)
    return 0 if report["passed"] else 1


def _drop_in(device) -> dict:
    """mhc.torch.hf.HyperConnection on a ``device`` tensor (plain formulas off the CPU) against the
    same module on the CPU (the kernels): (post, comb, collapsed)."""
    from mhc.torch import hf

    config, params, x, _ = problem(torch.float32)
    module = hf.HyperConnection(config.n, x.shape[-1], config.sinkhorn_iters, config.pre_eps, config.rms_eps)
    with torch.no_grad():
        module.fn.copy_(params.phi.t())
        module.base.copy_(params.bias)
        module.scale.copy_(params.alpha)
        want = module(x.unsqueeze(0))
        got = module.to(device)(x.unsqueeze(0).to(device))
    return compare(
        "transformers drop-in module on the device vs the CPU kernels",
        [t.float().cpu() for t in got],
        list(want),
        torch.float32,
    )


def _write(path, report) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

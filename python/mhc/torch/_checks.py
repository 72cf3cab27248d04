"""Argument checks of mhc.torch, raised before any kernel runs: TypeError (dtype, type, device) or
ValueError (shape, layout) naming the argument; the public function's name is put first by
``mhc._errors.names_its_errors``."""

from __future__ import annotations

import torch

from mhc._config import Config, HeadParams, Params

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def check_device(name: str, tensor: torch.Tensor, use_kernel: bool) -> None:
    """The kernels read host memory. A CUDA tensor raises: mhc's CUDA backend has never run on a GPU
    (README, Support), so mhc.torch registers no CUDA kernel for it."""
    if not use_kernel or tensor.device.type in ("cpu", "meta"):
        return
    if tensor.device.type == "cuda":
        raise TypeError(
            f"{name}: a CUDA tensor, and mhc has no verified CUDA kernel (its CUDA backend has not run on a GPU); "
            "move the tensors to the CPU, or use use_kernel=False (plain torch on any device)"
        )
    raise TypeError(f"{name}: expected a CPU tensor for the kernels, got device {tensor.device}")


def check_tensor(name: str, value, dtypes, expected_shape=None, use_kernel: bool = True) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {allowed}, got {str(value.dtype).removeprefix('torch.')}")
    if expected_shape is not None and tuple(value.shape) != tuple(expected_shape):
        raise ValueError(f"{name}: expected shape {tuple(expected_shape)}, got {tuple(value.shape)}")
    check_device(name, value, use_kernel)
    if use_kernel and not value.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor (the kernels read it row-major), got strides "
            f"{tuple(value.stride())} for shape {tuple(value.shape)}; pass .contiguous()"
        )


def check_activation(name: str, value, expected_shape=None, use_kernel: bool = True) -> None:
    check_tensor(name, value, ACTIVATION_DTYPES, expected_shape, use_kernel)


def check_streams(name: str, x, n: int | None, use_kernel: bool) -> None:
    check_activation(name, x, use_kernel=use_kernel)
    if x.dim() < 2 or x.shape[-1] < 1:
        raise ValueError(f"{name}: expected shape [..., n, D] with rank >= 2 and D >= 1, got {tuple(x.shape)}")
    if n is not None and x.shape[-2] != n:
        raise ValueError(f"{name}: expected {n} streams (config.n) in axis -2, got shape {tuple(x.shape)}")


def _check_config(config) -> None:
    if not isinstance(config, Config):
        raise TypeError(f"config: expected mhc.torch.Config, got {type(config).__name__}")


def _check_params(params, params_type, expected: dict, context: str, use_kernel: bool) -> None:
    if not isinstance(params, params_type):
        raise TypeError(f"params: expected mhc.torch.{params_type.__name__}, got {type(params).__name__}")
    for field, shape in expected.items():
        value = getattr(params, field)
        check_tensor(f"params.{field}", value, (torch.float32,), use_kernel=use_kernel)
        if tuple(value.shape) != shape:
            raise ValueError(f"params.{field}: expected shape {shape} for {context}, got {tuple(value.shape)}")


def check_pre_args(x, params, config, use_kernel: bool) -> None:
    _check_config(config)
    check_streams("x", x, config.n, use_kernel)
    m, width = config.n * x.shape[-1], config.projection_width
    expected = {"norm_weight": (m,), "phi": (m, width), "alpha": (3,), "bias": (width,)}
    _check_params(params, Params, expected, f"n={config.n}, D={x.shape[-1]}, mix={config.mix!r}", use_kernel)


def check_head_args(x, params, config, use_kernel: bool) -> None:
    _check_config(config)
    check_streams("x", x, config.n, use_kernel)
    n, d = config.n, x.shape[-1]
    expected = {"fn": (n, n * d), "base": (n,), "scale": (1,)}
    _check_params(params, HeadParams, expected, f"n={n}, D={d}", use_kernel)


def check_carried(carried, x, config, use_kernel: bool) -> None:
    """V4.1's carried mix: None (the one-hot on stream 0) or f32 [..., n] with x's leading axes."""
    if carried is None:
        return
    config.check_reads_carried()
    expected = (*x.shape[:-2], config.n)
    check_tensor("carried", carried, (torch.float32,), expected, use_kernel)


def check_layer_out(layer_out, x, use_kernel: bool) -> None:
    check_activation("layer_out", layer_out, (*x.shape[:-2], x.shape[-1]), use_kernel)

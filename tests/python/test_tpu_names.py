"""Every kernel of mhc.tpu.KERNELS, lowered for a TPU (jax.export), is one pallas_call named after
its operation and token tile (what a TPU profile and libtpu's dumps show), and asks the compiler
for the one VMEM limit the chip gives (_layout.vmem_limit of _layout.chip_vmem: issue 42 item 3).
The operands of each operation are mhc.tpu.compile_report's (OPERATIONS), at a small shape."""

import re

import jax
import jax.numpy as jnp
import pytest

import mhc.jax as mj
import mhc.tpu
from mhc.tpu import _layout
from mhc.tpu import compile_report as tpu_compile


@pytest.mark.parametrize("name", sorted(mhc.tpu.KERNELS))
def test_each_kernel_is_named_after_its_operation_and_tile_with_the_chips_vmem_limit(name):
    config = mj.Config(n=4)
    kinds, _ = tpu_compile.OPERATIONS[name]
    shapes = tpu_compile._operands(kinds, config, 256, 40, jnp.dtype(jnp.bfloat16), None)
    function = jax.jit(lambda *a: mhc.tpu.KERNELS[name](config, *a))
    text = jax.export.export(function, platforms=["tpu"])(*shapes).mlir_module()
    calls = [line for line in text.splitlines() if "@tpu_custom_call" in line]
    assert len(calls) == 1, calls
    (kernel,) = re.findall(r'kernel_name = "(\w+)"', calls[0])
    tile = re.fullmatch(rf"{name}_tile(\d+)", kernel)
    assert tile and int(tile.group(1)) in _layout.TOKEN_TILES, kernel
    limits = re.findall(r"\\22scoped_memory_configs\\22: \[\{[^]]*\\22size\\22: (\d+)\}\]", calls[0])
    assert limits == [str(_layout.vmem_limit(_layout.chip_vmem()))], limits

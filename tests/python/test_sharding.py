"""Runs sharding_cases.py on 8 forced CPU devices in a subprocess (the device count is fixed
when JAX starts, so it cannot be changed inside this pytest process), once per partitioner; and
checks that every registered custom call has a partitioning rule."""

import os
import socket
import subprocess
import sys

import jax
import pytest

from mhc import _ffi
from mhc.jax import _kernels

# Shardy is JAX's default partitioner; GSPMD is tested while this jax still has the switch.
PARTITIONERS = ["shardy", "gspmd"] if hasattr(jax.config, "jax_use_shardy_partitioner") else ["shardy"]


def _run_cases(seed, partitioner, *selection) -> str:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    script = os.path.join(os.path.dirname(__file__), "sharding_cases.py")
    args = [sys.executable, script, str(seed), partitioner, *selection]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"seed {seed} {partitioner}\n{result.stdout}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.slow  # a fresh JAX process on 8 forced devices (pyproject.toml, markers)
@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_sharded_kernels_match_one_device(seed, partitioner):
    output = _run_cases(seed, partitioner)
    # Shardy: 10 layout checks (5 layouts x 2 of the 4 mix-dtype pairs, both mixes and both dtypes
    # on each: sharding_cases.LAYOUT_CASES), 6 padded/gathered, 12 shard_map (3 operations x 3
    # layouts in f32, 3 in bf16) and its errors, 17 others (4 of them FSDP); GSPMD: the layouts and
    # padded cases for one mix and dtype (5 + 3), 3 shard_map, 13 others.
    expected = 46 if partitioner == "shardy" else 24
    assert output.count("ok:") == expected, output


@pytest.mark.slow  # a fresh JAX process on 8 forced devices (pyproject.toml, markers)
@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_padded_rows_stay_out_of_parameter_gradients(seed, partitioner):
    """Padded token rows that hold values, for the pre, boundary and head backwards (their own
    subprocess: quick, so scripts/mutate.py runs it for the padded-row masks)."""
    output = _run_cases(seed, partitioner, "padded-rows")
    assert output.count("ok:") == 3, output


@pytest.mark.slow  # a fresh JAX process on 8 forced devices (pyproject.toml, markers)
@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_vmap_of_sharded_arrays(seed, partitioner):
    """jit(vmap(pre -> post)) on x sharded over 2 devices, the batch axis or the token axis (its
    own subprocess: quick, so scripts/mutate.py runs it for the batching rule)."""
    output = _run_cases(seed, partitioner, "vmap")
    assert output.count("ok:") == 2, output


@pytest.mark.slow  # a fresh JAX process on 8 forced devices (pyproject.toml, markers)
def test_carried_mix_inside_shard_map_with_d_split(seed):
    """DeepSeek-V4.1's carried mix as a shard_map input, D split over 2, 4 and (tokens x D) 8
    devices: pre(carried=), Streams into a sublayer and collapse, against the float64 oracle, f32
    and bf16, with and without check_vma (its own subprocess: quick, for scripts/mutate.py). No
    partitioner runs inside shard_map, so once."""
    output = _run_cases(seed, "shardy", "carried")
    assert output.count("ok:") == 27, output  # 3 programs x 3 meshes x (f32, bf16, f32 without check_vma)


def test_every_custom_call_has_a_partitioning_rule():
    """A new FFI target must be called from a partitioned operation (mhc.jax._kernels.OPERATIONS),
    or plain jit on sharded arrays would gather its operands and run it replicated."""
    registered = set(_ffi.TARGET_NAMES) | set(_ffi.CUDA_TARGETS)
    missing = registered - _kernels.PARTITIONED_TARGETS
    assert not missing, f"FFI targets without a partitioning rule: {sorted(missing)}"
    stale = _kernels.PARTITIONED_TARGETS - registered
    assert not stale, f"partitioning rules name unregistered targets: {sorted(stale)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a fresh JAX process on 8 forced devices (pyproject.toml, markers)
def test_two_processes_match_one_device(seed, tmp_path):
    """2 processes on 127.0.0.1 with 4 CPU devices each, one global mesh of 8 (multiprocess_cases.py)."""
    script = os.path.join(os.path.dirname(__file__), "multiprocess_cases.py")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    logs = [tmp_path / f"process{index}.log" for index in range(2)]  # files: a full pipe would block
    processes = []
    try:
        for index, log in enumerate(logs):
            with open(log, "w") as out:
                args = [sys.executable, script, str(port), str(index), str(seed)]
                processes.append(subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT))
        for process in processes:
            process.wait(timeout=600)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for index, (process, log) in enumerate(zip(processes, logs, strict=True)):
        output = log.read_text()
        assert process.returncode == 0, f"seed {seed}: process {index}\n{output[-4000:]}"
        assert output.count("ok:") == 2, output[-4000:]

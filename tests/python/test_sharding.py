"""Runs sharding_cases.py on 8 forced CPU devices in a subprocess (the device count is fixed
when JAX starts, so it cannot be changed inside this pytest process)."""

import os
import subprocess
import sys


def test_sharded_kernels_match_one_device(seed):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    script = os.path.join(os.path.dirname(__file__), "sharding_cases.py")
    result = subprocess.run([sys.executable, script, str(seed)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"seed {seed}\n{result.stdout}\n{result.stderr[-4000:]}"
    assert result.stdout.count("ok:") == 13, result.stdout

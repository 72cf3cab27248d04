"""The demo entry point (smoke test) and kernel vs reference training from the same seed."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mhc.demo import RunSpec, train


def _tiny_spec(**overrides):
    spec = dict(
        name="t",
        steps=20,
        batch=4,
        seq_len=16,
        width=32,
        layers=1,
        heads=2,
        n=4,
        residual="mhc",
        use_kernel=True,
        lr=3e-3,
        seed=0,
        eval_every=10,
        eval_batches=1,
        sample_bytes=8,
        prompt="def ",
        data=None,
        progress=False,
    )
    spec.update(overrides)
    return RunSpec(**spec)


def test_demo_runs_and_writes_its_outputs(tmp_path):
    out = tmp_path / "demo"
    flags = "--steps 12 --batch 4 --seq-len 32 --width 32 --layers 1 --heads 2 --eval-every 6 --eval-batches 1"
    result = subprocess.run(
        [sys.executable, "-m", "mhc.demo", *flags.split(), "--sample-bytes", "16", "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train loss" in result.stdout and "sample" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    losses = metrics["runs"][0]["losses"]
    assert len(losses) == 12 and np.mean(losses[-3:]) < losses[0], losses
    assert (out / "metrics.csv").read_text().startswith("run,step,train_loss,val_loss")
    for name in ("loss.png", "amax_gain.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000, name
        import matplotlib.image

        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.parametrize("residual", ["mhc", "mhc-lite"])
def test_kernel_and_reference_training_agree(residual):
    kernel = train(_tiny_spec(residual=residual, use_kernel=True))
    reference = train(_tiny_spec(residual=residual, use_kernel=False))
    np.testing.assert_allclose(kernel["losses"], reference["losses"], rtol=2e-4)
    assert kernel["amax_forward"] and abs(kernel["amax_forward"][-1] - 1.0) < 1e-3


def test_bad_arguments_exit_with_a_message():
    result = subprocess.run([sys.executable, "-m", "mhc.demo", "--steps", "0"], capture_output=True, text=True)
    assert result.returncode == 2 and "--steps" in result.stderr

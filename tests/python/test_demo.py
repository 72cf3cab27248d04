"""The demo: its entry point (smoke test), kernel vs reference training from the same seed, the
residual comparison (--compare), the kernel-path comparison (--compare-paths) and its documented
flags."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mhc
from mhc import demo
from mhc.diagnostics import amax_gain
from mhc.models import ModelConfig, Transformer, loss_fn
from model_reference import assert_loss_matches

README = Path(__file__).resolve().parents[2] / "README.md"
TINY_FLAGS = "--batch 4 --seq-len 16 --width 32 --layers 1 --heads 2 --eval-batches 1"


def _assert_png(path: Path):
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000, path
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, path


@pytest.mark.slow  # training runs: over 10 s of CPU (pyproject.toml, markers)
def test_demo_runs_and_writes_its_outputs(tmp_path, capsys):
    # In this process; test_bad_arguments_exit_with_a_message runs `python -m mhc.demo` itself.
    out = tmp_path / "demo"
    flags = f"--steps 12 {TINY_FLAGS} --seq-len 32 --eval-every 6 --sample-bytes 16 --no-progress"
    assert demo.main([*flags.split(), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "train loss" in printed and "mhc-kernel sample" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    losses = metrics["runs"][0]["losses"]
    assert len(losses) == 12 and np.mean(losses[-3:]) < losses[0], losses
    assert (out / "metrics.csv").read_text().startswith("run,step,train_loss,val_loss")
    for name in ("loss.png", "amax_gain.png"):
        _assert_png(out / name)


def _train_losses(config: ModelConfig, seed: int, steps: int):
    """Losses of `steps` AdamW steps on the demo's corpus, the trained model's H_res per sublayer,
    and the first batch (tokens, targets)."""
    model = Transformer(config, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens, targets):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets)
        optimizer.update(model, grads)
        return loss

    corpus = np.frombuffer(demo.load_corpus(None), np.uint8)
    starts = np.random.default_rng(seed).integers(0, len(corpus) - 17, size=(steps, 4))
    data = np.stack([[corpus[s : s + 17] for s in row] for row in starts]).astype(np.int32)
    losses = [float(step(model, optimizer, jnp.asarray(b[:, :-1]), jnp.asarray(b[:, 1:]))) for b in data]
    return losses, model.residual_mixes(jnp.asarray(data[0, :, :-1])), (data[0, :, :-1], data[0, :, 1:])


@pytest.mark.slow  # training runs: over 10 s of CPU (pyproject.toml, markers)
@pytest.mark.parametrize("residual", ["mhc", "mhc-lite", "mhc-v4.1"])
def test_kernel_and_reference_training_agree(residual, seed):
    # The mHC sublayers (fused boundaries) and the head (V4.1: the collapse) on the kernels and on the plain-JAX path;
    # only the training step is compiled (no evaluation, no sampling), so this costs two compilations. The first
    # step's loss (before any update) each against the float64 model with the one accuracy rule; after it the two
    # trajectories are not compared with each other (AdamW's first steps move each weight by about lr whatever the
    # size of its gradient, so one rounding of a near-zero gradient changes the path): the gradients each path trains
    # on are held to the float64 model in test_models.py and test_models_v41.py. Both must train.
    config = dict(width=32, layers=1, heads=2, residual=residual)
    kernel, kernel_mixes, (tokens, targets) = _train_losses(ModelConfig(**config, use_kernel=True), seed, steps=12)
    reference, _, _ = _train_losses(ModelConfig(**config, use_kernel=False), seed, steps=12)
    initial = Transformer(ModelConfig(**config), rngs=nnx.Rngs(seed))  # the parameters both runs start from
    assert_loss_matches({"kernels": kernel[0], "plain": reference[0]}, initial, tokens, targets, f"(seed {seed})")
    assert kernel[-1] < kernel[0] and reference[-1] < reference[0], (kernel, reference)
    forward, backward = amax_gain(kernel_mixes)
    assert abs(forward[-1] - 1.0) < 1e-3 and abs(backward[-1] - 1.0) < 1e-2


@pytest.mark.slow  # training runs: over 10 s of CPU (pyproject.toml, markers)
def test_compare_trains_every_residual_from_one_seed(tmp_path, monkeypatch, capsys, seed):
    # In this process (the demo gives each run its own, to measure its peak memory), so without
    # the allocator setting a run makes for its own process.
    monkeypatch.setattr(demo, "_train_in_subprocess", demo.train)
    monkeypatch.setattr(mhc, "tune_allocator", lambda: False)
    out = tmp_path / "compare"
    flags = f"--compare --steps 4 {TINY_FLAGS} --eval-every 4 --sample-bytes 0 --lr 3e-2 --seed {seed % 1000}"
    assert demo.main([*flags.split(), "--no-progress", "--out", str(out)]) == 0
    runs = {run["name"]: run for run in json.loads((out / "metrics.json").read_text())["runs"]}
    assert list(runs) == list(demo.COMPARE_RESIDUALS)
    assert {run["spec"]["seed"] for run in runs.values()} == {seed % 1000}
    assert all(len(run["losses"]) == 4 and np.all(np.isfinite(run["losses"])) for run in runs.values())
    assert not runs["plain"]["amax_forward"]
    for name in ("mhc", "mhc-lite", "mhc-v4.1"):
        assert np.allclose(runs[name]["amax_forward"], 1.0, atol=1e-3), runs[name]["amax_forward"]
    # Trained, the unconstrained mixes no longer keep the streams' sum.
    assert len(runs["hc"]["amax_forward"]) == 2 and abs(runs["hc"]["amax_forward"][-1] - 1.0) > 1e-3
    for name in ("loss.png", "amax_gain.png", "comparison.png"):
        _assert_png(out / name)
    table = capsys.readouterr().out
    assert "vs plain" in table and "step ms" in table
    for name in runs:
        assert re.search(rf"^{re.escape(name)} .* \d+\.\d\dx ", table, re.MULTILINE), table


def _fake_result(spec: demo.RunSpec) -> dict:
    multi_stream = spec.residual != "plain"
    return {
        "name": spec.name,
        "spec": demo.dataclasses.asdict(spec),
        "losses": [3.0, 2.5, 2.0],
        "val_losses": [(3, 2.2)],
        "final_train_loss": 2.5,
        "final_val_loss": 2.2,
        "tokens_per_s": 1000.0,
        "step_ms": 10.0 if spec.use_kernel else 12.0,
        "peak_rss_mib": 500.0,
        "amax_forward": [1.0, 1.0] if multi_stream else [],
        "amax_backward": [1.0, 1.0] if multi_stream else [],
        "sample": "",
    }


def test_compare_paths_runs_the_kernel_paths(tmp_path, monkeypatch, capsys):
    specs = []
    monkeypatch.setattr(demo, "_train_in_subprocess", lambda spec: specs.append(spec) or _fake_result(spec))
    assert demo.main(["--compare-paths", "--residual", "mhc-lite", "--out", str(tmp_path), "--no-progress"]) == 0
    assert [(s.name, s.residual, s.use_kernel, s.fuse_boundaries) for s in specs] == [
        ("kernel", "mhc-lite", True, True),
        ("kernel-unfused", "mhc-lite", True, False),
        ("plain-jax", "mhc-lite", False, True),
    ]
    assert specs[0].layers == demo.SINGLE_DEFAULTS["layers"] and specs[0].steps == demo.SINGLE_DEFAULTS["steps"]
    table = capsys.readouterr().out
    assert "vs kernel" in table and "1.20x" in table  # the plain-JAX step against the kernel's
    assert not (tmp_path / "comparison.png").exists()


def test_recompute_reaches_the_mhc_runs_and_sets_the_cpu_scheduler(tmp_path, monkeypatch, capsys):
    flag = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    specs = []
    monkeypatch.setattr(demo, "_train_in_subprocess", lambda spec: specs.append(spec) or _fake_result(spec))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    assert demo.main(["--compare", "--recompute", "3", "--out", str(tmp_path), "--no-progress"]) == 0
    assert [(s.name, s.recompute) for s in specs] == [
        ("plain", None),
        ("hc", None),
        ("mhc-k3", 3),
        ("mhc-lite-k3", 3),
        ("mhc-v4.1-k3", 3),
    ]
    assert demo.os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=1 {flag}"
    # auto: the paper's group size for the run's sublayers (4 blocks: 8 sublayers, sqrt(4 * 8 / 6) = 2.3)
    specs.clear()
    assert demo.main(["--compare-paths", "--recompute", "auto", "--out", str(tmp_path), "--no-progress"]) == 0
    assert [(s.name, s.recompute) for s in specs] == [("kernel", 2), ("kernel-unfused", 2), ("plain-jax", None)]
    assert demo.os.environ["XLA_FLAGS"].count(flag) == 1
    assert "peak MiB" in capsys.readouterr().out
    for bad in (["--recompute", "0"], ["--recompute", "two"], ["--residual", "hc", "--recompute", "2"]):
        with pytest.raises(SystemExit):
            demo.main(bad)
    with pytest.raises(SystemExit):
        demo.main(["--no-use-kernel", "--recompute", "2"])


def test_v41_runs_take_their_own_collapse(tmp_path, monkeypatch):
    """--residual mhc-v4.1 ends with its carried collapse: --collapse is refused for it alone, and in
    --compare it applies to the V4 kinds while the V4.1 run keeps its own."""
    specs = []
    monkeypatch.setattr(demo, "_train_in_subprocess", lambda spec: specs.append(spec) or _fake_result(spec))
    assert demo.main(["--compare", "--collapse", "sum", "--out", str(tmp_path), "--no-progress"]) == 0
    assert [(s.residual, s.collapse) for s in specs] == [
        ("plain", "sum"),
        ("hc", "sum"),
        ("mhc", "sum"),
        ("mhc-lite", "sum"),
        ("mhc-v4.1", None),
    ]
    specs.clear()
    assert demo.main(["--compare-paths", "--residual", "mhc-v4.1", "--out", str(tmp_path), "--no-progress"]) == 0
    assert [(s.name, s.residual, s.collapse) for s in specs] == [
        ("kernel", "mhc-v4.1", None),
        ("kernel-unfused", "mhc-v4.1", None),
        ("plain-jax", "mhc-v4.1", None),
    ]
    for collapse in ("head", "sum"):
        with pytest.raises(SystemExit):
            demo.main(["--residual", "mhc-v4.1", "--collapse", collapse])


def test_bad_arguments_exit_with_a_message():
    result = subprocess.run([sys.executable, "-m", "mhc.demo", "--steps", "0"], capture_output=True, text=True)
    assert result.returncode == 2 and "--steps" in result.stderr
    with pytest.raises(SystemExit):
        demo.main(["--compare-paths", "--residual", "hc"])
    with pytest.raises(SystemExit):
        demo.main(["--compare", "--compare-paths"])


def _documented_demo_text() -> str:
    """The README's demo section and quick start, and the module docstring."""
    readme = README.read_text()
    demo_section = readme[readme.index("## The demo") :]
    demo_section = demo_section[: demo_section.index("\n## ", 1)]
    quick_start = readme[readme.index("## Quick start") : readme.index("## The demo")]
    return quick_start + demo_section + demo.__doc__


def test_every_documented_flag_is_real():
    parser = demo.build_parser()
    real = set(parser._option_string_actions)
    documented = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", _documented_demo_text()))
    assert documented, "no flags found in the README's demo section"
    assert documented <= real, f"documented but not accepted: {sorted(documented - real)}"
    assert {"--compare", "--compare-paths", "--no-use-kernel", "--residual"} <= documented


def test_every_documented_demo_command_parses():
    text = _documented_demo_text()
    commands = re.findall(r"python -m mhc\.demo((?: +--?[\w-]+(?: +[\w./-]+)?)*)", text)
    commands += re.findall(r'DEMO_ARGS="([^"]*)"', text)
    assert len(commands) >= 4, commands
    parser = demo.build_parser()
    for command in (c for c in commands if "--help" not in c):
        args = parser.parse_args(shlex.split(command))  # exits (fails the test) on an unknown flag
        assert args.out == "demo_output"

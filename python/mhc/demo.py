"""Train a small byte-level transformer whose residual stream is mHC, on the CPU, end to end.

    python -m mhc.demo                       # defaults: ~3 minutes on 2 CPU cores
    python -m mhc.demo --compare             # plain residual, hyper-connections, mHC, mHC-lite and
                                             # DeepSeek-V4.1's mHC from one seed, deeper and narrower
    python -m mhc.demo --compare-paths       # the same mHC run on the kernels (with and without the
                                             # fused sublayer boundaries) and on plain JAX
    python -m mhc.demo --data my.txt --steps 2000 --residual mhc-lite --no-use-kernel
    python -m mhc.demo --residual mhc-v4.1   # DeepSeek-V4.1's structure: the pre mix carried from
                                             # the previous sublayer, no head
    python -m mhc.demo --recompute auto      # mHC's streams recomputed in groups of sublayers in the
                                             # backward (the paper's group size; or --recompute K)

Writes metrics (JSON, CSV), loss curves and the Amax gain per depth (PNG), and samples text.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import multiprocessing
import os
import resource
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

DEFAULT_CORPUS_BYTES = 4 << 20


def load_corpus(path: str | None) -> bytes:
    """The user's file, or the Python standard library's own .py sources (on every machine)."""
    if path:
        data = Path(path).read_bytes()
    else:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for file in sorted(stdlib.glob("*.py")):
            chunk = file.read_bytes()
            chunks.append(chunk)
            total += len(chunk)
            if total >= DEFAULT_CORPUS_BYTES:
                break
        data = b"".join(chunks)
    if len(data) < 1024:
        raise SystemExit(f"--data: need at least 1 KiB of text, got {len(data)} bytes")
    return data


@dataclasses.dataclass
class RunSpec:
    name: str
    steps: int
    batch: int
    seq_len: int
    width: int
    layers: int
    heads: int
    n: int
    residual: str
    use_kernel: bool
    lr: float
    seed: int
    eval_every: int
    eval_batches: int
    sample_bytes: int
    prompt: str
    data: str | None
    progress: bool = True
    fuse_boundaries: bool = True  # each post fused with the next sublayer's pre (kernel path)
    # n streams -> one: DeepSeek-V4's learned head, their sum, or V4.1's carried collapse (None: the
    # residual's own, ModelConfig.collapse)
    collapse: str | None = None
    recompute: int | None = None  # mHC's streams kept only every this many sublayers (ModelConfig.recompute)


def _batches(data: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator):
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    window = np.stack([data[s : s + seq_len + 1] for s in starts])
    return window[:, :-1].astype(np.int32), window[:, 1:].astype(np.int32)


def train(spec: RunSpec) -> dict:
    """One training run; returns its metrics (and samples text from the trained model)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tqdm import tqdm

    import mhc
    from mhc.diagnostics import amax_gain
    from mhc.models import ModelConfig, Transformer, loss_fn

    # Each run owns its process (_train_in_subprocess), so it may keep large blocks in the heap
    # (the kernels' outputs are then not faulted in afresh each step); every run of a comparison
    # does the same, so their peak memories stay comparable.
    mhc.tune_allocator()

    corpus = np.frombuffer(load_corpus(spec.data), np.uint8)
    split = int(0.9 * len(corpus))
    train_data, val_data = corpus[:split], corpus[split:]
    config = ModelConfig(
        width=spec.width,
        layers=spec.layers,
        heads=spec.heads,
        residual=spec.residual,
        n=spec.n,
        use_kernel=spec.use_kernel,
        fuse_boundaries=spec.fuse_boundaries,
        collapse=spec.collapse,
        recompute=spec.recompute,
    )
    model = Transformer(config, rngs=nnx.Rngs(spec.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(spec.lr, weight_decay=0.01), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens, targets):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets)
        optimizer.update(model, grads)
        return loss

    evaluate = nnx.jit(loss_fn)
    rng = np.random.default_rng(spec.seed)
    val_rng = np.random.default_rng(spec.seed + 1)
    val_set = [_batches(val_data, spec.batch, spec.seq_len, val_rng) for _ in range(spec.eval_batches)]

    def validation_loss():
        return float(np.mean([float(evaluate(model, x, y)) for x, y in val_set]))

    losses, val_losses = [], []
    tokens_per_step = spec.batch * spec.seq_len
    timed_tokens, timed_seconds = 0, 0.0
    bar = tqdm(range(1, spec.steps + 1), desc=spec.name, disable=not spec.progress, file=sys.stderr, dynamic_ncols=True)
    for i in bar:
        tokens, targets = _batches(train_data, spec.batch, spec.seq_len, rng)
        start = time.perf_counter()
        loss = float(step(model, optimizer, tokens, targets))
        elapsed = time.perf_counter() - start
        if i > 1:  # the first step compiles
            timed_tokens += tokens_per_step
            timed_seconds += elapsed
        losses.append(loss)
        if i % spec.eval_every == 0 or i == spec.steps:
            val_losses.append((i, validation_loss()))
        throughput = timed_tokens / timed_seconds if timed_seconds else 0.0
        postfix = {"loss": f"{loss:.3f}", "tok/s": f"{throughput:,.0f}"}
        if val_losses:
            postfix["val"] = f"{val_losses[-1][1]:.3f}"
        bar.set_postfix(postfix)
    bar.close()

    probe, _ = _batches(val_data, 2, spec.seq_len, np.random.default_rng(spec.seed + 2))
    mixes = model.residual_mixes(jnp.asarray(probe))
    forward_gain, backward_gain = amax_gain(mixes) if len(mixes) else (np.zeros(0), np.zeros(0))
    return {
        "name": spec.name,
        "spec": dataclasses.asdict(spec),
        "losses": losses,
        "val_losses": val_losses,
        "final_train_loss": float(np.mean(losses[-max(1, min(20, len(losses))) :])),
        "final_val_loss": val_losses[-1][1],
        "tokens_per_s": timed_tokens / timed_seconds if timed_seconds else float("nan"),
        "step_ms": 1000.0 * timed_seconds / (spec.steps - 1) if spec.steps > 1 else float("nan"),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "amax_forward": forward_gain.tolist(),
        "amax_backward": backward_gain.tolist(),
        "sample": sample_text(model, spec),
    }


def sample_text(model, spec: RunSpec) -> str:
    """spec.sample_bytes bytes after spec.prompt, temperature 0.8, within one seq_len window."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    forward = nnx.jit(lambda m, t: m(t))
    context = list(spec.prompt.encode())[-spec.seq_len :]
    key = jax.random.key(spec.seed + 3)
    generated = []
    for _ in range(spec.sample_bytes):
        window = context[-spec.seq_len :]
        padded = np.zeros((1, spec.seq_len), np.int32)
        padded[0, : len(window)] = window
        logits = forward(model, jnp.asarray(padded))[0, len(window) - 1]
        key, sub = jax.random.split(key)
        token = int(jax.random.categorical(sub, logits / 0.8))
        context.append(token)
        generated.append(token)
    return bytes(generated).decode("utf-8", errors="replace")


def _train_in_subprocess(spec: RunSpec) -> dict:
    # A fresh process per run, so each run's peak memory is its own.
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        return pool.apply(train, (spec,))
    finally:
        pool.close()  # a clean exit of the worker (terminate() would leak its semaphores)
        pool.join()


def _smoothed(values, window: int) -> np.ndarray:
    """Trailing mean over up to `window` steps (the first steps average what there is)."""
    cumulative = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - window)
    return (cumulative[ends] - cumulative[starts]) / (ends - starts)


def _colors(results: list[dict]) -> dict:
    """One color per run, the same in every panel."""
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {run["name"]: cycle[i % len(cycle)] for i, run in enumerate(results)}


def _plot_losses(ax, results: list[dict]) -> None:
    colors = _colors(results)
    window = max(1, min(len(r["losses"]) for r in results) // 20)
    upper, lower = 0.0, np.inf
    for run in results:
        steps = np.arange(1, len(run["losses"]) + 1)
        smoothed = _smoothed(run["losses"], window)
        color = colors[run["name"]]
        ax.plot(steps, run["losses"], color=color, alpha=0.15, lw=0.8)
        ax.plot(steps, smoothed, color=color, lw=1.5, label=run["name"])
        val_steps, val_loss = zip(*run["val_losses"], strict=True)
        ax.plot(val_steps, val_loss, "o", color=color, ms=4, mec="black", mew=0.5)
        upper = max(upper, smoothed[len(smoothed) // 10])
        lower = min(lower, smoothed.min(), min(val_loss))
    # The first tenth (the drop from ln 256) would flatten the differences that matter.
    if len(results[0]["losses"]) >= 20:
        ax.set_ylim(lower - 0.1 * (upper - lower), upper)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    smoothing = f"mean of {window} steps; " if window > 1 else ""
    ax.set_title(f"Training loss ({smoothing}dots: held-out)", fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _plot_amax(axes, results: list[dict]) -> None:
    """Forward and backward Amax gain per depth on two axes; a log scale once a run exceeds 10."""
    colors = _colors(results)
    runs = [r for r in results if r["amax_forward"]]
    largest = max([1.0] + [max(r["amax_forward"] + r["amax_backward"]) for r in runs])
    smallest = min([1.0] + [min(r["amax_forward"] + r["amax_backward"]) for r in runs])
    for run in runs:
        depth = np.arange(1, len(run["amax_forward"]) + 1)
        style = dict(color=colors[run["name"]], ms=3, label=run["name"])
        axes[0].plot(depth, run["amax_forward"], "o-", **style)
        axes[1].plot(depth, run["amax_backward"], "o-", **style)
    for ax, title in zip(axes, ("forward (max row sum)", "backward (max column sum)"), strict=True):
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        if largest > 10.0:  # unconstrained hyper-connections grow by orders of magnitude
            ax.set_yscale("log")
            ax.set_ylim(min(0.5, 0.8 * smallest), 2.0 * largest)
        else:
            ax.ticklabel_format(axis="y", useOffset=False)
            ax.set_ylim(0.0, max(2.0, 1.1 * largest))
        ax.set_xlabel("sublayer depth")
        ax.set_title(f"Amax gain, {title}", fontsize="medium")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("mean over tokens")
    if runs:
        axes[0].legend(fontsize="small")


def write_outputs(results: list[dict], out: Path, comparison: bool = False) -> list[str]:
    """metrics.json, metrics.csv, loss.png, amax_gain.png (and with `comparison`, comparison.png:
    the three panels side by side); returns the names written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps({"runs": results}, indent=2))
    with open(out / "metrics.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", "step", "train_loss", "val_loss"])
        for run in results:
            val = dict(run["val_losses"])
            for i, loss in enumerate(run["losses"], start=1):
                writer.writerow([run["name"], i, f"{loss:.6f}", f"{val[i]:.6f}" if i in val else ""])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    _plot_losses(ax, results)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    _plot_amax(axes, results)
    fig.tight_layout()
    fig.savefig(out / "amax_gain.png", dpi=120)
    plt.close(fig)
    written = ["metrics.json", "metrics.csv", "loss.png", "amax_gain.png"]

    if comparison:
        fig = plt.figure(figsize=(14, 4.2))
        loss_ax = fig.add_subplot(1, 3, 1)
        forward_ax = fig.add_subplot(1, 3, 2)
        backward_ax = fig.add_subplot(1, 3, 3, sharey=forward_ax)
        _plot_losses(loss_ax, results)
        _plot_amax((forward_ax, backward_ax), results)
        spec = results[0]["spec"]
        fig.suptitle(
            f"{spec['layers']} layers ({2 * spec['layers']} sublayers), width {spec['width']}, n = {spec['n']}, "
            f"lr {spec['lr']:g}, {spec['steps']} steps of {spec['batch']}x{spec['seq_len']} bytes, seed {spec['seed']}",
            fontsize="medium",
        )
        fig.tight_layout()
        fig.savefig(out / "comparison.png", dpi=90)
        plt.close(fig)
        written.append("comparison.png")
    return written


def print_summary(results: list[dict], out: Path, written: list[str]) -> None:
    """The table (each run's step time against the plain residual's, or the first run's), the
    Amax gains at the last depth and the samples."""
    reference = next((r for r in results if r["spec"]["residual"] == "plain"), results[0])
    ratio_header = f"vs {reference['name']}"
    print()
    print(
        f"{'run':15} {'residual':9} {'kernel':7} {'train loss':>10} {'val loss':>9} {'step ms':>8} "
        f"{ratio_header:>14} {'tokens/s':>10} {'peak MiB':>9} {'Amax fwd':>9} {'Amax bwd':>9}"
    )
    for run in results:
        spec = run["spec"]
        ratio = run["step_ms"] / reference["step_ms"]
        forward = f"{run['amax_forward'][-1]:9.3g}" if run["amax_forward"] else f"{'-':>9}"
        backward = f"{run['amax_backward'][-1]:9.3g}" if run["amax_backward"] else f"{'-':>9}"
        print(
            f"{run['name']:15} {spec['residual']:9} {'yes' if spec['use_kernel'] else 'no':7} "
            f"{run['final_train_loss']:10.3f} {run['final_val_loss']:9.3f} {run['step_ms']:8.1f} {ratio:13.2f}x "
            f"{run['tokens_per_s']:10,.0f} {run['peak_rss_mib']:9.0f} {forward} {backward}"
        )
    print("(Amax gains at the last sublayer; 'kernel' is the mHC sublayers' and the head's path)")
    for run in results:
        print(f"\n{run['name']} sample:\n{run['spec']['prompt']}{run['sample']}")
    print(f"\nwrote {out}/{', '.join(written)}")


# Defaults of the single run (about 3 minutes on 2 cores) and of --compare: deeper and narrower, at
# a learning rate where unconstrained hyper-connections' Amax gain grows within a few minutes.
SINGLE_DEFAULTS = dict(steps=250, batch=16, seq_len=128, width=128, layers=4, lr=3e-3)
COMPARE_DEFAULTS = dict(steps=200, batch=8, seq_len=64, width=64, layers=8, lr=1e-2)
COMPARE_RESIDUALS = ("plain", "hc", "mhc", "mhc-lite", "mhc-v4.1")
# The residuals run by mhc.flax's layers (the kernels, --recompute, --compare-paths).
MHC_RESIDUALS = ("mhc", "mhc-lite", "mhc-v4.1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mhc.demo", description=__doc__.splitlines()[0])

    def sized(flag: str, kind, help_text: str):
        key = flag[2:].replace("-", "_")
        single, compare = SINGLE_DEFAULTS[key], COMPARE_DEFAULTS[key]
        parser.add_argument(
            flag, type=kind, default=None, help=f"{help_text} (default {single}; {compare} with --compare)"
        )

    sized("--steps", int, "training steps")
    sized("--batch", int, "sequences per step")
    sized("--seq-len", int, "bytes per sequence")
    sized("--width", int, "model width D")
    sized("--layers", int, "blocks (each an attention and an MLP sublayer)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--n", type=int, default=4, help="streams of the multi-stream residuals")
    parser.add_argument(
        "--residual",
        choices=("plain", "hc", "mhc", "mhc-lite", "mhc-v4.1"),
        default="mhc",
        help="plain, unconstrained hyper-connections (hc), mHC (Sinkhorn), mHC-lite (permutations) or "
        "DeepSeek-V4.1's mHC (mhc-v4.1: each sublayer reads its input with the previous one's pre gates; "
        "no head)",
    )
    parser.add_argument(
        "--collapse",
        choices=("head", "sum"),
        default=None,
        help="n streams -> one at the end: DeepSeek-V4's learned head (default) or their plain sum; "
        "mhc-v4.1 always ends with its own (the sum by the last sublayer's pre gates) and takes neither",
    )
    parser.add_argument(
        "--use-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fused C++ kernels (default) or the plain-JAX path (--no-use-kernel)",
    )
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument(
        "--compare",
        action="store_true",
        help=f"train {', '.join(COMPARE_RESIDUALS)} from one seed, each in its own process (ignores --residual)",
    )
    modes.add_argument(
        "--compare-paths",
        action="store_true",
        help="the same mHC run on the kernels, on the kernels without the fused boundaries, and on plain JAX",
    )
    parser.add_argument(
        "--recompute",
        default=None,
        metavar="K",
        help="mHC (kernel path) keeps its streams for the backward only every K sublayers and recomputes "
        "the others with its kernels ('auto': the mHC paper's K = sqrt(n L / (n + 2)), L the sublayers); "
        "with --compare, for the mHC runs. Sets XLA's memory-minimizing CPU scheduler for this process",
    )
    sized("--lr", float, "AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=50, help="steps between held-out losses")
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--sample-bytes", type=int, default=200)
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--data", default=None, help="a text file to train on (default: Python's stdlib sources)")
    parser.add_argument("--out", default="demo_output", help="output folder")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _recompute(parser: argparse.ArgumentParser, args) -> int | None:
    """--recompute as a group size (None without it); checks it fits the runs, and selects XLA's
    memory-minimizing CPU scheduler (which recompute needs) for this process and the runs it starts."""
    if args.recompute is None:
        return None
    if not (args.compare or args.residual in MHC_RESIDUALS) or not args.use_kernel:
        parser.error(
            "--recompute rebuilds mHC's streams with its kernels: use --residual mhc, mhc-lite or mhc-v4.1 "
            "(or --compare), with the kernels"
        )
    if args.recompute != "auto" and not (args.recompute.isdigit() and int(args.recompute) >= 1):
        parser.error(f"--recompute: expected a group size K >= 1 (sublayers) or 'auto', got {args.recompute!r}")
    flag = "--xla_cpu_enable_concurrency_optimized_scheduler=false"  # mhc.jax.CPU_MEMORY_SCHEDULER_FLAG
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:
        # Read when XLA starts: in time for the runs (each --compare run is a new process; a single
        # run imports JAX after this). Without it XLA's CPU scheduler keeps every stream all the same.
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
        print(f"--recompute: XLA_FLAGS += {flag} (XLA's memory-minimizing CPU scheduler)", file=sys.stderr)
    if args.recompute == "auto":
        from mhc.jax import suggested_recompute  # imports JAX: after XLA_FLAGS is set

        return suggested_recompute(args.n, 2 * args.layers)
    return int(args.recompute)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    defaults = COMPARE_DEFAULTS if args.compare else SINGLE_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.batch < 1 or args.seq_len < 2:
        parser.error("--steps and --batch must be >= 1, --seq-len >= 2")
    if args.compare_paths and args.residual not in MHC_RESIDUALS:
        parser.error("--compare-paths switches the mHC kernels: use --residual mhc, mhc-lite or mhc-v4.1")
    if args.collapse is not None and args.residual == "mhc-v4.1" and not args.compare:
        parser.error(
            "--collapse: mhc-v4.1 ends with its own collapse (the sum by the last sublayer's pre gates), "
            "not a head or a plain sum"
        )
    recompute = _recompute(parser, args)

    base = dict(
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        width=args.width,
        layers=args.layers,
        heads=args.heads,
        n=args.n,
        lr=args.lr,
        seed=args.seed,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        sample_bytes=args.sample_bytes,
        prompt=args.prompt,
        data=args.data,
        progress=not args.no_progress,
    )
    if args.compare:
        specs = [
            RunSpec(
                name=f"{kind}-k{recompute}" if recompute and kind in MHC_RESIDUALS else kind,
                residual=kind,
                use_kernel=args.use_kernel,
                recompute=recompute if kind in MHC_RESIDUALS else None,
                # --collapse is the V4 kinds'; mhc-v4.1's own collapse is part of its structure.
                collapse=None if kind == "mhc-v4.1" else args.collapse,
                **base,
            )
            for kind in COMPARE_RESIDUALS
        ]
        results = [_train_in_subprocess(spec) for spec in specs]
    elif args.compare_paths:
        base["collapse"] = args.collapse
        specs = [
            RunSpec(name="kernel", residual=args.residual, use_kernel=True, recompute=recompute, **base),
            RunSpec(
                name="kernel-unfused",
                residual=args.residual,
                use_kernel=True,
                fuse_boundaries=False,
                recompute=recompute,
                **base,
            ),
            RunSpec(name="plain-jax", residual=args.residual, use_kernel=False, **base),
        ]
        results = [_train_in_subprocess(spec) for spec in specs]
    else:
        name = (
            args.residual
            if args.residual in ("plain", "hc")
            else f"{args.residual}-{'kernel' if args.use_kernel else 'jax'}"
        )
        if recompute:
            name += f"-k{recompute}"
        base["collapse"] = args.collapse
        spec = RunSpec(name=name, residual=args.residual, use_kernel=args.use_kernel, recompute=recompute, **base)
        results = [train(spec)]
    out = Path(args.out)
    written = write_outputs(results, out, comparison=args.compare)
    print_summary(results, out, written)
    return 0


if __name__ == "__main__":
    sys.exit(main())

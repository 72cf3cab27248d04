"""What mHC costs in memory per training step, and what recomputing its streams in groups gives
back (issue 29): the demo's V4-shaped model (mhc.models.Transformer, 8 blocks = 16 sublayers,
n = 4) at two widths, f32 and bf16, for the plain residual, mHC keeping every stream, and mHC
recomputing them in groups of k (2, 4 and mhc.jax.suggested_recompute's).

Per configuration, each in its own process (peak RSS is per process): XLA's memory analysis of the
compiled step (value_and_grad of the loss: temporaries, arguments, outputs), the process's peak RSS
(resource.getrusage maxrss, after compiling and running), and the median time of the timed steps.
"mHC adds" is mHC's temporaries less the plain residual's at the same width and dtype, the plain
model run under the same checkpoints as mHC's recompute groups (``plain_grouped_loss``: nothing
recomputed, but XLA keeps different buffers for the branches across a checkpoint's barrier), so
each k is compared with like; "of no-recompute's" is that as a share of what mHC adds without
recompute (against the plain model without checkpoints).

    .venv/bin/python bench/recompute_memory.py                    # XLA's memory scheduler (the default here)
    .venv/bin/python bench/recompute_memory.py --scheduler default  # XLA's CPU default (concurrency-optimized)
    .venv/bin/python bench/recompute_memory.py --interleaved         # step times side by side, one process

Separate processes run at different times, so on a shared machine their step times drift apart;
``--interleaved`` compiles mHC without recompute and with each k in one process and times them
in turns (one step each, round after round): the median per-round ratio is the time cost.

Recompute needs XLA's memory-minimizing CPU scheduler: under the default one XLA runs the
recomputation right after the forward (mhc.jax.recompute_streams). The scheduler is chosen by
XLA_FLAGS when each subprocess starts.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"  # mhc.jax.CPU_MEMORY_SCHEDULER_FLAG


def measure(width: int, dtype: str, residual: str, recompute: int | None, batch: int, seq: int, steps: int) -> dict:
    """One configuration, in this process: the memory analysis, peak RSS and step times."""
    import resource

    import jax
    import numpy as np
    from flax import nnx

    from mhc.models import ModelConfig, Transformer, loss_fn

    grouped_plain = residual == "plain" and recompute is not None
    config = ModelConfig(
        width=width,
        layers=8,
        heads=4,
        n=4,
        residual=residual,
        recompute=None if grouped_plain else recompute,
        dtype=dtype,
        collapse="head",
    )
    model = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    loss = functools.partial(plain_grouped_loss, group=recompute) if grouped_plain else loss_fn

    def step(params, tokens, targets):
        return jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p), tokens, targets))(params)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (batch, seq), dtype=np.int32)
    targets = rng.integers(0, 256, (batch, seq), dtype=np.int32)
    compiled = jax.jit(step).lower(params, tokens, targets).compile()
    memory = compiled.memory_analysis()
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss, grads = compiled(params, tokens, targets)
        jax.block_until_ready(grads)
        times.append(time.perf_counter() - start)
    return {
        "width": width,
        "dtype": dtype,
        "residual": residual,
        "recompute": recompute,
        "temp_mib": memory.temp_size_in_bytes / 2**20,
        "argument_mib": memory.argument_size_in_bytes / 2**20,
        "output_mib": memory.output_size_in_bytes / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_ms": 1000 * float(np.median(times[1:])),  # the first call's time is dropped
        "loss": float(loss),
    }


def plain_grouped_loss(model, tokens, targets, *, group: int):
    """The plain residual's loss with its sublayers under the checkpoints mHC's recompute puts
    around groups of ``group`` sublayers (``nnx.remat``), saving everything (nothing is recomputed):
    the baseline for what mHC with recompute adds. The checkpoint's barrier changes what XLA keeps
    for the branches themselves (docs/performance.md), so mHC with recompute measured against the
    unchecked plain model would credit mHC with the branches' savings."""
    import jax
    from flax import nnx

    from mhc.models import cross_entropy

    sublayers = [
        pair for block in model.blocks for pair in ((block.attn_norm, block.attn), (block.mlp_norm, block.mlp))
    ]

    def run(modules, h):
        for norm, branch in modules:
            h = h + branch(norm(h))
        return h

    grouped = nnx.remat(run, policy=jax.checkpoint_policies.everything_saveable)
    h = model.embed(tokens)
    for start in range(0, len(sublayers), group):
        h = grouped(sublayers[start : start + group], h)
    return cross_entropy(model.head(model.final_norm(h)), targets)


def interleaved(width: int, dtype: str, ks: list, batch: int, seq: int, rounds: int) -> list:
    """mHC's step without recompute and with each k, compiled in this process and timed in turns."""
    import jax
    import numpy as np
    from flax import nnx

    from mhc.models import ModelConfig, Transformer, loss_fn

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (batch, seq), dtype=np.int32)
    steps = {}
    for k in [None, *ks]:
        config = ModelConfig(width=width, layers=8, heads=4, n=4, recompute=k, dtype=dtype)
        graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))

        def step(params, tokens, graphdef=graphdef):
            return jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), tokens, tokens))(params)

        compiled = jax.jit(step).lower(params, tokens).compile()
        jax.block_until_ready(compiled(params, tokens))  # untimed
        steps[k] = (compiled, params)
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for k, (compiled, params) in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(params, tokens))
            times[k].append(time.perf_counter() - start)
    kept = np.array(times[None])
    return [
        {
            "width": width,
            "dtype": dtype,
            "recompute": k,
            "step_ms": 1000 * float(np.median(t)),
            "ratio": float(np.median(np.array(t) / kept)),
        }
        for k, t in times.items()
    ]


def _configurations(suggested: int) -> list:
    """Per recompute group size k, the plain residual under the same checkpoints beside mHC."""
    runs = []
    for k in [None, *sorted({2, 4, suggested, 16})]:
        runs += [("plain", k), ("mhc", k)]
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (after one untimed)")
    parser.add_argument("--scheduler", choices=("memory", "default"), default="memory")
    parser.add_argument("--interleaved", action="store_true", help="only the step times, side by side (see above)")
    parser.add_argument("--rounds", type=int, default=7, help="--interleaved: steps of each configuration")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a subprocess's configuration
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(**json.loads(args.one))))
        return 0

    from mhc.jax import suggested_recompute

    suggested = suggested_recompute(4, 16)
    if args.interleaved:
        if MEMORY_SCHEDULER_FLAG not in os.environ.get("XLA_FLAGS", "") and args.scheduler == "memory":
            raise SystemExit(f"--interleaved runs in this process: start it with XLA_FLAGS={MEMORY_SCHEDULER_FLAG}")
        print(f"mHC step time, {args.batch} x {args.seq} tokens, median of {args.rounds} rounds, one process")
        print("| D | dtype | k | step ms | per-round ratio to no recompute |")
        print("|---|---|---|---|---|")
        for dtype in args.dtypes:
            for width in args.widths:
                ks = sorted({2, 4, suggested})
                for row in interleaved(width, dtype, ks, args.batch, args.seq, args.rounds):
                    k = "-" if row["recompute"] is None else row["recompute"]
                    print(f"| {width} | {dtype} | {k} | {row['step_ms']:.0f} | {row['ratio']:.2f}x |", flush=True)
        return 0
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").replace(MEMORY_SCHEDULER_FLAG, "")
    env["XLA_FLAGS"] = f"{flags} {MEMORY_SCHEDULER_FLAG}" if args.scheduler == "memory" else flags
    rows = []
    for dtype in args.dtypes:
        for width in args.widths:
            for residual, recompute in _configurations(suggested):
                spec = dict(
                    width=width,
                    dtype=dtype,
                    residual=residual,
                    recompute=recompute,
                    batch=args.batch,
                    seq=args.seq,
                    steps=args.steps,
                )
                command = [sys.executable, __file__, "--one", json.dumps(spec)]
                result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                if result.returncode:
                    raise SystemExit(f"{spec}: failed\n{result.stderr[-3000:]}")
                rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    _print_table(rows, args, suggested)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "rows": rows}, handle, indent=2)
    return 0


def _print_table(rows: list, args, suggested: int) -> None:
    print(
        f"16 sublayers, n = 4, {args.batch} x {args.seq} tokens, value_and_grad per step, "
        f"{args.scheduler} scheduler; suggested k = {suggested}; MiB, ms (median of {args.steps})"
    )
    print(
        "| D | dtype | residual | k | XLA temp | arguments | mHC adds (temp) | of no-recompute's | "
        "peak RSS | step ms | vs no recompute |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        same = [r for r in rows if r["width"] == row["width"] and r["dtype"] == row["dtype"]]
        plain = next(r for r in same if r["residual"] == "plain" and r["recompute"] == row["recompute"])
        unchecked_plain = next(r for r in same if r["residual"] == "plain" and r["recompute"] is None)
        kept = next(r for r in same if r["residual"] == "mhc" and r["recompute"] is None)
        adds = row["temp_mib"] - plain["temp_mib"]
        kept_adds = kept["temp_mib"] - unchecked_plain["temp_mib"]
        mhc = row["residual"] == "mhc"
        share = f"{100 * adds / kept_adds:.0f}%" if mhc and kept_adds > 0 else "-"
        time_ratio = f"{row['step_ms'] / kept['step_ms']:.2f}x" if mhc else "-"
        k = "-" if row["recompute"] is None else str(row["recompute"])
        print(
            f"| {row['width']} | {row['dtype']} | {row['residual']} | {k} | {row['temp_mib']:.1f} | "
            f"{row['argument_mib']:.1f} | {adds:.1f} | {share} | {row['peak_rss_mib']:.0f} | "
            f"{row['step_ms']:.0f} | {time_ratio} |"
        )


if __name__ == "__main__":
    sys.exit(main())

"""What --compile, --activation-checkpointing and --channels-last buy and cost on this machine.

    python bench/bench_tuning.py                 # 3 interleaved repeats on CPU, ~5 minutes (compiling is most of it)
    python bench/bench_tuning.py --repeats 5     # on a GPU the same command times the GPU

The ddp_monitored recipe at world size 1 (one process, no launcher), each variant in turn, the order
rotated every repeat; the table shows the median steady-state step time (the recipe's own step_ms,
averaged over the train records from --warmup to --steps) and, on a GPU, the peak memory of allocated
tensors the recipe logs (on CPU only the process's lifetime peak RSS, which says nothing per variant).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.kernel.train import cleanup_pg, init_pg  # noqa: E402
from recipes import ddp_monitored  # noqa: E402  (the tuning options are ddp_monitored's)

# (label, ddp_monitored Config changes); batch sizes where the option has work to do
VARIANTS = [
    ("mlp", {"model": "mlp", "data": "synthetic"}),
    ("mlp --activation-checkpointing", {"model": "mlp", "data": "synthetic", "activation_checkpointing": True}),
    ("mlp --compile", {"model": "mlp", "data": "synthetic", "compile": True}),
    ("gpt", {"model": "gpt", "data": "text"}),
    ("gpt --activation-checkpointing", {"model": "gpt", "data": "text", "activation_checkpointing": True}),
    ("gpt --compile", {"model": "gpt", "data": "text", "compile": True}),
    ("cnn", {"model": "cnn", "data": "synthetic"}),
    ("cnn --channels-last", {"model": "cnn", "data": "synthetic", "channels_last": True}),
]


def measure(changes: dict, args, topo) -> tuple[float, float]:
    """(seconds per steady-state step, peak memory MB) of one ddp_monitored run with `changes`."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # this variant's peak, not the process's so far
    with tempfile.TemporaryDirectory() as out:
        cfg = ddp_monitored.Config(
            max_steps=args.steps, epochs=100, log_every=10, hang_factor=0, out=out, name="bench", **changes
        )
        stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # the table, not the recipe's lines
        try:
            ddp_monitored.train(cfg, topo)
        finally:
            sys.stdout.close()
            sys.stdout = stdout
        records = [json.loads(line) for line in (Path(out) / "bench-1" / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["kind"] == "train" and r["step"] > args.warmup]  # compiling is the first steps
    return statistics.mean(r["step_ms"] for r in steady) / 1e3, max(r["peak_mem_mb"] for r in steady)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    topo = init_pg(timeout_s=300)  # a world of one: DDP as the recipe runs it, no network
    results: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(VARIANTS))}
    try:
        for repeat in range(args.repeats):
            order = [(i + repeat) % len(VARIANTS) for i in range(len(VARIANTS))]
            for i in order:
                results[i].append(measure(VARIANTS[i][1], args, topo))
                print(f"repeat {repeat + 1}: {VARIANTS[i][0]}: {results[i][-1][0] * 1e3:.2f} ms/step", file=sys.stderr)
    finally:
        cleanup_pg()
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"\nddp_monitored, 1 process on {where}, steps {args.warmup}-{args.steps}, median of {args.repeats} "
        f"interleaved repeats (torch {torch.__version__})\n"
    )
    print("| variant | step ms | vs plain | peak memory MB |")
    print("|---|---|---|---|")
    base = {}
    for i, (label, _) in enumerate(VARIANTS):
        step = statistics.median(r[0] for r in results[i])
        base.setdefault(label.split()[0], step)
        memory = statistics.median(r[1] for r in results[i])
        shown = f"{memory:.0f}" if torch.cuda.is_available() else "-"  # CPU: a lifetime RSS peak, not this run's
        print(f"| {label} | {step * 1e3:.2f} | {step / base[label.split()[0]]:.2f} | {shown} |")


if __name__ == "__main__":
    main()

"""What --compile, --activation-checkpointing and --channels-last buy and cost on this machine.

    python bench/bench_tuning.py                 # 3 interleaved repeats on CPU, ~5 minutes (compiling is most of it)
    python bench/bench_tuning.py --repeats 5     # on a GPU the same command times the GPU

The ddp recipe at world size 1 (one process, no launcher), each variant in turn, the order rotated
every repeat; the table shows the median steady-state step time (rank 0's clock between the log
points at --warmup and --steps) and, on a GPU, the peak memory of allocated tensors the recipe logs
(on CPU the recipe can only log the process's lifetime peak RSS, which says nothing per variant).
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

from loguru import logger  # noqa: E402

from core import dist  # noqa: E402
from core.run import Run  # noqa: E402
from recipes import ddp_monitored as ddp  # noqa: E402  (the tuning options are ddp_monitored's)

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
    """(seconds per steady-state step, peak memory MB) of one ddp run with `changes`."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # this variant's peak, not the process's so far
    with tempfile.TemporaryDirectory() as out:
        cfg = ddp.Config(max_steps=args.steps, epochs=100, log_every=10, out=out, name="bench", **changes)
        stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # the table, not the summary line
        try:
            with Run.start(cfg, topo, recipe="ddp_monitored", global_batch=cfg.batch_size * topo.world_size) as run:
                ddp.train(cfg, topo, run)
        finally:
            sys.stdout.close()
            sys.stdout = stdout
        records = [json.loads(line) for line in (Path(out) / "bench-1" / "metrics.jsonl").read_text().splitlines()]
    at = {r["step"]: r for r in records if r["kind"] == "train"}
    return (at[args.steps]["elapsed_s"] - at[args.warmup]["elapsed_s"]) / (args.steps - args.warmup), at[args.steps][
        "peak_mem_mb"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    topo = dist.init_pg()  # a world of one: DDP as the recipe runs it, no network
    results: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(VARIANTS))}
    try:
        for repeat in range(args.repeats):
            order = [(i + repeat) % len(VARIANTS) for i in range(len(VARIANTS))]
            for i in order:
                logger.disable("core"), logger.disable("recipes")
                results[i].append(measure(VARIANTS[i][1], args, topo))
                print(f"repeat {repeat + 1}: {VARIANTS[i][0]}: {results[i][-1][0] * 1e3:.2f} ms/step", file=sys.stderr)
    finally:
        dist.cleanup_pg()
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"\nddp recipe, 1 process on {where}, steps {args.warmup}-{args.steps}, median of {args.repeats} "
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

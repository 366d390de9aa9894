"""What the ddp recipe costs over a hand-written DDP loop, what ddp_monitored's monitoring adds, what each
communication option buys, and how 2 ranks scale over 1. One command, everything side by side in one run:

    python bench/bench_overhead.py                      # 5 interleaved repeats, ~5 minutes on 2 cores
    python bench/bench_overhead.py --repeats 5 --steps 160 --model mlp --data synthetic

Each repeat starts a fresh gloo world per world size (spawned processes, OMP_NUM_THREADS=1, one
core per rank on this machine) that trains the same model on the same data for --steps steps with
every variant in turn; the steady-state step time is rank 0's wall clock between the log points at
--warmup and --steps (both right after a collective, so every rank has reached them): the median
over its 10-step windows of seconds per step. The order of the variants rotates from repeat to
repeat and the table shows medians over repeats, so a neighbour's load hits every variant alike.

Ratios are step-time ratios (lower is better): ddp recipe / hand-written (the goal: <= 1.03), ddp_monitored
/ ddp recipe (the step clock's hooks, the watchdog's beat, the breakdown's gather every 10 steps), option /
ddp_monitored defaults; scaling efficiency = samples/s at 2 ranks / (2 x samples/s at 1 rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.kernel.train import Topology  # noqa: E402
from core.plugins import watchdog  # noqa: E402
from core.plugins.factories import DATASETS  # noqa: E402
from tools.precheck import call_checked, check_model  # noqa: E402

# (label, world size, runner, Config changes): ddp_monitored's comm options as their CLI flags
VARIANTS = [
    ("hand-written DDP loop", 2, "hand", {}),
    ("ddp recipe", 2, "ddp", {}),
    ("ddp_monitored (defaults)", 2, "ddp_monitored", {}),
    ("--comm-hook fp16", 2, "ddp_monitored", {"comm_hook": "fp16"}),
    ("--comm-hook powersgd", 2, "ddp_monitored", {"comm_hook": "powersgd"}),
    ("--bucket-mb 1", 2, "ddp_monitored", {"bucket_mb": 1.0}),
    ("--bucket-mb 100", 2, "ddp_monitored", {"bucket_mb": 100.0}),
    ("--grad-as-bucket-view", 2, "ddp_monitored", {"grad_as_bucket_view": True}),
    ("--static-graph", 2, "ddp_monitored", {"static_graph": True}),
    ("hand-written DDP loop", 1, "hand", {}),
    ("ddp recipe", 1, "ddp", {}),
    ("ddp_monitored (defaults)", 1, "ddp_monitored", {}),
]


def hand_loop(topo: Topology, args, marks: list[float]) -> None:
    """What one would write by hand: DDP, DistributedSampler, AdamW + cosine, a reduced loss every 10 steps."""
    torch.manual_seed(0)
    train_set = call_checked(args.data, DATASETS, option="--data")[0]
    model = torch.nn.parallel.DistributedDataParallel(check_model(args.model))
    sampler = torch.utils.data.DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    step, loss_sum = 0, torch.zeros(())
    for epoch in range(100):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach()
            step += 1
            if step % 10 == 0:  # the log line a hand-written loop prints: one all-reduce
                dist.all_reduce(loss_sum)
                loss_sum.zero_()
                marks.append((step, time.perf_counter(), time.process_time()))
            if step == args.steps:
                return


def recipe_run(topo: Topology, args, runner: str, changes: dict, marks: list, out: str) -> None:
    """The recipe's own train, its train records observed at the same points as the hand loop's marks."""
    from recipes import ddp, ddp_monitored

    recipe = {"ddp": ddp, "ddp_monitored": ddp_monitored}[runner]
    cfg = recipe.Config(
        model=args.model,
        data=args.data,
        batch_size=args.batch_size,
        max_steps=args.steps,
        epochs=100,
        log_every=10,
        out=out,
        name="bench",
        **changes,
    )
    log_train = recipe.log_train  # the kernel's, as the recipe imported it

    def observed(run, window, *, step, **fields):  # after the record's collective, as the hand loop's all-reduce
        log_train(run, window, step=step, **fields)
        marks.append((step, time.perf_counter(), time.process_time()))

    stdout, sys.stdout, recipe.log_train = sys.stdout, open(os.devnull, "w"), observed  # the table, not its lines
    try:
        recipe.train(cfg, topo)
    finally:
        sys.stdout.close()
        sys.stdout, recipe.log_train = stdout, log_train


def worker(rank, world_size, store_path, variants, args, result_dir):
    """One gloo world that runs `variants` (indices into VARIANTS) one after another, in that order."""
    os.environ.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    watchdog.prepare_env(watchdog=True)  # as ddp_monitored's main() does before init_pg (every variant gets it)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world_size),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
    )
    topo = Topology(rank, world_size, torch.device("cpu"))
    try:
        for i in variants:
            _, _, runner, changes = VARIANTS[i]
            marks: list = []
            out = Path(result_dir) / f"run-{i}"
            if runner == "hand":
                hand_loop(topo, args, marks)
            else:
                recipe_run(topo, args, runner, changes, marks, str(out))
            if rank == 0:
                (Path(result_dir) / f"{i}.json").write_text(json.dumps(steady_step_s(marks, warmup=args.warmup)))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def steady_step_s(marks: list[tuple[int, float, float]], *, warmup: int) -> list[float]:
    """[wall, CPU] seconds per step: medians over the 10-step windows after `warmup`, so a neighbour's burst
    of load spoils a window or two, not the estimate. CPU time (this process, all its threads) is what the
    code itself costs; it hardly moves when other jobs share the cores, where wall time does."""
    marks = sorted(m for m in marks if m[0] >= warmup)
    windows = list(zip(marks, marks[1:]))
    return [statistics.median((b[k] - a[k]) / (b[0] - a[0]) for a, b in windows) for k in (1, 2)]


def measure(world_size: int, variants: list[int], args) -> dict[int, list[float]]:
    """[wall, CPU] seconds per steady-state step of each variant, in one fresh world of `world_size` ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            worker,
            nprocs=world_size,
            start_method="spawn",
            join=True,
            args=(world_size, str(Path(tmp) / "store"), variants, args, tmp),
        )
        return {i: json.loads((Path(tmp) / f"{i}.json").read_text()) for i in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--data", default="synthetic")
    args = parser.parse_args()
    times: dict[int, list[list[float]]] = {i: [] for i in range(len(VARIANTS))}  # [wall, cpu] per repeat
    for repeat in range(args.repeats):
        for world in (2, 1):
            mine = [i for i, v in enumerate(VARIANTS) if v[1] == world]
            order = mine[repeat % len(mine) :] + mine[: repeat % len(mine)]  # rotated: no variant always first
            for i, (wall, cpu) in measure(world, order, args).items():
                times[i].append([wall, cpu])
                print(
                    f"repeat {repeat + 1}/{args.repeats}: {VARIANTS[i][0]} x{world}: {wall * 1e3:.2f} ms/step, "
                    f"CPU {cpu * 1e3:.2f} ms/step",
                    file=sys.stderr,
                    flush=True,
                )
    report(times, args)


def report(times: dict[int, list[list[float]]], args) -> None:
    """Medians over repeats; each ratio is the median of per-repeat ratios of runs made in the same world,
    one after the other, so slow drifts in the machine's load cancel."""
    index = {(label, world): i for i, (label, world, _, _) in enumerate(VARIANTS)}
    hand = {w: index[("hand-written DDP loop", w)] for w in (1, 2)}
    recipe = {w: index[("ddp recipe", w)] for w in (1, 2)}
    monitored = {w: index[("ddp_monitored (defaults)", w)] for w in (1, 2)}

    def med(i: int, k: int) -> float:
        return statistics.median(t[k] for t in times[i])

    def ratio(i: int, base: int, k: int) -> float:
        return statistics.median(a[k] / b[k] for a, b in zip(times[i], times[base]))

    print(
        f"\n{args.model} on {args.data}, batch {args.batch_size} per rank, gloo on CPU (one thread per rank), "
        f"steps {args.warmup}-{args.steps}, {args.repeats} interleaved repeats (torch {torch.__version__})\n"
    )
    print("| variant | ranks | wall ms/step | samples/s | wall ratio | CPU ms/step (rank 0) | CPU ratio | against |")
    print("|---|---|---|---|---|---|---|---|")
    for i, (label, world, runner, _) in enumerate(VARIANTS):
        base = {"hand": None, "ddp": hand[world]}.get(
            runner, recipe[world] if i == monitored[world] else monitored[world]
        )
        shown = ["-", "-"] if base is None else [f"{ratio(i, base, k):.3f}" for k in (0, 1)]
        against = "-" if base is None else VARIANTS[base][0]
        print(
            f"| {label} | {world} | {med(i, 0) * 1e3:.2f} | {args.batch_size * world / med(i, 0):.0f} | {shown[0]} "
            f"| {med(i, 1) * 1e3:.2f} | {shown[1]} | {against} |"
        )
    for name, runs in (("hand-written", hand), ("ddp recipe", recipe), ("ddp_monitored", monitored)):
        print(f"\nscaling efficiency 1 -> 2 ranks (wall), {name}: {med(runs[1], 0) / med(runs[2], 0):.2f}", end="")
    print(
        f"\nddp recipe over hand-written at 2 ranks: wall {ratio(recipe[2], hand[2], 0):.3f}, "
        f"CPU {ratio(recipe[2], hand[2], 1):.3f} (goal <= 1.03); ddp_monitored over ddp: wall "
        f"{ratio(monitored[2], recipe[2], 0):.3f}, CPU {ratio(monitored[2], recipe[2], 1):.3f}"
    )
    print(
        "per-repeat wall ms/step: "
        + "; ".join(
            f"{VARIANTS[i][0]} x{VARIANTS[i][1]}: " + " ".join(f"{t[0] * 1e3:.1f}" for t in times[i]) for i in times
        )
    )


if __name__ == "__main__":
    main()

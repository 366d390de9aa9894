"""The memory plan against measurement: every recipe with the models it takes, at 1 and 2 ranks.

    python bench/bench_plan.py                 # CPU: gloo worlds of 1 and 2 processes; a table, one JSON line a row
    torchrun --nproc-per-node 1 bench/bench_plan.py --gpu     # on a GPU (bench/gpu_check.sh runs it)

CPU: for each case of tests/plan_models.py's MATRIX, `python -m recipes plan`'s peak per rank against the peak of
live tensors torch's MemTracker sees over two real training steps of the recipe's own step (tools/plan_measure.py).
GPU: the same plans (for GPUs: AdamW's foreach step, 512-byte allocations) against MemTracker and against
torch.cuda.max_memory_allocated, and the fixed terms no tracker sees, measured on this device: the CUDA context,
NCCL's buffers (the memory the first all-reduce takes) and the allocator's slack (reserved minus allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from plan_models import MATRIX  # noqa: E402

from core.kernel.train import cleanup_pg, init_pg  # noqa: E402
from tools.options import parse_args  # noqa: E402
from tools.plan import plan_recipe  # noqa: E402
from tools.plan_measure import measure  # noqa: E402
from tools.registry import RECIPES  # noqa: E402

MIB = 2**20


def label(args: list[str]) -> tuple[str, str]:
    model = args[args.index("--model") + 1].removeprefix("plan_models:")
    rest = [a for i, a in enumerate(args) if a not in ("--model", "--data", "--batch-size") and i and
            args[i - 1] not in ("--model", "--data", "--batch-size")]  # fmt: skip
    return model, " ".join(rest)


def planned(size: int, *, gpu: bool) -> list[tuple[str, list[str], list[int]]]:
    rows = []
    for name, args in MATRIX[size]:
        cfg = parse_args(RECIPES[name].load().Config, args, prog=name)[0]
        rows.append((name, args, [r.peak_bytes for r in plan_recipe(name, cfg, world_size=size, gpu=gpu).ranks]))
    return rows


def print_row(row: dict) -> None:
    cells = [row["recipe"], row["model"], row["options"] or "-", str(row["ranks"]), str(row["rank"])]
    numbers = [f"{row[k] / MIB:.2f}" for k in ("plan", "measured") + (("allocated",) if "allocated" in row else ())]
    slack = [f"{row['slack'] / MIB:.1f}"] if "slack" in row else []
    print("| " + " | ".join(cells + numbers + [f"{row['error']:+.1%}"] + slack) + " |", flush=True)


def cpu() -> None:
    from world import GlooWorld

    print("| recipe | model | options | ranks | rank | plan MiB | MemTracker MiB | plan - measured |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for size in (1, 2):
        plans = planned(size, gpu=False)
        with GlooWorld(size, timeout_s=300) as world:
            for name, args, peaks in plans:
                for rank, got in enumerate(world.run(measure, name, args)):
                    model, options = label(args)
                    row = {"recipe": name, "model": model, "options": options, "ranks": size, "rank": rank}
                    row |= {"plan": peaks[rank], "measured": got["peak_bytes"]}
                    row["error"] = peaks[rank] / got["peak_bytes"] - 1
                    print_row(row)
                    rows.append(row)
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"\n{len(rows)} rows; the largest difference: {worst['error']:+.1%} ({worst['recipe']} {worst['model']})")
    for row in rows:
        print(json.dumps(row))


def gpu() -> None:
    """Under torchrun, one process per GPU (or two sharing one over gloo): plans first, then the fixed terms and
    the measurements on this device."""
    import torch

    size = int(os.environ.get("WORLD_SIZE", "1"))
    plans = planned(size, gpu=True) if int(os.environ.get("RANK", "0")) == 0 else []
    topo = init_pg(timeout_s=600)
    torch.empty(1, device=topo.device)  # the CUDA context exists from here
    free1, total = torch.cuda.mem_get_info(topo.device)
    context = total - free1 - torch.cuda.memory_reserved(topo.device)  # on an otherwise idle GPU: the context
    torch.distributed.all_reduce(torch.ones(1, device=topo.device))  # NCCL makes its buffers at the first collective
    torch.cuda.synchronize(topo.device)
    nccl = free1 - torch.cuda.mem_get_info(topo.device)[0] - torch.cuda.memory_reserved(topo.device)
    results = [measure(topo, name, args) for name, args, _ in plans or [(n, a, None) for n, a in MATRIX[size]]]
    if topo.rank == 0:
        print(f"fixed terms on {torch.cuda.get_device_name(topo.device)} ({total / 2**30:.0f} GiB), {topo.backend}: "
              f"CUDA context {context / MIB:.0f} MiB, NCCL buffers {nccl / MIB:.0f} MiB")  # fmt: skip
        print("| recipe | model | options | ranks | rank | plan MiB | MemTracker MiB | max_memory_allocated MiB | "
              "plan - allocated | slack MiB |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for (name, args, peaks), got in zip(plans, results):
            model, options = label(args)
            row = {"recipe": name, "model": model, "options": options, "ranks": size, "rank": 0, "plan": peaks[0]}
            row |= {"measured": got["peak_bytes"], "allocated": got["cuda_peak_bytes"]}
            row["error"] = peaks[0] / got["cuda_peak_bytes"] - 1
            row["slack"] = got["cuda_reserved_bytes"] - got["cuda_peak_bytes"]
            print_row(row)
            print(json.dumps(row | {"context": context, "nccl": nccl}))
    cleanup_pg()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="measure on this machine's GPUs (run under torchrun)")
    (gpu if parser.parse_args().gpu else cpu)()

"""Step-time ratios of the ddp_amp recipe's tools, measured side by side in one run.

    python bench/bench_amp_accum.py                    # 2 CPU ranks, the MLP defaults, K=4
    python bench/bench_amp_accum.py --nproc 2 --k 4 --rounds 15 --steps 4

Two ranks (gloo on CPU, nccl when each has a GPU) train the default MLP on random data shaped like
digits. The settings take turns, round after round, so drift in the machine's load hits them
alike. Each setting's time per optimizer step is printed as the fastest round (the least
disturbed by other load on the machine) and the median round. Printed:
  accumulation: K micro-batches per step with no_sync on the first K-1 vs an all-reduce after
                every micro-batch (the same gradients: only the communication differs);
  precision:    bf16 autocast vs fp32, one micro-batch per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # run from a checkout without installing; the tests' free_port

from core import accum, amp  # noqa: E402
from core.exact_loss import make_exact_loss  # noqa: E402
from core.kernel.loss import Loss  # noqa: E402
from core.kernel.train import cleanup_pg, init_pg  # noqa: E402
from helpers import free_port  # noqa: E402
from tools.precheck import check_model  # noqa: E402


def always_sync(model, *, enabled):
    return amp.grad_sync(model, enabled=True)  # all-reduce after every micro-batch: accumulation without no_sync


SETTINGS = {  # name: (precision, micro-batches per step, sync)
    "accum no_sync": ("fp32", None, amp.grad_sync),
    "accum sync every micro-batch": ("fp32", None, always_sync),
    "fp32": ("fp32", 1, amp.grad_sync),
    "bf16": ("bf16", 1, amp.grad_sync),
}


def timed_steps(model, optimizer, batches, *, precision: str, sync, n: int) -> float:
    """Seconds per optimizer step over n steps, every rank starting and ending together."""
    torch_dist.barrier()
    started = time.perf_counter()
    loss_fn = make_exact_loss(Loss(), model=model.module)
    for _ in range(n):
        accum.step_amp(model, batches, optimizer=optimizer, loss_fn=loss_fn, precision=precision, sync=sync)
    torch_dist.barrier()
    return (time.perf_counter() - started) / n


def worker(rank: int, args, port: int, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)  # as torchrun sets them: init_pg reads its environment
    topo = init_pg(timeout_s=120)
    try:
        torch.manual_seed(0)
        model = check_model(args.model).to(topo.device)
        model = DistributedDataParallel(model, device_ids=[topo.device.index] if topo.device.type == "cuda" else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(rank)
        batches = [
            (
                torch.rand(args.batch_size, 64, generator=gen).to(topo.device),
                torch.randint(10, (args.batch_size,), generator=gen).to(topo.device),
            )
            for _ in range(args.k)
        ]
        times = {name: [] for name in SETTINGS}
        for precision, k, sync in SETTINGS.values():  # warm-up: allocator, autocast caches, buckets
            timed_steps(model, optimizer, batches[:k], precision=precision, sync=sync, n=2)
        for _ in range(args.rounds):
            for name, (precision, k, sync) in SETTINGS.items():
                times[name].append(
                    timed_steps(model, optimizer, batches[:k], precision=precision, sync=sync, n=args.steps)
                )
        if rank == 0:
            results.put({name: (min(t), statistics.median(t)) for name, t in times.items()})
    finally:
        cleanup_pg()


def report(times: dict[str, tuple[float, float]], args) -> str:
    """The table and the two ratios, each from the fastest rounds and from the median rounds."""
    lines = [
        f"{args.nproc} ranks, model {args.model}, batch {args.batch_size}/rank, {args.rounds} rounds x "
        f"{args.steps} steps; ms per optimizer step:",
        f"  {'setting':30s} {'fastest':>8s} {'median':>8s}",
    ]
    lines += [f"  {name:30s} {best * 1e3:8.2f} {median * 1e3:8.2f}" for name, (best, median) in times.items()]

    def ratio(a: str, b: str) -> str:
        return " / ".join(f"{times[a][i] / times[b][i]:.2f}" for i in (0, 1)) + " (fastest / median)"

    saved = 1 - times["accum no_sync"][0] / times["accum sync every micro-batch"][0]
    lines.append(
        f"accumulation K={args.k}: no_sync / sync-every-micro-batch = "
        f"{ratio('accum no_sync', 'accum sync every micro-batch')}: no_sync saves {100 * saved:.0f}%"
    )
    lines.append(f"precision: bf16 / fp32 = {ratio('bf16', 'fp32')} on this machine")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per micro-batch")
    parser.add_argument("--model", default="mlp", help="built-in model or module:function")
    parser.add_argument("--rounds", type=int, default=15, help="rounds: each setting runs once per round")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per setting per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(worker, args=(args, free_port(), results), nprocs=args.nproc, start_method="spawn")
    print(report(results.get(timeout=10), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Model-parallel benchmarks, in one run on 2 local processes (gloo on CPU, or one GPU each):

  1. pipeline bubble: each stage's measured idle fraction for GPipe and 1F1B, p=2 stages,
     m in {2, 4, 8, 16} micro-batches, against the theoretical bubble (p-1)/(m+p-1);
  2. memory: the training state (parameters + gradients + AdamW state) each rank holds under
     FSDP and under DDP for the same model, and the peak allocated memory where CUDA can report it.

    python bench/bench_model_parallel.py            # prints two tables and one JSON line per row
    python bench/bench_model_parallel.py --steps 6  # more timed steps per setting (default 4)

Idle is measured inside the pipeline: a stage is busy from the start to the end of each forward
(module hooks) and from the first gradient reaching its output to the last gradient landing in
its parameters (an autograd marker and post-accumulate-grad hooks); idle = 1 - busy / step time.
The theory assumes equal stages and free communication, so measured idle sits somewhat above it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the tests' free_port

from core import schedules  # noqa: E402
from core.gpt import GPT  # noqa: E402
from core.kernel.loss import Loss  # noqa: E402
from core.kernel.step import step_plain  # noqa: E402
from core.kernel.train import cleanup_pg, init_pg  # noqa: E402
from core.mesh import build_mesh  # noqa: E402
from core.shard import shard_blocks  # noqa: E402
from helpers import free_port  # noqa: E402


class _BackwardStart(torch.autograd.Function):
    """Identity whose backward notes when the first gradient reaches the stage's output."""

    @staticmethod
    def forward(ctx, x, timer):
        ctx.timer = timer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer.backward_started()
        return grad, None


class BusyTimer(nn.Module):
    """Wraps a stage and adds up the seconds it computes (forward and backward)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.busy, self._open = inner, 0.0, None
        for p in inner.parameters():
            p.register_post_accumulate_grad_hook(lambda _: self._landed())

    def forward(self, x):
        started = time.perf_counter()
        out = self.inner(x)
        self.busy += time.perf_counter() - started
        return _BackwardStart.apply(out, self)

    def backward_started(self):
        self.flush()
        self._open = [time.perf_counter(), None]

    def _landed(self):
        if self._open:
            self._open[1] = time.perf_counter()

    def flush(self):
        if self._open and self._open[1]:
            self.busy += self._open[1] - self._open[0]
        self._open = None


def bubble(topo, *, schedule: str, m: int, steps_: int, micro: int = 16) -> float:
    """This rank's idle fraction for one (schedule, m) setting, over `steps_` timed steps."""
    torch.manual_seed(0)
    model = GPT(dim=128, heads=4, layers=6)
    from torch.distributed.pipelining import PipelineStage

    stage = BusyTimer(schedules.split_pipeline(model, num_stages=2, stage_index=topo.rank)).to(topo.device)
    loss_fn = schedules.TokenLoss()
    sched = schedules.build_schedule(
        schedule, [PipelineStage(stage, topo.rank, 2, topo.device)], microbatches=m, loss_fn=loss_fn
    )
    optimizer = torch.optim.SGD(stage.parameters(), lr=1e-3)
    x = torch.randint(128, (m * micro, 64), device=topo.device)
    busy = wall = 0.0
    for i in range(steps_ + 1):  # the first step warms up (allocations, connections) and is not counted
        stage.busy = 0.0
        torch.distributed.barrier()
        started = time.perf_counter()
        schedules.step_pipeline(
            sched, (x, x), loss_fn=loss_fn, optimizer=optimizer, holds_last=topo.rank == 1
        )  # the recipe's step
        stage.flush()
        if i:
            busy, wall = busy + stage.busy, wall + time.perf_counter() - started
    return 1 - busy / wall


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (local shards only)."""

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def memory(topo, *, kind: str) -> dict:
    torch.manual_seed(0)
    model = GPT(dim=256, heads=8, layers=4).to(topo.device)
    if kind == "fsdp":  # the fsdp recipe's fully_shard calls
        mesh = build_mesh(topo, {"dp": topo.world_size})
        for block in [*shard_blocks(None, model), model]:  # each block, then the root
            fully_shard(block, mesh=mesh)
    else:
        ids = [topo.device.index] if topo.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if topo.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(topo.device)
    x = torch.randint(128, (8, 64), device=topo.device)
    loss_fn = Loss()  # the GPT returns logits: cross-entropy
    for _ in range(2):
        step_plain(model, (x, x), optimizer=optimizer, loss_fn=loss_fn)
    peak = torch.cuda.max_memory_allocated(topo.device) if topo.device.type == "cuda" else None
    return {"state_MiB": state_bytes(model, optimizer) / 2**20, "peak_MiB": peak and peak / 2**20}


def worker(rank: int, port: int, args, queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(2), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)  # as torchrun sets them: init_pg reads its environment
    topo = init_pg(timeout_s=120)
    try:
        for schedule in ("gpipe", "1f1b"):
            for m in (2, 4, 8, 16):
                idle = bubble(topo, schedule=schedule, m=m, steps_=args.steps)
                queue.put(
                    {
                        "bench": "bubble",
                        "schedule": schedule,
                        "p": 2,
                        "m": m,
                        "stage": rank,
                        "idle": round(idle, 3),
                        "theory": round(1 / (m + 1), 3),
                    }
                )
        for kind in ("ddp", "fsdp"):
            queue.put({"bench": "memory", "kind": kind, "rank": rank, **memory(topo, kind=kind)})
    finally:
        cleanup_pg()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per pipeline setting")
    args = parser.parse_args()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(free_port(), args, queue), nprocs=2, join=True)
    rows = []
    while not queue.empty():
        rows.append(queue.get())
    for row in rows:
        print(json.dumps(row))
    print("\nschedule  m   theory  idle(stage 0)  idle(stage 1)")
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 4, 8, 16):
            idle = {
                r["stage"]: r["idle"]
                for r in rows
                if r["bench"] == "bubble" and r["schedule"] == schedule and r["m"] == m
            }
            print(f"{schedule:8}  {m:<3} {1 / (m + 1):.3f}   {idle[0]:.3f}          {idle[1]:.3f}")
    print("\nkind  rank  train state MiB  peak MiB (CUDA only)")
    for r in sorted((r for r in rows if r["bench"] == "memory"), key=lambda r: (r["kind"], r["rank"])):
        print(f"{r['kind']:5} {r['rank']:<5} {r['state_MiB']:<16.2f} {r['peak_MiB'] or '-'}")


if __name__ == "__main__":
    main()

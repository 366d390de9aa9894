"""Where each step's time goes, for the train records: a clock driven by hooks, and the numbers read from it.

    timer = StepClock(topo.device)
    timer.attach(train_model, optimizer)                          # hooks: no code in the step, no host sync
    ... every --log-every steps (a collective):
    log_train(run, totals, ..., **breakdown(timer.take(), device=..., global_batch=...))
    with not_training(), paused(timer):                           # evaluation, checkpoints: not a step
        ...

Each rank times its own steps; `breakdown` gathers every rank's sums in one collective, so the record speaks
for the job: the phases averaged over ranks, the slowest rank's step (the pace the others wait for), the fullest
rank's peak memory, and MFU where the device's peak is known.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from core.kernel.pg import all_gather_object
from core.metrics import peak_memory_mb

BEFORE_PG: list = []  # fn(cfg): before the process group exists: checks, the environment c10d reads (ddp_monitored)
DDP_OPTIONS: list = []  # fn(cfg) -> more DistributedDataParallel keyword arguments (ddp_monitored; --bucket-mb)
WRAPPED: list = []  # fn(cfg, model) -> the model the step calls, after DDP wraps it (ddp_monitored; --compile)

PHASES = ("data", "compute", "comm_wait", "optimizer", "step")


class StepClock:
    """Where each step's time goes, from hooks (no code in the training loop, no host sync per step).

    data: end of the previous step -> forward (the loader, the copy to the device);
    compute: forward, loss and backward, less comm_wait;
    comm_wait: the last gradient computed -> optimizer.step() (the all-reduce time that did not overlap
    backward, plus anything a recipe runs between backward and the step, such as the gradient norm);
    optimizer: optimizer.step(); step: end of the previous step -> end of this one.
    CPU: perf_counter; GPU: CUDA events queued on the stream, read at `take`.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.done: list[tuple[object | None, dict[str, object]]] = []  # (previous end, this step's marks)
        self.current: dict[str, object] = {}
        self.previous_end: object | None = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # queued on the current stream: no sync
        return event

    def mark(self, name: str) -> None:
        if name == "start" and "start" in self.current:
            return  # accumulation: the first micro-batch's forward starts the step
        self.current[name] = self._now()
        if name == "end":
            self.done.append((self.previous_end, self.current))
            self.previous_end, self.current = self.current["end"], {}

    def skip_gap(self) -> None:
        """Time since the last step was not a step (evaluation, checkpoint): leave it out of the next step."""
        self.previous_end, self.current = None, {}

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list:
        """Hooks on the module the loop calls and its optimizer; returns their handles.

        They mark forward start, the last gradient ready, optimizer start and end."""
        handles = [
            model.register_forward_pre_hook(lambda *_: self.mark("start")),
            optimizer.register_step_pre_hook(lambda *_: self.mark("optimizer")),
            optimizer.register_step_post_hook(lambda *_: self.mark("end")),
        ]
        # backward reaches the first parameters last (DDP's buckets assume the same): their gradient marks the end
        # of backward's compute, and what backward() spends after it is the all-reduce that did not overlap
        first = next((p for p in model.parameters() if p.requires_grad), None)
        if first is not None:
            handles.append(first.register_post_accumulate_grad_hook(lambda _: self.mark("comm")))
        return handles

    def take(self) -> dict[str, float]:
        """Milliseconds summed over the steps since the last take, per phase, and `steps`."""
        sums = dict.fromkeys(PHASES, 0.0)
        if self.cuda and self.done:
            self.done[-1][1]["end"].synchronize()  # one wait, at log time, for the window's last event
        ms = (lambda a, b: a.elapsed_time(b)) if self.cuda else (lambda a, b: (b - a) * 1e3)
        for previous_end, marks in self.done:
            start, opt, end = marks.get("start", marks["optimizer"]), marks["optimizer"], marks["end"]
            comm = ms(marks["comm"], opt) if "comm" in marks else 0.0
            data = ms(previous_end, start) if previous_end is not None else 0.0
            for phase, value in zip(PHASES, (data, ms(start, opt) - comm, comm, ms(opt, end), data + ms(start, end))):
                sums[phase] += max(value, 0.0)
        sums["steps"] = float(len(self.done))
        self.done = []
        return sums


def breakdown(
    timings: dict[str, float],
    *,
    device: torch.device,
    global_batch: int,
    flops_per_sample: float | None = None,
    peak_flops: float | None = None,
) -> dict[str, float]:
    """A train record's timing fields, from this rank's `timings` (StepClock.take) and every other rank's.

    Each phase's ms per step averaged over ranks, step_ms_max, peak_mem_mb, and mfu when both FLOP numbers are
    given. A collective: every rank calls it at the same step."""
    mine = {"steps": timings["steps"], "ms": [timings[p] for p in PHASES], "mem": peak_memory_mb(device)}
    ranks = all_gather_object(mine)
    per_step = torch.tensor([r["ms"] for r in ranks], dtype=torch.float64) / torch.tensor(
        [[max(r["steps"], 1.0)] for r in ranks], dtype=torch.float64
    )  # (ranks, phases): each rank's mean step
    record = {f"{p}_ms": float(v) for p, v in zip(PHASES, per_step.mean(0))}
    record["step_ms_max"] = float(per_step[:, PHASES.index("step")].max())  # the slowest rank sets the pace
    record["peak_mem_mb"] = max(r["mem"] for r in ranks)  # the fullest rank is the one that runs out
    if flops_per_sample and peak_flops and record["step_ms"] > 0:
        samples_per_rank = global_batch / len(ranks)
        record["mfu"] = flops_per_sample * samples_per_rank / (record["step_ms"] / 1e3) / peak_flops
    return record


@contextmanager
def paused(timer: StepClock):
    """Evaluation or a checkpoint: not a step for the step clock."""
    try:
        yield
    finally:
        timer.skip_gap()

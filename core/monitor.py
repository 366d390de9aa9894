"""Where each step's time goes, peak memory and MFU for ddp_monitored's train records (docs/monitoring.md)."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from core.kernel.loss import split_outputs

BEFORE_PG: list = []  # fn(cfg): before the process group exists: checks, the environment c10d reads (ddp_monitored)
DDP_OPTIONS: list = []  # fn(cfg) -> more DistributedDataParallel keyword arguments (ddp_monitored; --bucket-mb)
WRAPPED: list = []  # fn(cfg, model) -> the model the step calls, after DDP wraps it (ddp_monitored; --compile)

PHASES = ("data", "compute", "comm_wait", "optimizer", "step")
# dense fp32 peak TFLOP/s per GPU (ddp_monitored trains in fp32), from the vendors' data sheets
PEAK_TFLOPS = {"H200": 67, "H100": 67, "A100": 19.5, "L40S": 91.6, "A10": 31.2, "L4": 30.3, "V100": 15.7, "T4": 8.1}


class StepClock:
    """Each step's data, compute, comm_wait and optimizer time, from hooks: no code in the step, no host sync."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        self.cuda = device.type == "cuda"  # CPU: perf_counter; GPU: CUDA events queued on the stream, read at take
        self.done: list[tuple[object | None, dict[str, object]]] = []  # (previous end, this step's marks)
        self.current, self.previous_end = {}, None
        model.register_forward_pre_hook(lambda *_: self.mark("start"))
        optimizer.register_step_pre_hook(lambda *_: self.mark("optimizer"))
        optimizer.register_step_post_hook(lambda *_: self.mark("end"))
        first = next((p for p in model.parameters() if p.requires_grad), None)  # backward reaches it last (as DDP's
        if first is not None:  # buckets assume): its gradient ends the compute; what follows is unhidden all-reduce
            first.register_post_accumulate_grad_hook(lambda _: self.mark("comm"))

    def mark(self, name: str) -> None:
        """Time `name` in the current step (accumulation: the first micro-batch's forward starts it)."""
        if name == "start" and "start" in self.current:
            return
        self.current[name] = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
        if self.cuda:
            self.current[name].record()  # queued on the current stream: no sync
        if name == "end":
            self.done.append((self.previous_end, self.current))
            self.previous_end, self.current = self.current["end"], {}

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

    def paused(self) -> None:
        """After evaluation or a checkpoint: not a step; the time until the next step is left out of it."""
        self.previous_end, self.current = None, {}


def breakdown(timings: dict[str, float], device: torch.device, global_batch: int, flops, peak) -> dict[str, float]:
    """A train record's phases (ms per step over ranks), step_ms_max, peak_mem_mb and mfu (a collective)."""
    if device.type == "cuda":
        memory = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # resident set; Linux reports KiB
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"steps": timings["steps"], "ms": [timings[p] for p in PHASES], "mem": memory})
    per_step = torch.tensor([r["ms"] for r in ranks], dtype=torch.float64) / torch.tensor(
        [[max(r["steps"], 1.0)] for r in ranks], dtype=torch.float64
    )  # (ranks, phases): each rank's mean step
    record = {f"{p}_ms": float(v) for p, v in zip(PHASES, per_step.mean(0))}
    record["step_ms_max"] = float(per_step[:, PHASES.index("step")].max())  # the slowest rank sets the pace
    record["peak_mem_mb"] = max(r["mem"] for r in ranks)  # the fullest rank is the one that runs out
    if flops and peak and record["step_ms"] > 0:  # flops: one sample's; peak: the device's FLOP/s
        record["mfu"] = flops * (global_batch / len(ranks)) / (record["step_ms"] / 1e3) / peak
    return record


def ms_line(record: dict[str, float]) -> str:
    """The breakdown said under each progress line: a step's mean and slowest rank, its phases, memory and MFU."""
    step = f"{record['step_ms']:.1f} mean, {record['step_ms_max']:.1f} on the slowest rank"
    parts = ", ".join(f"{phase.replace('_', ' ')} {record[f'{phase}_ms']:.1f}" for phase in PHASES[:-1])  # not "step"
    mfu = f"; MFU {record['mfu']:.1%}" if "mfu" in record else ""  # a known GPU only
    return f"ms per step: {step} ({parts}); peak memory {record['peak_mem_mb']:.0f} MB{mfu}"


def peak_flops(device: torch.device) -> float | None:
    """The device's fp32 peak FLOP/s (TDR_PEAK_TFLOPS overrides); None on CPU or an unknown GPU."""
    if os.environ.get("TDR_PEAK_TFLOPS"):
        return float(os.environ["TDR_PEAK_TFLOPS"]) * 1e12
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS.items() if key in name), None)


def flops_per_sample(build, sample) -> float | None:
    """Forward + backward FLOPs of one sample, counted on a meta-device copy; None if the model reads values."""
    meta = lambda value: torch.as_tensor(value).to("meta").unsqueeze(0)  # noqa: E731  one sample, a batch of one
    try:
        with torch.device("meta"):
            model = build()
        with (counter := FlopCounterMode(display=False)):
            if isinstance(sample, Mapping):  # labels' loss FLOPs are negligible; transformers reads a mask's values
                outputs = model(**{k: meta(v) for k, v in sample.items() if k not in ("labels", "attention_mask")})
            else:
                inputs = sample[:-1] if isinstance(sample, tuple | list) and len(sample) > 1 else [sample]
                outputs = model(*map(meta, inputs))
            split_outputs(outputs)[0].float().sum().backward()
        return float(counter.get_total_flops())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError, ValueError):  # a model that reads values
        return None

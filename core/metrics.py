"""Loss, throughput, step-time breakdown, memory and MFU over a logging window, reduced over ranks when read.

Nothing here syncs the host with the device per step: loss sums stay on the device (core.steps.Tally),
step phases are timed by hooks with perf_counter on CPU and CUDA events on GPU, and everything is
read, gathered from every rank in one collective, only when a record is logged.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm
from torch.utils.flop_counter import FlopCounterMode

from core.steps import split_outputs

PHASES = ("data", "compute", "comm_wait", "optimizer", "step")


class StepClock:
    """Where each step's time goes, from hooks (no code in the training loop, no host sync per step).

    data: end of the previous step -> forward (the loader, the copy to the device);
    compute: forward, loss and backward, less comm_wait;
    comm_wait: the last gradient computed -> optimizer.step() (the all-reduce time that did not overlap
    backward, plus anything a recipe runs between backward and the step, such as unscaling or clipping);
    optimizer: optimizer.step(); step: end of the previous step -> end of this one.
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
        self.previous_end, self.current = None, {}  # an evaluation through the same module marked a "start"

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list:
        """Hooks: forward start, optimizer start/end, the last gradient ready. Returns their handles."""
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


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: allocated tensors on a GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# Dense peak FLOP/s per GPU for the compute dtype, from the vendors' data sheets (no sparsity).
PEAK_TFLOPS = {
    "H200": {"bf16": 989, "fp16": 989, "fp32": 67},
    "H100": {"bf16": 989, "fp16": 989, "fp32": 67},
    "A100": {"bf16": 312, "fp16": 312, "fp32": 19.5},
    "L40S": {"bf16": 362, "fp16": 362, "fp32": 91.6},
    "A10": {"bf16": 125, "fp16": 125, "fp32": 31.2},
    "L4": {"bf16": 121, "fp16": 121, "fp32": 30.3},
    "V100": {"bf16": 0, "fp16": 125, "fp32": 15.7},
    "T4": {"bf16": 0, "fp16": 65, "fp32": 8.1},
}


def peak_flops(device: torch.device, precision: str = "fp32") -> float | None:
    """The device's peak FLOP/s for `precision` (TDR_PEAK_TFLOPS overrides); None on CPU or an unknown GPU."""
    if os.environ.get("TDR_PEAK_TFLOPS"):
        return float(os.environ["TDR_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS.items():
        if key in name and table.get(precision):
            return table[precision] * 1e12
    return None


def flops_per_sample(build: Callable[[], torch.nn.Module], sample) -> float | None:
    """Forward + backward FLOPs of one sample, counted by torch on a copy of the model built on the meta device
    (no memory, no compute, no state touched); None if the model can't run there. `sample`: one data set item
    without a batch dim: an input tensor, an (input, target) pair, or a dict of tensors (labels and
    attention_mask left out: the loss's FLOPs are negligible, a mask changes none). A sequence model's count
    covers the sample's whole length, so FLOPs per sequence x sequences/s = FLOPs per token x tokens/s."""
    try:
        with torch.device("meta"):
            model = build()
        if isinstance(sample, Mapping):
            kwargs = {
                k: torch.as_tensor(v).to("meta").unsqueeze(0)
                for k, v in sample.items()
                if k not in ("labels", "attention_mask")
            }  # transformers reads a mask's values; FLOPs don't
        else:
            x = sample[0] if isinstance(sample, (tuple, list)) else sample
            kwargs = {"_x": torch.as_tensor(x).to("meta").unsqueeze(0)}
        counter = FlopCounterMode(display=False)
        with counter:
            outputs = model(kwargs.pop("_x")) if "_x" in kwargs else model(**kwargs)
            split_outputs(outputs)[0].float().sum().backward()
        return float(counter.get_total_flops())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError, ValueError):  # a model that reads values
        return None


def _gather(row: torch.Tensor) -> torch.Tensor:
    """(world, K): every rank's row, on every rank (one all_gather), so sums, means and maxima agree."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return row[None].cpu()
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    return torch.stack(rows).cpu()


def _grad_norm(params: list[torch.nn.Parameter]) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return float("nan")
    norm = get_total_norm(grads)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # sharded grads: a collective

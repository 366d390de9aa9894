"""Throughput and loss over a logging window, reduced over ranks when read."""
from __future__ import annotations

import time

import torch

from core.steps import Tally, summarize


class Meter:
    """Collects step metrics on the device; `read()` does one all-reduce and restarts the window.

    Every rank must call `read()` at the same steps: it is a collective.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.window = Tally(device)
        self.window_start = time.perf_counter()
        self.total_samples = 0.0
        self.total_s = 0.0
        self.last: dict[str, float] = {"loss": float("nan"), "acc": float("nan"), "samples_per_s": 0.0}

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        self.window.add(metrics)

    def read(self) -> dict[str, float]:
        """Job-wide loss, accuracy and samples/s since the last read (the last read's, if no step since)."""
        sums = self.window.reduce()
        if sums["count"] == 0:
            return self.last
        seconds = time.perf_counter() - self.window_start
        self.total_samples += sums["count"]
        self.total_s += seconds
        self.window, self.window_start = Tally(self.device), time.perf_counter()
        self.last = {**summarize(sums), "samples_per_s": sums["count"] / max(seconds, 1e-9)}
        return self.last

    def exclude(self, started: float) -> None:
        """Leave time spent since `started` (evaluation, checkpointing) out of the throughput."""
        self.window_start += time.perf_counter() - started

    @property
    def samples_per_s(self) -> float:
        """Over every window read so far: the job's training throughput."""
        return self.total_samples / max(self.total_s, 1e-9)


def planned_steps(*, epochs: int, batches_per_epoch: int, accum: int = 1, max_steps: int = 0) -> int:
    """Optimizer steps the run will take (for the LR schedule)."""
    total = epochs * max(batches_per_epoch // accum, 1)
    return min(total, max_steps) if max_steps else total

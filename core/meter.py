"""What rank 0 reports for the job: a logging window's loss, accuracy and throughput, summed on every
rank and reduced over all of them only when read, and the progress line that shows them."""

from __future__ import annotations

import time

import torch

from core import steps


class Meter:
    """Loss, accuracy and throughput over a logging window, reduced over ranks only when read."""

    def __init__(self, device: torch.device):
        self.window, self.device = steps.Tally(device), device
        self.started, self.paused_s = time.perf_counter(), 0.0
        self.totals = {"samples": 0.0, "tokens": 0.0, "seconds": 0.0}
        self.last: dict[str, float] = {}

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        self.window.add(metrics)

    def read(self) -> dict[str, float]:
        """The window's numbers for the whole job. A collective: every rank calls it at the same step."""
        sums = self.window.reduce()
        seconds = time.perf_counter() - self.started - self.paused_s
        self.window, self.started, self.paused_s = steps.Tally(self.device), time.perf_counter(), 0.0
        if sums["count"] == 0:
            return self.last
        samples = sums["samples"] or sums["count"]  # (input, class) pairs: one target per sample
        self.totals = {
            "samples": self.totals["samples"] + samples,
            "tokens": self.totals["tokens"] + sums["count"],
            "seconds": self.totals["seconds"] + seconds,
        }
        self.last = {**steps.summarize(sums), **_rates(samples, sums["count"], seconds)}
        return self.last

    def throughput(self) -> dict[str, float]:
        """Over every window read so far: the job's training throughput."""
        return _rates(self.totals["samples"], self.totals["tokens"], self.totals["seconds"])


def _rates(samples: float, tokens: float, seconds: float) -> dict[str, float]:
    rates = {"samples_per_s": samples / max(seconds, 1e-9)}
    if tokens != samples:  # a sequence model: one target per token
        rates["tokens_per_s"] = tokens / max(seconds, 1e-9)
    return rates


def progress_line(step: int, total: int, *, epoch: int, **fields) -> str:
    """`step 40/115 epoch 1 loss 0.4123 acc 0.91 1875 samples/s`."""
    shown = {
        "loss": "loss {:.4f}",
        "acc": "acc {:.4f}",
        "samples_per_s": "{:.0f} samples/s",
        "tokens_per_s": "{:.0f} tokens/s",
    }
    parts = [fmt.format(fields[k]) for k, fmt in shown.items() if isinstance(fields.get(k), float)]
    return " ".join([f"step {step}/{total} epoch {epoch}", *parts])


def fmt_value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)

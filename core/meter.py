"""The job's numbers: metric sums kept on each rank's device and reduced over ranks only when read, the
training clock, and the records and lines rank 0 writes from them (so what it prints speaks for the job).

The clock starts when the first optimizer step ends: samples_per_s, tokens_per_s and elapsed_s count training
from there (evaluation and checkpoints excluded from the rates). `startup_s` is the time from the process's start
to the end of the first optimizer step, in every recipe alike: imports, building and the first step.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from core.dist import reduce_sum
from core.kernel.job import say
from core.records import RunFolder, write_record

# Fixed keys, so that every rank (one that saw no batch too) joins one all-reduce of the same shape. `scored`:
# the targets of the batches that had an accuracy; `timed_*`: what the steps after the first one trained.
TALLY_KEYS = ("loss_sum", "count", "samples", "correct", "scored", "timed_samples", "timed_count")


class Tally:
    """Running sums of step metrics on the device; `reduce` sums them over all ranks (one all-reduce)."""

    def __init__(self, device: torch.device):
        self.sums = {key: torch.zeros((), dtype=torch.float64, device=device) for key in TALLY_KEYS}

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        if "correct" in metrics:
            self.sums["scored"] = self.sums["scored"] + metrics["count"]
        for key, value in metrics.items():
            self.sums[key] = self.sums[key] + value

    def reduce(self) -> dict[str, float]:
        return dict(zip(TALLY_KEYS, reduce_sum(torch.stack([self.sums[k] for k in TALLY_KEYS])).tolist()))


def summarize(sums: dict[str, float], *, prefix: str = "") -> dict[str, float]:
    """Sums -> the mean loss over counted targets, and the accuracy where one was measured (never a made-up 0)."""
    record = {f"{prefix}loss": sums["loss_sum"] / max(sums["count"], 1.0)}
    if sums["scored"] > 0:
        record[f"{prefix}acc"] = sums["correct"] / sums["scored"]
    return record


class Meter:
    """The logging window's sums, and the training clock (a copy: `--with meter`); `read` is a collective."""

    def __init__(self, device: torch.device):
        self.device, self.window, self.last = device, Tally(device), {}  # last: the last window's loss (and acc)
        self.clock = Clock()  # the rates and the start-up: a standalone copy's `meter` feature

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        """After every optimizer step, its metrics (summed over its micro-batches)."""
        metrics = self.clock.step(metrics)
        self.window.add(metrics)

    def read(self) -> dict[str, float]:
        """The window's loss (and accuracy) for the whole job, the clock's rates, and a new window."""
        sums, self.window = self.window.reduce(), Tally(self.device)
        rates = self.clock.lap(sums)
        if sums["count"] > 0:  # else the last window's numbers stand
            self.last = summarize(sums)
            self.last.update(rates)
        return self.last


class Clock:
    """The training clock: it starts when the first optimizer step ends (start-up: from the process's start to
    there); each log window's rates leave out the time `paused` (evaluation, checkpoints)."""

    def __init__(self):
        self.born, self.started, self.window_start, self.paused_s = process_start(), None, None, 0.0
        self.startup_s, self.trained = None, {"samples": 0.0, "tokens": 0.0, "seconds": 0.0}

    def step(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A step's metrics, with what the rates count (`timed_*`): the first step's samples are not in them."""
        if self.started is None:
            self.started = self.window_start = time.perf_counter()
            self.startup_s = self.started - self.born
            return metrics
        return {**metrics, "timed_samples": metrics["samples"], "timed_count": metrics["count"]}

    @contextmanager
    def paused(self):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - began

    def lap(self, sums: dict[str, float]) -> dict[str, float]:
        """The rates of the window `sums` (reduced), and a new window."""
        now = time.perf_counter()
        seconds = now - (self.window_start or now) - self.paused_s
        self.paused_s, self.window_start = 0.0, self.started and now
        samples, tokens = sums["timed_samples"], sums["timed_count"]
        if sums["count"] == 0 or samples == 0:  # nothing trained, or the first step alone (untimed): no rate, not 0
            return {}
        for key, value in (("samples", samples), ("tokens", tokens), ("seconds", seconds)):
            self.trained[key] += value
        return _rates(samples, tokens, seconds)

    @staticmethod
    def shown(numbers: dict[str, float]) -> list[str]:
        """The rates of a log window, as its progress line shows them: `1234 samples/s`."""
        return [
            f"{numbers[k]:.0f} {k.removesuffix('_per_s')}/s" for k in ("samples_per_s", "tokens_per_s") if k in numbers
        ]

    def throughput(self) -> dict[str, float]:
        """Over every window read so far: the job's training throughput, the start-up, and the time trained."""
        elapsed = time.perf_counter() - self.started if self.started else 0.0
        return _rates(**self.trained) | {"startup_s": round(self.startup_s or 0.0, 3), "elapsed_s": round(elapsed, 3)}


@contextmanager
def paused(meter: Meter):
    """`with meter.paused(totals):` evaluation and checkpoints, not training time. A copy without the `meter` feature
    runs the body as it is."""
    with meter.clock.paused():
        yield


def process_start() -> float:
    """When this process started, on time.perf_counter's clock: wherever a recipe makes its Meter, start-up counts
    from the same point. Linux: /proc's start time; elsewhere, when core.meter was imported."""
    try:  # field 22 of /proc/self/stat, after the command's name in parentheses: clock ticks after boot
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, no CLOCK_BOOTTIME
        return _IMPORTED
    return time.perf_counter() - age


_IMPORTED = time.perf_counter()


def open_window(meter: Meter) -> dict[str, float]:
    """The open log window's loss and accuracy sums over the job (a collective): a checkpoint keeps them, so that
    the first record after a resume averages the same steps as the uninterrupted run's."""
    return {k: v for k, v in meter.window.reduce().items() if k in ("loss_sum", "count", "correct", "scored")}


def carry_window(meter: Meter, window: dict[str, float], *, writer: bool) -> None:
    """A checkpoint's open_window() back into the meter's window: on the writer only, the sums being the job's."""
    if writer:
        for key, value in window.items():
            meter.window.sums[key] = meter.window.sums[key] + value


def _rates(samples: float, tokens: float, seconds: float) -> dict[str, float]:
    if seconds <= 0:  # one step only: nothing was timed
        return {}
    rates = {"samples_per_s": samples / seconds}
    if tokens != samples:  # a sequence model: one target per token
        rates["tokens_per_s"] = tokens / seconds
    return rates


def log_train(run: RunFolder, meter: Meter, *, step: int, total: int, epoch: int, **fields) -> None:
    """Every --log-every steps (and the last): the job's numbers as a `train` record and a progress line.
    A collective: every rank calls it at the same step."""
    numbers = meter.read()
    write_record(run, {"kind": "train", "step": step, "epoch": epoch, **fields, **numbers})
    parts = [f"{key} {numbers[key]:.4f}" for key in ("loss", "acc") if key in numbers]
    parts.extend(meter.clock.shown(numbers))  # 1234 samples/s
    say(run, " ".join([f"step {step}/{total} epoch {epoch}", *parts]))


def log_eval(run: RunFolder, evaluation: dict, *, step: int, epoch: int) -> None:
    """After each epoch's evaluation: an `eval` record and a line (none without a validation set)."""
    if not evaluation:
        return
    write_record(run, {"kind": "eval", "step": step, "epoch": epoch, **evaluation})
    say(run, f"epoch {epoch} " + " ".join(f"{k} {v:.4f}" for k, v in evaluation.items()))


def log_summary(run: RunFolder, meter: Meter, evaluation: dict, *, steps: int, skipped: int, weights, **extra) -> dict:
    """The closing `summary` record and line; every rank returns the same numbers.

    The last evaluation, the last train loss, the job's shape, `extra` (the recipe's own: replicas, mesh sizes),
    where the weights are, and the throughput of the training clock."""
    summary = {**evaluation, "train_loss": meter.last.get("loss"), "steps": steps, "skipped_steps": skipped}
    # the job's shape, and the weights it started from (--init-from: none in a new run, nor in a copy without it)
    summary |= {key: run.config[key] for key in ("world_size", "global_batch", "init_from") if run.config.get(key)}
    summary |= extra | {"weights": str(weights)}
    summary.update(meter.clock.throughput())
    write_record(run, {"kind": "summary", **summary})
    shown = {k: (f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}") if isinstance(v, float) else v for k, v in summary.items()}
    say(run, "summary " + " ".join(f"{k}={v}" for k, v in shown.items()))  # 51690 tokens/s, not 5.169e+04
    return summary

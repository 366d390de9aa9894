"""Plug-in `meter`: the training clock. samples_per_s (and tokens_per_s for a sequence model) in every train record
and progress line, startup_s and elapsed_s in the summary.

The clock starts when the first optimizer step ends (startup_s: from the process's start to there); the rates count
the steps after it and leave out evaluation and checkpoints (the kernel's not_training)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from core.kernel.seams import SEAMS


def process_start() -> float:
    """When this process started, on time.perf_counter's clock (Linux: /proc's start time; elsewhere: now)."""
    try:  # field 22 of /proc/self/stat, after the command's name in parentheses: clock ticks after boot
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, no CLOCK_BOOTTIME
        return time.perf_counter()
    return time.perf_counter() - age


CLOCK: dict = {"born": process_start()}
TRAINED: dict = {}  # over every window read


def clock_reset(cfg, run) -> None:
    """A run starts: its clock starts with its first step."""
    CLOCK.update(started=None, window=None, paused=0.0, timed=None, startup_s=None)
    TRAINED.update(samples=0.0, tokens=0.0, seconds=0.0)


def clock_step(metrics: dict[str, torch.Tensor]) -> None:
    """After a step: the first starts the clock; the others' samples and counted targets are timed."""
    if CLOCK["started"] is None:
        CLOCK["started"] = CLOCK["window"] = time.perf_counter()
        CLOCK["startup_s"] = CLOCK["started"] - CLOCK["born"]
        CLOCK["timed"] = torch.zeros(2, dtype=torch.float64, device=metrics["samples"].device)
    else:
        CLOCK["timed"] = CLOCK["timed"] + torch.stack([metrics["samples"], metrics["count"]])


def clock_rates() -> dict[str, float]:
    """The log window's rates for the job (a collective), and a new window; none for a window of untimed steps."""
    if CLOCK["timed"] is None:
        return {}
    timed, now = CLOCK["timed"].clone(), time.perf_counter()
    if dist.get_world_size() > 1:
        dist.all_reduce(timed)
    samples, tokens = timed.tolist()
    seconds = now - CLOCK["window"] - CLOCK["paused"]
    CLOCK.update(window=now, paused=0.0, timed=torch.zeros_like(timed))
    if samples == 0:  # the first step alone: nothing was timed, no rate (not 0)
        return {}
    for key, value in (("samples", samples), ("tokens", tokens), ("seconds", seconds)):
        TRAINED[key] += value
    return rates(samples, tokens, seconds)


def rates(samples: float, tokens: float, seconds: float) -> dict[str, float]:
    if seconds <= 0:  # one step only: nothing was timed
        return {}
    found = {"samples_per_s": samples / seconds}
    if tokens != samples:  # a sequence model: one target per token
        found["tokens_per_s"] = tokens / seconds
    return found


@contextlib.contextmanager
def clock_paused():
    began = time.perf_counter()
    try:
        yield
    finally:
        CLOCK["paused"] += time.perf_counter() - began


def throughput(cfg, run, model) -> dict[str, float]:
    """The job's training throughput over every window read, the start-up and the time trained."""
    elapsed = time.perf_counter() - CLOCK["started"] if CLOCK["started"] else 0.0
    startup = round(CLOCK["startup_s"] or 0.0, 3)
    return rates(**TRAINED) | {"startup_s": startup, "elapsed_s": round(elapsed, 3)}


SEAMS["before_job"].append(clock_reset)
SEAMS["on_step"].append(clock_step)
SEAMS["log_fields"].append(clock_rates)
SEAMS["pauses"].append(clock_paused)
SEAMS["after_job"].append(throughput)

"""The job's numbers: metric sums on each rank's device, summed over the ranks before rank 0 logs them."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from core.kernel.log import RunFolder, say, write_record
from core.kernel.seams import AFTER_JOB, LOG_FIELDS, PAUSES

TALLY_KEYS = ("loss_sum", "count", "samples", "correct", "scored")  # every rank joins one all-reduce of this shape


class Tally:
    """Running sums of step metrics on the device; `reduce` sums them over all ranks (one all-reduce)."""

    def __init__(self, device: torch.device, carried: dict[str, float] | None = None):
        self.sums = {key: torch.zeros((), dtype=torch.float64, device=device) for key in TALLY_KEYS}
        self.add(carried or {})  # a checkpoint's open window, reduced (rank 0's alone): as never stopping had it
        self.last = {}  # the last window's loss (and accuracy), read again by a window that counted nothing

    def add(self, metrics: dict) -> None:
        if "correct" in metrics and "scored" not in metrics:
            self.sums["scored"] = self.sums["scored"] + metrics["count"]
        for key, value in metrics.items():
            self.sums[key] = self.sums[key] + value

    def reduce(self) -> dict[str, float]:
        total = torch.stack([self.sums[k] for k in TALLY_KEYS])
        dist.all_reduce(total)
        return dict(zip(TALLY_KEYS, total.tolist()))


def summarize(sums: dict[str, float], *, prefix: str = "") -> dict[str, float]:
    """The mean loss over counted targets, and the accuracy where one was measured (never a made-up 0)."""
    record = {f"{prefix}loss": sums["loss_sum"] / max(sums["count"], 1.0)}
    if sums["scored"] > 0:
        record[f"{prefix}acc"] = sums["correct"] / sums["scored"]
    return record


@contextlib.contextmanager
def not_training():
    """Evaluation and checkpoints: time the clock plug-in leaves out of training's."""
    with contextlib.ExitStack() as stack:
        [stack.enter_context(pause()) for pause in PAUSES]
        yield


def log_train(run: RunFolder, window: Tally, *, step: int, total: int, epoch: int, **fields) -> None:
    """A `train` record and line of the job's numbers since the last one (a collective)."""
    sums = window.reduce()
    window.sums = {key: torch.zeros_like(value) for key, value in window.sums.items()}
    more = {k: v for hook in LOG_FIELDS for k, v in hook().items()}  # the clock's rates (a collective too)
    if sums["count"] > 0:  # else the last window's numbers stand
        window.last = summarize(sums) | more
    write_record(run, {"kind": "train", "step": step, "epoch": epoch, **fields, **window.last})
    shown = [f"{key} {window.last[key]:.4f}" for key in ("loss", "acc") if key in window.last]
    shown += [f"{window.last[k]:.0f} {k.removesuffix('_per_s')}/s" for k in window.last if k.endswith("_per_s")]
    say(run, " ".join([f"step {step}/{total} epoch {epoch}", *shown]))


def log_eval(run: RunFolder, evaluation: dict, *, step: int, epoch: int) -> None:
    """An `eval` record and line after each epoch's evaluation (none without a validation set)."""
    if evaluation:
        write_record(run, {"kind": "eval", "step": step, "epoch": epoch, **evaluation})
        say(run, f"epoch {epoch} " + " ".join(f"{k} {v:.4f}" for k, v in evaluation.items()))


def log_summary(cfg, run: RunFolder, model, window: Tally, evaluation: dict, **numbers) -> dict:
    """The closing `summary` record and line, with the plug-ins' fields; every rank returns it."""
    summary = {**evaluation, "train_loss": window.last.get("loss"), **numbers}
    summary |= {key: run.config[key] for key in ("world_size", "global_batch")}
    for hook in AFTER_JOB:
        summary |= hook(cfg, run, model) or {}
    write_record(run, {"kind": "summary", **summary})
    shown = {k: (f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}") if isinstance(v, float) else v for k, v in summary.items()}
    say(run, "summary " + " ".join(f"{k}={v}" for k, v in shown.items()))  # 51690 tokens/s, not 5.169e+04
    return summary

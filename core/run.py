"""The run folder and everything rank 0 writes or prints, behind one helper: `RunWriter`.

    runs/ddp-3/config.json       the options, the recipe, the world size, versions
    runs/ddp-3/metrics.jsonl     one JSON object a line: kind = train | eval | summary
    runs/ddp-3/model.safetensors final weights of the plain model
    runs/ddp-3/ckpt/             intermediate checkpoints

Every rank builds a RunWriter; only rank 0's writes anything. Numbers handed to it must
already be reduced over ranks (see core.steps.Tally), so what it prints speaks for the job.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import torch
from loguru import logger

from core.ckpt import atomic_write, save_weights
from core.dist import broadcast_object


def next_run_dir(out: str | os.PathLike, prefix: str) -> Path:
    """`out/prefix-N` with N one past the highest existing, created now so no other job takes it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    while True:
        taken = [int(m.group(1)) for p in out.iterdir() if (m := re.fullmatch(rf"{re.escape(prefix)}-(\d+)", p.name))]
        candidate = out / f"{prefix}-{max(taken, default=0) + 1}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:  # another job took it between the listing and the mkdir
            continue


def latest_run_dir(out: str | os.PathLike, prefix: str) -> Path | None:
    """The newest `out/prefix-N`, or None."""
    out = Path(out)
    if not out.is_dir():
        return None
    runs = [(int(m.group(1)), p) for p in out.iterdir() if (m := re.fullmatch(rf"{re.escape(prefix)}-(\d+)", p.name))]
    return max(runs)[1] if runs else None


class RunWriter:
    """Rank 0's side effects: the run folder, config.json, metrics.jsonl, weights, the summary line."""

    def __init__(self, run_dir: Path, *, enabled: bool, tty: bool | None = None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.started = time.perf_counter()
        self.tty = sys.stdout.isatty() if tty is None else tty  # a bar on a terminal, log lines in a file
        self._drawn = 0.0  # when the bar was last redrawn (0: no bar on the line now)

    @classmethod
    def create(cls, out: str, prefix: str, topo, *, run_dir: Path | None = None) -> RunWriter:
        """Rank 0 picks (or is given) the folder and tells the others, so all ranks agree."""
        if topo.is_rank0 and run_dir is None:
            run_dir = next_run_dir(out, prefix)
        return cls(Path(broadcast_object(str(run_dir) if run_dir else None)), enabled=topo.is_rank0)

    def write_config(self, config: dict) -> None:
        if self.enabled:
            text = json.dumps(config, indent=2, sort_keys=True)
            atomic_write(self.run_dir / "config.json", lambda f: f.write(text.encode() + b"\n"))

    def log(self, kind: str, **fields) -> None:
        """Append one record to metrics.jsonl (flushed, so a crash loses at most this line)."""
        if self.enabled:
            record = {"kind": kind, "elapsed_s": round(time.perf_counter() - self.started, 3), **fields}
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def save_weights(self, model: torch.nn.Module, *, metadata: dict[str, str] | None = None) -> Path:
        path = self.run_dir / "model.safetensors"
        if self.enabled:
            save_weights(model, path, metadata=metadata)
        return path

    def print(self, message: str) -> None:
        """A line on rank 0's stdout: the job's output, not a log."""
        if self.enabled:
            print(("\r\x1b[K" if self._drawn else "") + message, file=sys.stdout, flush=True)  # over the bar
            self._drawn = 0.0

    def progress(self, step: int, total: int, *, every: int, **fields) -> None:
        """Call every step. On a terminal: a bar redrawn in place (at most 10 times a second); otherwise
        one log line every `every` steps. `fields` (epoch, loss, samples_per_s...) are the last reduced values."""
        if not self.enabled:
            return
        if not self.tty:
            if step % every == 0 or step == total:
                logger.info(progress_line(step, total, **fields))
            return
        now = time.perf_counter()
        if now - self._drawn >= 0.1 or step == total:  # redrawing every step would cost more than the step
            sys.stdout.write("\r\x1b[K" + progress_line(step, total, width=24, **fields))
            sys.stdout.flush()
            self._drawn = now

    def summary(self, **fields) -> None:
        """The closing record and the one summary line a user reads."""
        fields["elapsed_s"] = round(time.perf_counter() - self.started, 3)
        self.log("summary", **fields)
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
        self.print(f"summary {shown}")


def progress_line(step: int, total: int, *, width: int = 0, elapsed_s: float | None = None, **fields) -> str:
    """`step 40/115 [########----] 35% epoch 1 loss 0.4123 1875 samples/s` (the bar only when width > 0)."""
    fraction = step / total if total else 0.0
    bar = f" [{'#' * round(width * fraction):-<{width}}] {fraction:4.0%}" if width else ""
    shown = {"epoch": "epoch {:d}", "loss": "loss {:.4f}", "samples_per_s": "{:.0f} samples/s",
             "tokens_per_s": "{:.0f} tokens/s"}
    parts = [fmt.format(fields[k]) for k, fmt in shown.items() if isinstance(fields.get(k), int | float)
             and fields[k] == fields[k]]  # skip nan: no window read yet
    return " ".join([f"step {step}/{total}{bar}", *parts])


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)

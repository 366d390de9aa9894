"""The run folder as a run writes it: where (RunFolder), its printed lines and its metrics records.

    runs/ddp-3/metrics.jsonl     one JSON object a line: kind = train | eval | resume | summary

Only rank 0 writes or prints; every number it writes has been reduced over the ranks first. Which folder a run
takes, its lock and the checks a resume must pass are core.folder's; checkpoints and metrics need only this.
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunFolder:
    """Where this run writes (rank 0 only) and the checkpoint it continues from (None: a new run)."""

    path: Path
    resume_from: Path | None
    recipe: str
    config: dict  # the options and the job's shape: config.json, and every checkpoint's header
    writer: bool  # rank 0: the one process that writes and prints
    lock: object = None  # rank 0's open .lock file: the kernel lets go of it when the process ends
    sinks: tuple = ()  # more places every record goes (core.trackers): write(record), state() for checkpoints


def release_new(run: RunFolder) -> None:
    """Rank 0 removes the folder this run made when it holds nothing but config.json and the lock: a checkpoint
    refused at load (a damaged file) leaves no empty run behind for `--resume auto` to take as the newest."""
    if not run.writer or not run.path.is_dir() or {p.name for p in run.path.iterdir()} - {"config.json", ".lock"}:
        return
    for name in ("config.json", ".lock"):
        (run.path / name).unlink(missing_ok=True)
    run.path.rmdir()


def say(run: RunFolder, message: str) -> None:
    """Print a line on rank 0 only."""
    if run.writer:
        print(message, flush=True)


def write_record(run: RunFolder, record: dict) -> None:
    """Rank 0 appends one JSON line to metrics.jsonl in one write(), and hands it to the run's sinks.

    One write: a crash never leaves half a record. A number that is not finite is written as null, as strict JSON
    readers need."""
    if not run.writer:
        return
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    data = (json.dumps(clean) + "\n").encode()
    fd = os.open(run.path / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.write(fd, data) != len(data):  # a full disk: the next record must not start mid-line
            raise OSError(errno.ENOSPC, f"{run.path / 'metrics.jsonl'}: the disk is full")
    finally:
        os.close(fd)
    for sink in run.sinks:
        sink.write(record)


def repair_records(path: Path) -> None:
    """Drop a torn last line (a crash mid-write), so the next record starts on a line of its own."""
    if path.is_file() and (data := path.read_bytes()) and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)

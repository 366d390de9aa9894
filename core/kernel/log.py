"""The log: the lines rank 0 prints, train.log (loguru), metrics.jsonl, and the error line a run ends with."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import sys
import time
from collections import namedtuple
from pathlib import Path

from loguru import logger

from core.kernel.seams import LOG_SINKS, ON_FAIL

LOG_FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | rank {extra[rank]} | {message}"
GRACE_S = 5.0  # how long a rank other than 0 lets rank 0 say an error every rank meets before it says it itself
RUN_LOG: dict = {}  # this process's loguru sink "id"; the run folder "path", or None while its lines are "kept"
RunFolder = namedtuple("RunFolder", "path resume_from recipe config writer")  # writer: rank 0, which alone writes


def open_log(run: RunFolder | None) -> None:
    """Rank 0's lines go to RUN/train.log from here, after those kept since open_log(None) (the folder's choice)."""
    if run is None or run.writer:
        kept = RUN_LOG.get("kept", [])
        with contextlib.suppress(ValueError):  # the log before, or loguru's own handler: it would print lines again
            logger.remove(RUN_LOG.get("id", 0))
        if run:
            with open(run.path / "train.log", "a") as log:
                log.writelines(kept)
        RUN_LOG.update(path=run and run.path, kept=[])
        sink = run.path / "train.log" if run else RUN_LOG["kept"].append  # ours only: never a user's loguru lines
        RUN_LOG["id"] = logger.add(sink, format=LOG_FORMAT, filter=lambda r: "rank" in r["extra"], catch=False)


def say(run: RunFolder | None, message: str, level: str = "INFO") -> None:
    """Rank 0 prints a line (INFO on stdout, the rest on stderr) and logs it (run None: the line of any rank)."""
    if run is None or run.writer:
        print(message, file=sys.stdout if level == "INFO" else sys.stderr, flush=True)
        if RUN_LOG:
            with contextlib.suppress(OSError):  # train.log on a full disk: the terminal has the line
                logger.bind(rank=0).log(level, message)


def fail(message: str, code: int, *, everyone: bool = True) -> int:
    """Print `error: message` once for the job (an error every rank meets: rank 0's line) and return `code`."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    if everyone and rank != "0":
        time.sleep(GRACE_S)  # torchrun ends this rank once rank 0 has ended with the same error
    text = " ".join(str(message).split())
    if world != "1" and (rank != "0" or not everyone) and not re.match(r"rank \d+: ", text):
        text = f"rank {rank}: {text}"  # its own error: which rank met it
    say(None, "error: " + text, level="ERROR")
    for hook in ON_FAIL:
        hook(refused=everyone and code == 1)  # a RecipeError, not an interrupt or a usage error
    return code


def os_error_line(err: OSError) -> str:
    """A failed write as one line: its file (or the run folder), the reason (a full disk: its free bytes), the fix."""
    path = Path(os.fsdecode(err.filename) if err.filename is not None else RUN_LOG.get("path") or ".")
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return f"{path}: {err.strerror or err}; check the folder"
    folder = next(p for p in [path, *path.parents] if p.exists())  # a file the write left unmade: its folder's disk
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    return f"{folder}: the disk is full ({free:,} bytes free); free some space or point --out at another disk"


def write_record(run: RunFolder, record: dict) -> None:
    """Rank 0 appends one JSON line to metrics.jsonl in one write (never half a record); not finite: null."""
    if run.writer:
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with open(run.path / "metrics.jsonl", "ab") as f:
            f.write((json.dumps(clean) + "\n").encode())
        for sink in LOG_SINKS:  # the trackers
            sink(run, record)

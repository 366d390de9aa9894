"""The log: the lines rank 0 prints, train.log (loguru), metrics.jsonl's records, and the error line a run ends with.

RUN/metrics.jsonl   one JSON object a line: kind = train | eval | resume | summary
RUN/train.log       every line the run printed, with its time, level and rank
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from core.kernel.seams import LOG_SINKS, ON_FAIL

LOG_FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | rank {extra[rank]} | {message}"
GRACE_S = 5.0  # how long a rank other than 0 lets rank 0 say an error every rank meets before it says it itself
RUN_LOG: dict = {}  # this process's log sink: {"id": loguru's handler id, "path": run folder} or {"id", "early"}


@dataclass(frozen=True)
class RunFolder:
    """Where this run writes (rank 0 only) and the checkpoint it continues from (None: a new run)."""

    path: Path
    resume_from: Path | None
    recipe: str
    config: dict  # the options and the job's shape: config.json, and every checkpoint's header
    writer: bool  # rank 0: the one process that writes and prints


def keep_lines() -> None:
    """From here to open_log (rank 0 choosing its run folder), the lines said are kept: train.log starts with them."""
    early = []
    _log_to(early.append, early=early)


def open_log(run: RunFolder) -> None:
    """Rank 0: every line the run prints from here on also goes to RUN/train.log, after those keep_lines kept."""
    if run.writer:
        with open(run.path / "train.log", "a") as log:
            log.writelines(RUN_LOG.get("early", []))
        _log_to(run.path / "train.log", path=run.path)


def _log_to(sink, **state) -> None:
    close_log()
    with contextlib.suppress(ValueError):  # loguru's own handler (if not gone already) would print each line again
        logger.remove(0)
    ours = lambda record: "rank" in record["extra"]  # noqa: E731 - the lines said here, not a user's own loguru lines
    RUN_LOG.update(state, id=logger.add(sink, format=LOG_FORMAT, filter=ours, catch=False))


def close_log() -> None:
    """The end of this process's run log."""
    if RUN_LOG:
        logger.remove(RUN_LOG.pop("id"))
        RUN_LOG.clear()


def show(message: str, *, level: str = "INFO", rank: int = 0) -> None:
    """Print one line as it is (INFO on stdout, WARNING and ERROR on stderr); rank 0's also goes to its train.log."""
    print(message, file=sys.stdout if level == "INFO" else sys.stderr, flush=True)
    if RUN_LOG:
        with contextlib.suppress(OSError):  # train.log on a full disk: the terminal has the line
            logger.bind(rank=rank).log(level, message)


def say(run: RunFolder, message: str, *, level: str = "INFO") -> None:
    """Rank 0 prints a line (and logs it to train.log)."""
    if run.writer:
        show(message, level=level)


def env_int(name: str, default: int) -> int | None:
    """torchrun's RANK, WORLD_SIZE or LOCAL_RANK as a number; None when it is not one of 0 or more (init_pg says)."""
    try:
        value = int(os.environ.get(name, default))
    except ValueError:
        return None
    return value if value >= 0 else None


def fail(message: str, code: int, *, everyone: bool = True) -> int:
    """Print `error: message` once for the job (an error every rank meets: rank 0's line) and return `code`."""
    rank, world = env_int("RANK", 0) or 0, env_int("WORLD_SIZE", 1) or 1
    text = " ".join(str(message).split())
    if everyone and rank != 0:
        time.sleep(GRACE_S)  # torchrun ends this rank once rank 0 has ended with the same error
    if world > 1 and (rank != 0 or not everyone) and not re.match(r"rank \d+: ", text):
        text = f"rank {rank}: {text}"
    show("error: " + text, level="ERROR", rank=rank)
    for hook in ON_FAIL:
        hook(refused=everyone and code == 1)  # a RecipeError, not an interrupt or a usage error
    return code


def os_error_line(err: OSError) -> str:
    """A failed write as one line: a full disk names the folder and its free bytes, else the OS's reason."""
    name = os.fsdecode(err.filename) if err.filename is not None else None
    path = Path(name) if name else RUN_LOG.get("path", Path("."))
    folder = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
        return f"{folder}: the disk is full ({free:,} bytes free); free some space or point --out at another disk"
    return f"{name or folder}: {err.strerror or err}; check the folder"


def write_record(run: RunFolder, record: dict) -> None:
    """Rank 0 appends one JSON line to metrics.jsonl in one write (a crash never leaves half a record); a number that
    is not finite is written as null."""
    if run.writer:
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with open(run.path / "metrics.jsonl", "ab") as f:
            f.write((json.dumps(clean) + "\n").encode())
        for sink in LOG_SINKS:  # the trackers
            sink(run, record)

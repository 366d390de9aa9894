"""The run folder as a run writes it: where (RunFolder), its printed lines and its metrics records.

    runs/ddp-3/metrics.jsonl     one JSON object a line: kind = train | eval | resume | summary
    runs/ddp-3/train.log         every line the run printed, with its time, level and rank (loguru)

Only rank 0 writes or prints; every number it writes has been reduced over the ranks first. Which folder a run
takes, its lock and the checks a resume must pass are core.folder's; checkpoints and metrics need only this.
A line is printed as it is (progress and the summary on stdout, `warning:` and `error:` on stderr) and handed to
loguru, whose sink (open_log, rank 0) writes it to train.log; while rank 0 chooses the folder, a sink that keeps the
lines (keep_lines) holds them for train.log's start. A process logs to one run at a time: _RUN_LOG holds that sink,
the one piece of state here, so that the error a run ends with (fail) reaches its log.
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

LOG_FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | rank {extra[rank]} | {message}"
LOG_ONLY = {"config.json", ".lock", "train.log"}  # a new run folder that holds no more than these holds nothing
GRACE_S = 5.0  # how long a rank other than 0 lets rank 0 say an error every rank meets before it says it itself
_RUN_LOG: dict = {}  # this process's log sink: {"id": loguru's handler id, "path": run folder} or {"id", "early"}
env_int = lambda name, default: int(v) if (v := os.environ.get(name, str(default))).isdecimal() else None  # noqa: E731


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


def take_back(*, refused: bool) -> None:
    """`refused`: the run ends in an error every rank meets (a restart would meet it again: a non-finite loss at step
    1, a refused load); rank 0 takes back the new folder it made when it holds nothing but its log (and config.json
    and the lock): no empty run is left for `--resume auto` to take as the newest."""
    if refused and "path" in _RUN_LOG:
        _take_back(_RUN_LOG["path"])


def _take_back(path: Path) -> None:
    if not path.is_dir() or {p.name for p in path.iterdir()} - LOG_ONLY:
        return
    if _RUN_LOG.get("path") == path:
        close_log()
    for name in LOG_ONLY:
        (path / name).unlink(missing_ok=True)
    path.rmdir()


def open_log(run: RunFolder) -> None:
    """Rank 0, once the run folder is known: every line the run prints from here on also goes to RUN/train.log,
    which starts with the lines said while the folder was chosen (keep_lines)."""
    if run.writer:
        with open(run.path / "train.log", "a") as log:
            log.writelines(_RUN_LOG.get("early", []))  # as loguru formatted them when they were said
        _log_to(run.path / "train.log", path=run.path)


def keep_lines() -> None:
    """From here to open_log (rank 0 choosing its run folder), the lines said are kept: train.log starts with them."""
    early = []  # a choice before this one that failed: its lines go
    _log_to(early.append, early=early)


def _log_to(sink, **state) -> None:
    """The lines said go to `sink` (a file, or a list that keeps them), formatted; one run's log at a time in a
    process (the one before, of a run that ended, is closed)."""
    close_log()
    with contextlib.suppress(ValueError):  # loguru's own handler (if not gone already) would print each line again
        logger.remove(0)
    ours = lambda record: "rank" in record["extra"]  # noqa: E731 - the lines said here, not a user's own loguru lines
    _RUN_LOG.update(state, id=logger.add(sink, format=LOG_FORMAT, filter=ours, catch=False))


def close_log() -> None:
    """The end of this process's run log."""
    if _RUN_LOG:
        logger.remove(_RUN_LOG.pop("id"))
        _RUN_LOG.clear()


def show(message: str, *, level: str = "INFO", rank: int = 0) -> None:
    """Print one line as it is (INFO on stdout, WARNING and ERROR on stderr); rank 0's also goes to its train.log."""
    print(message, file=sys.stdout if level == "INFO" else sys.stderr, flush=True)
    if _RUN_LOG:
        with contextlib.suppress(OSError):  # train.log on a full disk: the terminal has the line; the run's writes fail
            logger.bind(rank=rank).log(level, message)


def say(run: RunFolder, message: str, *, level: str = "INFO") -> None:
    """Rank 0 prints a line (and logs it to train.log)."""
    if run.writer:
        show(message, level=level)


def fail(message: str, code: int, *, everyone: bool = True) -> int:
    """Print `error: message` as one line on stderr (and in train.log), as a job prints it; returns `code`, the exit
    status.

    Under torchrun an error every rank meets (`everyone`: a RecipeError, raised alike on every rank, an interrupt) is
    printed by rank 0: another rank waits GRACE_S for rank 0 to end the job, and says it, with its number, only if the
    job still runs. An error of this rank's own (an OSError, a crash) carries its number. A refused run (a restart
    would meet the error again) leaves no empty run folder."""
    rank, world = env_int("RANK", 0) or 0, env_int("WORLD_SIZE", 1) or 1  # None (RANK=abc): never an error here
    text = " ".join(str(message).split())
    if everyone and rank != 0:
        time.sleep(GRACE_S)  # torchrun ends this rank once rank 0 has ended with the same error
    if world > 1 and (rank != 0 or not everyone) and not re.match(r"rank \d+: ", text):
        text = f"rank {rank}: {text}"
    show("error: " + text, level="ERROR", rank=rank)
    take_back(refused=everyone and code == 1)  # a RecipeError, not an interrupt or a usage error
    return code


def os_error_line(err: OSError) -> str:
    """A failed write as one line: a full disk names the folder written to and its free bytes, else the OS's reason.

    An error without a file name (a write to an open file) names the run folder; a bytes name (TensorBoard's) is
    decoded."""
    name = os.fsdecode(err.filename) if err.filename is not None else None
    path = Path(name) if name else _RUN_LOG.get("path", Path("."))
    folder = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
        return f"{folder}: the disk is full ({free:,} bytes free); free some space or point --out at another disk"
    return f"{name or folder}: {err.strerror or err}; check the folder"


def write_record(run: RunFolder, record: dict) -> None:
    """Rank 0 appends one JSON line to metrics.jsonl in one write(), and hands it to the run's sinks if it has any.

    One write (a line is far below the buffer's size): a crash never leaves half a record. A number that is not
    finite is written as null, as strict JSON readers need. A full disk raises an OSError that names no file:
    os_error_line names the run folder."""
    if not run.writer:
        return
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    with open(run.path / "metrics.jsonl", "ab") as f:
        f.write((json.dumps(clean) + "\n").encode())
    for sink in run.sinks:
        sink.write(record)


def take_back_resume(run: RunFolder) -> None:
    """Rank 0 drops the `resume` record this job wrote last, when it is refused after all (a tracker that cannot
    open): a refused run changes no saved file."""
    path = run.path / "metrics.jsonl"
    if not run.writer or not path.is_file():
        return
    data = path.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    try:
        last = json.loads(data[start:])
    except ValueError:
        return
    if last.get("kind") == "resume" and last.get("checkpoint") == str(run.resume_from):
        with open(path, "r+b") as f:
            f.truncate(start)


def repair_records(path: Path) -> None:
    """Drop a torn last line (a crash mid-write), so the next record starts on a line of its own."""
    if path.is_file() and (data := path.read_bytes()) and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)

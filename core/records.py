"""The run folder as a run writes it: where (RunFolder), its printed lines and its metrics records.

    runs/ddp-3/metrics.jsonl     one JSON object a line: kind = train | eval | resume | summary
    runs/ddp-3/train.log         every line the run printed, with its time, level and rank (loguru)

Only rank 0 writes or prints; every number it writes has been reduced over the ranks first. Which folder a run
takes, its lock and the checks a resume must pass are core.folder's; checkpoints and metrics need only this.
A line is printed as it is (progress and the summary on stdout, `warning:` and `error:` on stderr) and handed to
loguru, whose sink (open_log, rank 0) writes it to train.log; while rank 0 chooses the folder, a sink that keeps the
lines (open_log(None)) holds them for train.log's start. A process logs to one run at a time: RUN_LOG holds that sink,
the one piece of state here, so that the error a run ends with (fail) reaches its log.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from core.kernel.seams import ON_FAIL
from core.plugins.take_back import take_back


@dataclass(frozen=True)
class RunFolder:
    """Where this run writes (rank 0 only) and the checkpoint it continues from (None: a new run)."""

    path: Path
    resume_from: Path | None
    recipe: str
    config: dict  # the options and the job's shape: config.json, and every checkpoint's header
    writer: bool  # rank 0: the one process that writes and prints
    lock: object = None  # rank 0's open .lock file: the kernel lets go of it when the process ends
    sinks: tuple = ()  # more places every record goes: write(record), state() for checkpoints


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


ON_FAIL.append(take_back)  # the recipes not on the kernel take back a refused run's new folder too

"""The run folder on disk: its name, the lock that says which job holds it, records written whole.

runs/ddp-3/                  out/prefix-N, numbered; a resumed run continues in its checkpoint's folder
runs/ddp-3/.lock             {"host", "pid", "job"} of the job that holds the folder
runs/ddp-3/metrics.jsonl     one JSON object a line, each written by one write(); non-finite numbers as null
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import socket
import tempfile
from pathlib import Path

from core import ckpt
from core.config import RecipeError

RUN_NAME = r"{}-(\d+)"


def run_dirs(out: str | os.PathLike, prefix: str) -> list[Path]:
    """The folders `out/prefix-N`, oldest (lowest N) first."""
    out = Path(out)
    found = (
        [(int(m.group(1)), p) for p in out.iterdir() if (m := re.fullmatch(RUN_NAME.format(re.escape(prefix)), p.name))]
        if out.is_dir()
        else []
    )
    return [p for _, p in sorted(found)]


def new_run_dir(out: str | os.PathLike, prefix: str) -> Path:
    """`out/prefix-N`, one past the highest, created now so that no other job takes it."""
    while True:
        taken = run_dirs(out, prefix)
        number = int(taken[-1].name.rsplit("-", 1)[1]) + 1 if taken else 1
        try:
            (candidate := Path(out) / f"{prefix}-{number}").mkdir(parents=True)
            return candidate
        except FileExistsError:  # another job took it between the listing and the mkdir
            continue


def find_resume(resume: str, *, out: str, prefix: str, newest) -> Path | None:
    """The checkpoint to start from: a path, or for 'auto' newest(run folder) of the newest run.
    A group that torchrun restarted after a failure (TORCHELASTIC_RESTART_COUNT > 0) resumes by itself."""
    if not resume and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"
    if resume != "auto":
        return Path(resume) if resume else None
    runs = run_dirs(out, prefix)
    return newest(runs[-1]) if runs else None


def nothing_to_resume(out: str, prefix: str) -> str:
    """What --resume auto says when it finds no checkpoint to continue, and a new run starts."""
    runs = run_dirs(out, prefix)
    if not runs:
        return f"--resume auto: no earlier {prefix} run in {out}; starting a new run"
    return (
        f"--resume auto: {runs[-1]}, the newest {prefix} run, has no usable checkpoint; starting a new run "
        f"(--resume PATH continues an older one)"
    )


def lock_holder(run_dir: Path) -> dict | None:
    """Who holds `run_dir` now (host, pid, job), or None when it is free or its holder is gone."""
    try:
        holder = json.loads((run_dir / ".lock").read_text())
    except (OSError, ValueError):
        return None
    same_job = holder.get("job") and holder.get("job") == os.environ.get("TORCHELASTIC_RUN_ID")
    if same_job or (holder.get("host") == socket.gethostname() and not _alive(holder.get("pid", 0))):
        return None  # this job restarted by torchrun, or a process of this host that is gone: stale
    return holder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def release_folder(run_dir: Path, *, discard: bool) -> None:
    """The lock goes when it is ours (or stale). `discard`: a new run that stopped before it wrote anything but its
    config.json goes too, so that the newest run folder is always one that trained."""
    if (lock_holder(run_dir) or {}).get("pid") in (None, os.getpid()):
        (run_dir / ".lock").unlink(missing_ok=True)
    if discard and {p.name for p in run_dir.iterdir()} <= {"config.json"}:
        (run_dir / "config.json").unlink(missing_ok=True)
        run_dir.rmdir()


def check_free(run_dir: Path) -> None:
    if holder := lock_holder(run_dir):
        raise RecipeError(
            f"{run_dir} is in use by PID {holder['pid']} on {holder['host']}; wait for that job to "
            f"end, or delete {run_dir / '.lock'} if it is gone"
        )


def clean(value):
    """JSON has no NaN or infinity: strict readers reject them, so a non-finite number is written as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def append_line(path: Path, record: dict) -> None:
    """One whole line in one write(), so a crash or a full disk never leaves half a record."""
    data = (json.dumps({k: clean(v) for k, v in record.items()}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, "short write")
    except OSError as err:
        raise disk_error(err, path, len(data)) from None
    finally:
        os.close(fd)


def repair_records(path: Path) -> None:
    """Drop a torn last line (a crash mid-write), so the next record starts on a line of its own."""
    if path.is_file() and (data := path.read_bytes()) and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def disk_error(err: OSError, path: Path, needed: int) -> Exception:
    """A failed write as one line: for a full disk with the folder and the bytes, else with the OS's reason."""
    folder = next(p for p in [path.parent, *path.parents] if p.exists())
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return RecipeError(f"{folder}: writing {path.name} failed ({err.strerror or err}); check the folder")
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    return RecipeError(
        f"{path.parent}: the disk is full writing {path.name} ({needed:,} bytes needed, {free:,} "
        f"free); free some space or point --out at another disk"
    )


def take_folder(run_dir: Path, *, fresh: bool, config: dict) -> None:
    """Rank 0 holds `run_dir` for this job: the lock, stale temporaries and a torn record gone, config.json for a
    fresh run (a resumed run keeps the config it was started with: the pre-check refused changes)."""
    check_free(run_dir)
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("TORCHELASTIC_RUN_ID")}
    ckpt.atomic_write(run_dir / ".lock", lambda f: f.write(json.dumps(holder).encode()))
    ckpt.remove_stale_temporaries(run_dir)  # left by a write that a kill interrupted
    repair_records(run_dir / "metrics.jsonl")
    if fresh:
        text = json.dumps(config, indent=2, sort_keys=True).encode() + b"\n"
        ckpt.atomic_write(run_dir / "config.json", lambda f: f.write(text))


def check_writable(folder: str) -> None:
    """Fail now, not after an hour of training, when the output folder can't be written; creates nothing."""
    existing = os.path.abspath(folder)
    while not os.path.isdir(existing):  # the nearest folder that exists must let us create the rest
        parent = os.path.dirname(existing)
        if parent == existing or os.path.exists(existing):
            raise RecipeError(f"--out {folder}: cannot write there ({existing} is not a folder); pick a writable one")
        existing = parent
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-check-"):
            pass
    except OSError as err:
        raise RecipeError(f"--out {folder}: cannot write there ({err.strerror or err}); pick a writable one") from None

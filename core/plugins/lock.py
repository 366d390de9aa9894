"""Plug-in `lock`: one job writes a run folder at a time (an flock on RUN/.lock, which the kernel releases however the
process ends), and the temporary files of a write that a kill interrupted are removed once the lock is held."""

from __future__ import annotations

import fcntl
import os
import re
import socket
from pathlib import Path

from core.kernel.job import RecipeError
from core.kernel.seams import SEAMS

HELD: list = []  # the open .lock files of this process: held for its life
TEMPORARY = re.compile(r"\..+\.tmp-\d+")  # what the kernel's atomic_write names its temporary file


def take_lock(run_dir: Path):
    """An exclusive flock on run_dir/.lock, naming this process in it; a folder another job holds is one line."""
    handle = open(run_dir / ".lock", "a+")  # noqa: SIM115 - held open for the process's life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another job"
        handle.close()
        raise RecipeError(f"{run_dir} is in use by {holder}; wait for that job to end, or resume another run") from None
    handle.truncate(0)
    handle.write(f"PID {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete the `.NAME.tmp-PID` files an interrupted write left in run_dir and run_dir/ckpt (only with the lock
    held: no write of ours is in flight)."""
    removed = []
    for folder in (Path(run_dir), Path(run_dir) / "ckpt"):
        for path in folder.glob(".*.tmp-*"):  # none in a folder that does not exist
            if TEMPORARY.fullmatch(path.name) and path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def lock_folder(path: Path, config: dict, *, new: bool) -> None:
    HELD.append(take_lock(path))  # before anything in the folder is touched
    remove_stale_temporaries(path)


SEAMS["on_open"].append(lock_folder)

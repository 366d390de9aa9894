"""Plug-in `take_back`: a run refused at its start (a damaged checkpoint, a non-finite first loss: a restart would meet
the error again) leaves no new folder holding only its log, which `--resume auto` would take as the newest run."""

from __future__ import annotations

from core.kernel.job import RUN_LOG, open_log
from core.kernel.seams import SEAMS

LOG_ONLY = {"config.json", ".lock", "train.log"}  # a new run folder that holds no more than these holds nothing


def take_back(*, refused: bool) -> None:
    """Rank 0 removes the folder of a refused run when it holds nothing but its log (and config.json, the lock)."""
    path = RUN_LOG.get("path")
    if not refused or path is None or not path.is_dir() or {p.name for p in path.iterdir()} - LOG_ONLY:
        return
    open_log(None)  # lets go of train.log
    for name in LOG_ONLY:
        (path / name).unlink(missing_ok=True)
    path.rmdir()


SEAMS["on_fail"].append(take_back)

"""Plug-in `records`: RUN/config.json (the options, the recipe, the job's shape, written by a new run), and the repair
of a torn last line of metrics.jsonl (a kill mid-write), so that the next record starts on a line of its own."""

from __future__ import annotations

import json
import os
from pathlib import Path

from core.kernel.seams import SEAMS


def repair_records(path: Path) -> None:
    """Drop a torn last line (a crash mid-write)."""
    if path.is_file() and (data := path.read_bytes()) and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def write_config(path: Path, config: dict, *, new: bool) -> None:
    """A new run's RUN/config.json; a resumed run keeps the one it was started with."""
    repair_records(path / "metrics.jsonl")
    if new:
        tmp = path / f".config.json.tmp-{os.getpid()}"  # written whole, then renamed: never half a file
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path / "config.json")


SEAMS["on_open"].append(write_config)

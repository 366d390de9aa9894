"""The job's options, its log and the error line a run ends with (no torch: the command line stays quick)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import re
import sys
import time
import traceback
from collections import namedtuple
from dataclasses import dataclass, field, fields
from pathlib import Path

from loguru import logger

from core.kernel.seams import fire


class RecipeError(Exception):
    """A problem the user can fix: one `error:` line and a non-zero exit."""


def option(default, help: str, *, low=0, high=2**31, choices: tuple | None = None, check=None, fix: str = ""):
    """A Config field: its --help line; a number from `low` to `high`, one of `choices`, or what `check` accepts."""
    return field(default=default, metadata=dict(help=help, low=low, high=high, choices=choices, check=check, fix=fix))


class Options:
    """Every field checked when a Config is built: a wrong value is one line naming the option, the value, the fix."""

    def __post_init__(self):
        for f in fields(self):
            value, meta, name = getattr(self, f.name), f.metadata, "--" + f.name.replace("_", "-")
            if type(value) in (int, float) and not meta["low"] <= value <= meta["high"]:  # nan and inf too
                raise RecipeError(f"{name} {value}: use {meta['low']} to {meta['high']}")
            if meta["choices"] and value not in meta["choices"]:
                raise RecipeError(f"{name} {value}: choose one of {', '.join(meta['choices'])}")
            if meta["check"] and not meta["check"](value):
                raise RecipeError(f"{name} {value!r}: {meta['fix']}")


@dataclass(frozen=True)
class Training(Options):
    epochs: int = option(5, "passes over the training set")
    max_steps: int = option(0, "stop after N optimizer steps (0: no limit)")
    batch_size: int = option(32, "samples per rank per micro-batch", low=1)
    lr: float = option(1e-3, "peak learning rate (AdamW, cosine decay to zero)", low=1e-9, high=10)
    seed: int = option(0, "seed of the weights and the data order; rank r draws dropout from seed + r")
    on_nonfinite: str = option("stop", "a non-finite loss or gradient: stop or skip the step", choices=("stop", "skip"))
    out: str = option("runs", "folder that gets one sub-folder per run", check=bool, fix="name a folder, e.g. runs")
    name: str = option("", "run folder prefix (default: recipe)", check=lambda v: "/" not in v, fix="use a plain name")
    log_every: int = option(10, "log a train record every N optimizer steps", low=1)
    timeout_s: float = option(300.0, "seconds a collective may wait before failing", low=1, high=604800)


@dataclass(frozen=True)
class Checkpointing(Options):
    ckpt_every: int = option(0, "checkpoint every N optimizer steps (0: none)")
    keep: int = option(2, "how many newest checkpoints to keep", low=1)
    resume: str = option("", "'auto' (newest good checkpoint of the newest run) or a checkpoint path")


def cli_main(main, config: type) -> None:
    """`cli_main(main, Config)`: the Config of the command line (--help lists it), main, then the exit."""
    doc = (sys.modules[main.__module__].__doc__ or "").split("\n")[0]  # the recipe's first line
    parser = argparse.ArgumentParser(description=doc, allow_abbrev=False)
    parser.error = lambda message: sys.exit(fail(message, 2))  # one line, not argparse's usage
    for f in fields(config):
        how = {"type": type(f.default), "choices": f.metadata["choices"]}
        how = {"action": argparse.BooleanOptionalAction} if type(f.default) is bool else how
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=f.metadata["help"], **how)
    try:
        main(config(**vars(parser.parse_args())))
        code = 0
    except RecipeError as err:
        code = fail(str(err), 1)
    except OSError as err:  # a full disk, a folder that cannot be written: this rank's own
        code = fail(os_error_line(err), 1, everyone=False)
    except KeyboardInterrupt:
        code = fail("interrupted; the checkpoints written stay: --resume auto continues from the newest", 130)
    except Exception as err:  # a bug, or the user's own code: its traceback, then the line a launcher shows
        traceback.print_exc()
        code = fail(f"{type(err).__name__}: {err}", 1, everyone=False)
    sys.stdout.flush()  # stderr is line-buffered
    os._exit(code)  # past the interpreter's teardown, which gloo's threads may abort (pytorch#179291)


LOG_FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | rank {extra[rank]} | {message}"
GRACE_S = 5.0  # how long a rank other than 0 lets rank 0 say an error every rank meets before it says it itself
RUN_LOG: dict = {}  # this process's loguru sink "id"; the run folder "path", or None while its lines are "kept"
RunFolder = namedtuple("RunFolder", "path resume_from recipe config writer")  # writer: rank 0, which alone writes


def open_log(run: RunFolder | None) -> None:
    """Rank 0's lines go to RUN/train.log from here, after those kept since open_log(None) (the folder's choice)."""
    if run is None or run.writer:
        with contextlib.suppress(ValueError):  # the log before, or loguru's own handler: it would print lines again
            logger.remove(RUN_LOG.get("id", 0))
        if run:
            with open(run.path / "train.log", "a") as log:
                log.writelines(RUN_LOG.get("kept", []))  # the sink that appended to them is gone
        RUN_LOG.update(path=run and run.path, kept=[])
        sink = run.path / "train.log" if run else RUN_LOG["kept"].append  # ours only: never a user's loguru lines
        RUN_LOG["id"] = logger.add(sink, format=LOG_FORMAT, filter=lambda r: "rank" in r["extra"], catch=False)


def say(run: RunFolder | None, message: str, level: str = "INFO") -> None:
    """Rank 0 prints a line (INFO on stdout, the rest on stderr) and logs it (run None: the line of any rank)."""
    if run is None or run.writer:
        print(message, file=sys.stdout if level == "INFO" else sys.stderr, flush=True)
        if RUN_LOG:
            with contextlib.suppress(OSError, RuntimeError):  # a full disk; loguru refusing after a signal hit it
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
    fire("on_fail", refused=everyone and code == 1)  # a RecipeError, not an interrupt or a usage error
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
        fire("log_sinks", run, record)  # the trackers

"""Options: the fields of a recipe's Config, checked when it is built, and the command line that makes one."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import traceback
from dataclasses import dataclass, field

from core.kernel.log import env_int, fail, os_error_line


class RecipeError(Exception):
    """A problem the user can fix; printed as one `error:` line with a non-zero exit."""


class UsageError(RecipeError):
    """A bad command line (exit status 2): argparse's line, which names the option."""


def option(default, help: str, *, choices: tuple[str, ...] | None = None, check=None, fix: str = ""):
    """A field with its help text, and `check(value) -> bool` with the `fix` a failed check advises."""
    return field(default=default, metadata={"help": help, "choices": choices, "check": check, "fix": fix})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def at_least(low: int) -> dict:
    """A whole number from `low` up (to 2**31: a value past it is a typo)."""
    return {"check": lambda v: low <= v <= 2**31, "fix": f"use {low} to 2**31"}


def within(low: float, high: float) -> dict:
    """A number above `low`, up to `high`."""
    return {"check": lambda v: low < v <= high, "fix": f"use ({low:g}, {high:g}]"}


class Options:
    """Every field's check when a Config is built: a wrong value is one line naming the option, the value, the fix."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if isinstance(value, float) and not math.isfinite(value):
                raise RecipeError(f"{flag(f.name)} {value}: use a finite number")
            if meta.get("choices") and value not in meta["choices"]:
                raise RecipeError(f"{flag(f.name)} {value}: choose one of {', '.join(meta['choices'])}")
            if meta.get("check") and not meta["check"](value):
                raise RecipeError(f"{flag(f.name)} {value!r}: {meta['fix']}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def plain_name(name: str) -> bool:  # "" too: the recipe's name
    return name not in (".", "..") and not any(c in name for c in "/\\\0")


@dataclass(frozen=True)
class Training(Options):
    title = "training"
    epochs: int = option(5, "passes over the training set", **at_least(0))
    max_steps: int = option(0, "stop after N optimizer steps (0: no limit)", **at_least(0))
    batch_size: int = option(32, "samples per rank per micro-batch", **at_least(1))
    lr: float = option(1e-3, "peak learning rate (AdamW, cosine decay to zero)", **within(0, 10))
    seed: int = option(0, "seed of the weights and the data order; rank r draws dropout from seed + r", **at_least(0))
    on_nonfinite: str = option("stop", "a non-finite loss or gradient: stop or skip the step", choices=("stop", "skip"))
    out: str = option("runs", "folder that gets one sub-folder per run", check=bool, fix="name a folder, e.g. runs")
    name: str = option(
        "", "run folder prefix (default: the recipe)", check=plain_name, fix="use a plain name, not a path"
    )
    log_every: int = option(10, "log a train record every N optimizer steps", **at_least(1))
    timeout_s: float = option(300.0, "seconds a collective may wait before failing", **within(0, 604800))


@dataclass(frozen=True)
class Checkpointing(Options):
    title = "checkpoints"
    ckpt_every: int = option(0, "checkpoint every N optimizer steps (0: none)", **at_least(0))
    keep: int = option(2, "how many newest checkpoints to keep", **at_least(1))
    resume: str = option("", "'auto' (newest good checkpoint of the newest run) or a checkpoint path")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def parse_args(config: type, argv: list[str] | None = None):
    """The Config of a command line: one --option per field (--help lists them); a bad one is a UsageError line."""
    doc = getattr(sys.modules.get(config.__module__), "__doc__", None) or ""  # the recipe's first line
    parser = _Parser(description=doc.split("\n")[0], allow_abbrev=False)
    for f in dataclasses.fields(config):
        how = {"type": type(f.default), "choices": f.metadata["choices"]}
        how = {"action": argparse.BooleanOptionalAction} if type(f.default) is bool else how
        parser.add_argument(flag(f.name), default=f.default, help=f.metadata["help"], **how)
    return config(**vars(parser.parse_args(argv)))


def cli_main(main, config: type) -> None:
    """`if __name__ == "__main__": cli_main(main, Config)`: parse the command line, then run, then exit."""

    def run() -> None:
        main(parse_args(config))

    leave(run)


def leave(run) -> None:
    """Exit with `run()`'s status (None: 0), past the interpreter's teardown (gloo's threads may abort it,
    pytorch#179291): a user's error as one line, a crash as its traceback and then one line."""
    try:
        code = run() or 0
    except RecipeError as err:
        code = fail(str(err), 2 if isinstance(err, UsageError) else 1)
    except OSError as err:  # a full disk, a folder that can't be written: this rank's own
        code = fail(os_error_line(err), 1, everyone=False)
    except KeyboardInterrupt:
        code = fail("interrupted; checkpoints already written are kept: --resume auto continues from the newest", 130)
    except Exception as err:  # a bug, or the user's own code: its traceback once, then the line a launcher shows
        traceback.print_exc()
        code = fail(f"rank {env_int('RANK', 0)}: {type(err).__name__}: {err}", 1, everyone=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""Options: a recipe's Config, each value checked when it is built, and the command line that makes one."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from dataclasses import dataclass, field

from core.kernel.log import fail, os_error_line


class RecipeError(Exception):
    """A problem the user can fix: one `error:` line and a non-zero exit."""


def option(default, help: str, *, low=0, high=2**31, choices: tuple | None = None, check=None, fix: str = ""):
    """A Config field: its --help line; a number from `low` to `high`, one of `choices`, or what `check` accepts."""
    return field(default=default, metadata=dict(help=help, low=low, high=high, choices=choices, check=check, fix=fix))


class Options:
    """Every field checked when a Config is built: a wrong value is one line naming the option, the value, the fix."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
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
    for f in dataclasses.fields(config):
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

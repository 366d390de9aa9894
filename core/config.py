"""Options: groups of fields a recipe combines into its own Config, checked when it is built.

    @dataclass(frozen=True)
    class Config(Training, Checkpointing):   # exactly the options this recipe implements
        find_unused_parameters: bool = option(False, "let DDP skip parameters forward never used")
    if __name__ == "__main__":
        cli_main(main, Config)               # python ddp.py --epochs 3; --help lists Config's fields

A wrong value fails when the Config is built, before any process exists, in one line that names the
option, the value and the fix. Groups of opt-in features live with the feature (core.amp.Precision, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from core.kernel.job import Options, RecipeError, fail, option, os_error_line


def env_int(name: str, default: int) -> int | None:
    """torchrun's RANK, WORLD_SIZE or LOCAL_RANK as a number; None when it is not one of 0 or more (env_number says)."""
    try:
        value = int(os.environ.get(name, default))
    except ValueError:
        return None
    return value if value >= 0 else None


class UsageError(RecipeError):
    """A bad command line (exit status 2): argparse's line, which names the option."""


def flag(name: str) -> str:
    """A field's option: `max_steps` -> `--max-steps`."""
    return "--" + name.replace("_", "-")


def with_default(group: type, name: str, value):
    """`group`'s field `name` (help, checks) with another default, for a recipe's Config."""
    return field(default=value, metadata=group.__dataclass_fields__[name].metadata)


@dataclass(frozen=True)
class Training(Options):
    title = "training"
    epochs: int = option(5, "passes over the training set")
    max_steps: int = option(0, "stop after N optimizer steps (0: no limit)")
    batch_size: int = option(32, "samples per rank per micro-batch", low=1)
    lr: float = option(1e-3, "peak learning rate (AdamW, cosine decay to zero)", low=1e-9, high=10)
    seed: int = option(0, "seed of the weights and the data order; rank r draws dropout from seed + r")
    model: str = option("mlp", "built-in model (mlp, cnn, gpt) or module:function returning an nn.Module")
    data: str = option("digits", "built-in data (digits, synthetic, text) or module:function returning (train, val)")
    loss: str = option("auto", "auto (the model's own loss, else ce or mse), ce, mse, model, or module:function")
    on_nonfinite: str = option("stop", "a non-finite loss or gradient: stop or skip the step", choices=("stop", "skip"))
    out: str = option("runs", "folder that gets one sub-folder per run", check=bool, fix="name a folder, e.g. runs")
    name: str = option("", "run folder prefix (default: recipe)", check=lambda v: "/" not in v, fix="use a plain name")
    log_every: int = option(10, "log a train record every N optimizer steps", low=1)
    timeout_s: float = option(300.0, "seconds a collective may wait before failing", low=1, high=604800)


@dataclass(frozen=True)
class Checkpointing(Options):
    title = "checkpoints"
    ckpt_every: int = option(0, "checkpoint every N optimizer steps (0: none)")
    keep: int = option(2, "how many newest checkpoints to keep", low=1)
    resume: str = option("", "'auto' (newest good checkpoint of the newest run) or a checkpoint path")


@dataclass(frozen=True)
class DDPOptions(Options):
    title = "DistributedDataParallel"
    find_unused_parameters: bool = option(False, "let DDP find parameters forward did not use (costs a graph walk)")
    static_graph: bool = option(False, "tell DDP the graph is the same every step (also fixes unused parameters)")
    sync_batchnorm: bool = option(False, "BatchNorm statistics over all ranks (SyncBatchNorm; GPUs)")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def parse_args(config: type, argv: list[str] | None = None, *, prog: str | None = None, description: str = ""):
    """(the Config from a command line, whether --dry-run was given): one --option per field.

    Each group's options get a --help section. `--help` prints and exits 0."""
    parser = _Parser(prog=prog, usage=f"{prog or '%(prog)s'} [OPTIONS]", description=description, allow_abbrev=False)
    groups = [c for c in config.__mro__ if c.__dict__.get("__annotations__")]
    titles = {g: g.__dict__.get("title", g.__name__.lower()) for g in groups}  # one section each, in order
    made = {title: parser.add_argument_group(title) for title in titles.values()}  # an empty one is not shown
    # a field's section: the group that declares it first, the last in the MRO (a recipe's new default stays there)
    sections = {name: made[titles[group]] for group in groups for name in group.__dict__["__annotations__"]}
    for f in dataclasses.fields(config):
        choices, kind = f.metadata["choices"], type(f.default)
        how = {"type": kind, "choices": choices, "metavar": None if choices else kind.__name__.upper()}
        if kind is bool:
            how = {"action": argparse.BooleanOptionalAction}
        shown = "" if f.default == "" or f.default is False else f" (default: {f.default})"  # a flag: its --no- form
        sections[f.name].add_argument(flag(f.name), default=f.default, help=f.metadata.get("help", "") + shown, **how)
    parser.add_argument("--dry-run", action="store_true", help="check the options and exit without training")
    values = vars(parser.parse_args(argv))
    return config(**{k: v for k, v in values.items() if k != "dry_run"}), values["dry_run"]


def cli_main(main: Callable, config: type) -> None:
    """`if __name__ == "__main__": cli_main(main, Config)`: parse, run; a user's error as one line."""

    def parse_and_run() -> None:  # the description: the docstring's first line (a copy may have lost its docstring)
        cfg, dry_run = parse_args(config, description=(sys.modules[main.__module__].__doc__ or "").split("\n")[0])
        print(f"ok: {vars(cfg)}") if dry_run else main(cfg)

    leave(parse_and_run)


def leave(run) -> None:
    """Exit with `run()`'s status (None: 0), past the interpreter's teardown (gloo's threads may abort it,
    pytorch#179291): a user's error as one line, a crash as its traceback and then one line."""
    try:
        try:
            code = run() or 0
        except RecipeError as err:
            code = fail(str(err), 2 if isinstance(err, UsageError) else 1)
        except OSError as err:  # a full disk, a folder that can't be written: this rank's own
            code = fail(os_error_line(err), 1, everyone=False)
        except Exception as err:  # a bug, or the user's own code: its traceback once, then the line a launcher shows
            if not peer_left(err):  # a collective whose peer has gone: that rank's own line says why
                traceback.print_exc()
            code = fail(f"rank {env_int('RANK', 0)}: {type(err).__name__}: {err}", 1, everyone=False)
    except KeyboardInterrupt:  # Ctrl-C, or torchrun's SIGINT, also one that lands while an error above is said
        code = fail(f"interrupted; {KEPT}", 130)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


KEPT = "checkpoints already written are kept: --resume auto continues from the newest"  # after a stopped run


def peer_left(err: Exception) -> bool:
    """A collective that failed because another rank's process ended (gloo: the connection closed or reset by it)."""
    return type(err).__name__ == "DistNetworkError" or any(s in str(err) for s in ("by peer", "Broken pipe"))

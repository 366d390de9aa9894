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
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from core.kernel.options import (  # one RecipeError, one option machinery and one exit for every recipe
    Options,
    UsageError,
    at_least,
    flag,
    leave,
    option,
    plain_name,
    within,
)


def with_default(group: type, name: str, value):
    """`group`'s field `name` (help, checks) with another default, for a recipe's Config."""
    return field(default=value, metadata=group.__dataclass_fields__[name].metadata)


@dataclass(frozen=True)
class Training(Options):
    title = "training"
    epochs: int = option(5, "passes over the training set", **at_least(0))
    max_steps: int = option(0, "stop after N optimizer steps (0: no limit)", **at_least(0))
    batch_size: int = option(32, "samples per rank per micro-batch", **at_least(1))
    lr: float = option(1e-3, "peak learning rate (AdamW, cosine decay to zero)", **within(0, 10))
    seed: int = option(0, "seed of the weights and the data order; rank r draws dropout from seed + r", **at_least(0))
    model: str = option("mlp", "built-in model (mlp, cnn, gpt) or module:function returning an nn.Module")
    data: str = option("digits", "built-in data (digits, synthetic, text) or module:function returning (train, val)")
    loss: str = option("auto", "auto (the model's own loss, else ce or mse), ce, mse, model, or module:function")
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
    titles = {g: g.__dict__.get("title", f"{g.__name__} options") for g in groups}  # one section each, in order
    made = {title: parser.add_argument_group(title) for title in titles.values()}  # an empty one is not shown
    # a field's section: the group that declares it first, the last in the MRO (a recipe's new default stays there)
    sections = {name: made[titles[group]] for group in groups for name in group.__dict__["__annotations__"]}
    for f in dataclasses.fields(config):
        choices, kind = f.metadata.get("choices"), type(f.default)
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
        print(f"ok: {cfg.to_dict()}") if dry_run else main(cfg)

    leave(parse_and_run)


KEPT = "checkpoints already written are kept: --resume auto continues from the newest"  # after a stopped run

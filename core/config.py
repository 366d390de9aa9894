"""Options: groups of fields a recipe combines into its own Config, checked when it is built.

    @dataclass(frozen=True)
    class Config(Training, Checkpointing):   # exactly the options this recipe implements
        find_unused_parameters: bool = option(False, "let DDP skip parameters forward never used")
    if __name__ == "__main__":
        cli_main(main, Config)               # python ddp.py --epochs 3; --help lists Config's fields

A wrong value (a float must be finite) fails when the Config is built, before any process exists,
in one line that names the option, the value and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field


class RecipeError(Exception):
    """A problem the user can fix; printed as one `error:` line with a non-zero exit."""


class UsageError(RecipeError):
    """A bad command line (exit status 2). `option` names an option this recipe does not take."""

    def __init__(self, message: str, *, option: str | None = None, hint: str = ""):
        super().__init__(message)
        self.option, self.hint = option, hint


def option(default, help: str, *, choices: tuple[str, ...] | None = None, check=None, fix: str = ""):
    """A field with its help text, and `check(value) -> bool` with the `fix` a failed check advises."""
    return field(default=default, metadata={"help": help, "choices": choices, "check": check, "fix": fix})


def with_default(group: type, name: str, value):
    """`group`'s field `name` (help, checks) with another default, for a recipe's Config."""
    return field(default=value, metadata=group.__dataclass_fields__[name].metadata)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _at_least(n: int):
    return lambda v: n <= v <= 2**31


@dataclass(frozen=True)
class Options:
    """The checks every group shares: choices, finiteness, and each field's own check."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if isinstance(value, float) and not math.isfinite(value):
                raise RecipeError(f"{flag(f.name)} {value}: use a finite number")
            if meta.get("choices") and value not in meta["choices"]:
                raise RecipeError(f"{flag(f.name)} {value}: choose one of {', '.join(meta['choices'])}")
            if meta.get("check") and not meta["check"](value):
                raise RecipeError(f"{flag(f.name)} {value}: {meta['fix']}")

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _one_name(name: str) -> bool:
    return name == "" or (name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name)


@dataclass(frozen=True)
class Training(Options):
    title = "training"
    """What every recipe takes."""

    epochs: int = option(5, "passes over the training set", check=_at_least(0), fix="use 0 or more")
    max_steps: int = option(0, "stop after N optimizer steps (0: no limit)", check=_at_least(0), fix="use 0 or more")
    batch_size: int = option(32, "samples per rank per micro-batch", check=_at_least(1), fix="use 1 to 2**31")
    lr: float = option(
        1e-3,
        "peak learning rate (AdamW, cosine decay to zero)",
        check=lambda v: 0 < v <= 10,
        fix="use a learning rate in (0, 10]",
    )
    seed: int = option(
        0, "seed for weights, shuffling, dropout", check=lambda v: 0 <= v < 2**63, fix="use 0 to 2**63-1"
    )
    model: str = option("mlp", "built-in model (mlp, cnn, gpt) or module:function returning an nn.Module")
    data: str = option("digits", "built-in data (digits, synthetic, text) or module:function returning (train, val)")
    loss: str = option(
        "auto",
        "auto (the model's own loss if it returns one, else cross-entropy), ce, model, "
        "or module:function(outputs, batch) -> loss",
    )
    on_nonfinite: str = option(
        "stop", "a step whose loss or gradients are not finite: stop the run, or skip it", choices=("stop", "skip")
    )
    out: str = option("runs", "folder that gets one sub-folder per run")
    name: str = option(
        "",
        "run folder name prefix (default: the recipe name)",
        check=_one_name,
        fix="use a plain name, not a path (the folder goes under --out)",
    )
    log_every: int = option(10, "log a train record every N optimizer steps", check=_at_least(1), fix="use 1 or more")
    timeout_s: float = option(
        300.0,
        "seconds a collective or the rendezvous may wait before failing",
        check=lambda v: 0 < v <= 86400 * 7,
        fix="use 1 second to a week",
    )


@dataclass(frozen=True)
class Checkpointing(Options):
    title = "checkpoints"
    ckpt_every: int = option(0, "checkpoint every N optimizer steps (0: none)", check=_at_least(0), fix="use 0 or more")
    keep: int = option(2, "how many newest checkpoints to keep", check=_at_least(1), fix="keep at least 1")
    resume: str = option("", "'auto' (newest good checkpoint of the newest run) or a checkpoint path")


@dataclass(frozen=True)
class AsyncCheckpoints(Options):
    title = "checkpoints"
    ckpt_async: bool = option(False, "write checkpoints in the background; training waits only for the copy")


def _cuda_for(value: str, needs: str) -> bool:
    import torch  # here, so that `python -m recipes ls` never loads torch

    return value != needs or torch.cuda.is_available()


@dataclass(frozen=True)
class Precision(Options):
    title = "mixed precision"
    precision: str = option(
        "fp32",
        "compute precision (autocast; fp16 adds dynamic loss scaling)",
        choices=("fp32", "bf16", "fp16"),
        check=lambda v: _cuda_for(v, "fp16"),
        fix="fp16 needs a CUDA GPU; on CPU use --precision bf16",
    )


@dataclass(frozen=True)
class ShardedPrecision(Options):
    title = "mixed precision"
    precision: str = option(
        "fp32",
        "compute precision (autocast); no fp16: its loss scaler would judge each rank's gradient shards alone",
        choices=("fp32", "bf16"),
    )


@dataclass(frozen=True)
class Accumulation(Options):
    title = "gradient accumulation and clipping"
    accum: int = option(1, "micro-batches per optimizer step (accumulation)", check=_at_least(1), fix="use 1 or more")
    clip: float = option(
        0.0, "clip the global gradient norm to this (0: off)", check=lambda v: v >= 0, fix="use 0 or more"
    )


@dataclass(frozen=True)
class DDPOptions(Options):
    title = "DistributedDataParallel"
    find_unused_parameters: bool = option(False, "let DDP find parameters forward did not use (costs a graph walk)")
    static_graph: bool = option(False, "tell DDP the graph is the same every step (also fixes unused parameters)")
    sync_batchnorm: bool = option(False, "BatchNorm statistics over all ranks (SyncBatchNorm; GPUs)")


def _parser(config: type, prog: str, description: str) -> argparse.ArgumentParser:
    """One --option per field, in a help section per group (Training, Checkpointing, ..., the recipe's own)."""
    parser = _Parser(prog=prog, usage=f"{prog} [OPTIONS]", description=description, allow_abbrev=False)
    groups: dict[str, argparse._ArgumentGroup] = {}  # groups with one title share a section
    sections = {}
    for c in (c for c in config.__mro__ if c.__dict__.get("__annotations__")):
        title = c.__dict__.get("title", f"{c.__name__} options")
        sections[c] = groups[title] = groups.get(title) or parser.add_argument_group(title)
    for f in dataclasses.fields(config):
        home = next(c for c in reversed(config.__mro__) if f.name in c.__dict__.get("__annotations__", {}))
        section, default, help = sections[home], f.default, f.metadata.get("help", "")
        if isinstance(default, bool):
            section.add_argument(
                flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help
            )
        else:
            section.add_argument(
                flag(f.name),
                dest=f.name,
                type=type(default),
                default=default,
                help=help + (f" (default: {default})" if default != "" else ""),
                choices=f.metadata.get("choices"),
                metavar=None if f.metadata.get("choices") else type(default).__name__.upper(),
            )
    parser.add_argument("--dry-run", action="store_true", help="check the options and exit without training")
    return parser


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def parse_args(
    config: type, argv: list[str] | None = None, *, prog: str | None = None, description: str = ""
) -> tuple[Options, bool]:
    """The Config from a command line, and whether --dry-run was given. `--help` prints and exits 0."""
    parser = _parser(config, prog or os.path.basename(sys.argv[0]), description)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        first = unknown[0].split("=")[0]
        close = difflib.get_close_matches(first, [o for a in parser._actions for o in a.option_strings], n=1)
        hint = f"did you mean {close[0]}?" if close else "see --help"
        raise UsageError(
            f"{first}: no such option; {hint}" if first.startswith("-") else f"unexpected argument {first!r}",
            option=first,
            hint=hint,
        )
    values = vars(args)
    return config(**{k: v for k, v in values.items() if k != "dry_run"}), values["dry_run"]


def cli_main(main: Callable, config: type, argv: list[str] | None = None, *, check: Callable | None = None) -> None:
    """`if __name__ == "__main__": cli_main(main, Config)`: parse, check, run; errors as one line."""

    def parse_and_run() -> int:
        try:
            doc = (sys.modules[main.__module__].__doc__ or "").split("\n")[0]
            cfg, dry_run = parse_args(config, argv, description=doc)
            if check is not None:
                check(cfg)
            if dry_run:
                print(f"ok: {cfg.to_dict()}")
            else:
                main(cfg)
            return 0
        except UsageError as err:
            return fail(str(err), 2)
        except RecipeError as err:
            return fail(str(err), 1)
        except KeyboardInterrupt:
            return fail(INTERRUPTED, 130)

    leave(parse_and_run)


INTERRUPTED = "interrupted; checkpoints already written are kept: --resume auto continues from the newest"


def leave(run: Callable[[], int]) -> None:
    """End the process with `run()`'s exit status (an uncaught error: its traceback as Python prints it, and 1),
    skipping the interpreter's teardown. DDP keeps its process group, and gloo's worker threads, alive past
    destroy_process_group; a worker still releasing a collective's tensors once teardown stops handing out the
    GIL aborts the process (SIGABRT, "terminate called without an active exception", #179291)."""
    try:
        code = run()
    except Exception:  # a failed collective or a bug
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fail(message: str, code: int) -> int:
    """Print `error: message` as one line on stderr; returns `code` for sys.exit."""
    print("error: " + " ".join(str(message).split()), file=sys.stderr, flush=True)
    return code

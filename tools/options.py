"""The package's command line: a recipe's Config from argv (--help by option group), the environment's numbers, and
the exit past the interpreter's teardown (no torch: `python -m recipes` stays quick)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import traceback

from core.kernel.job import RecipeError, fail, os_error_line

KEPT = "checkpoints already written are kept: --resume auto continues from the newest"  # after a stopped run


class UsageError(RecipeError):
    """A bad command line (exit status 2): argparse's line, which names the option."""


def env_number(name: str, default: int) -> int:
    """torchrun's RANK, WORLD_SIZE or LOCAL_RANK as a number of 0 or more, else one line that names it."""
    with contextlib.suppress(ValueError):
        if (number := int(os.environ.get(name, default))) >= 0:
            return number
    raise RecipeError(f"environment variable {name}={os.environ[name]!r} is not an integer of 0 or more; unset it")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(message)


def parse_args(config: type, argv: list[str] | None = None, *, prog: str | None = None, description: str = ""):
    """(the Config of a command line, whether --dry-run was given): a --help section per group (its docstring)."""
    parser = _Parser(prog=prog, usage=f"{prog or '%(prog)s'} [OPTIONS]", description=description, allow_abbrev=False)
    groups = [c for c in config.__mro__ if c.__dict__.get("__annotations__")]
    auto = {g for g in groups if g.__doc__.startswith(f"{g.__name__}(")}  # no docstring: dataclass wrote "Name(...)"
    titles = {g: g.__name__.lower() if g in auto else g.__doc__ for g in groups}
    made = {title: parser.add_argument_group(title) for title in titles.values()}  # an empty one is not shown
    # a field's section: the group that declares it first, the last in the MRO (a recipe's new default stays there)
    sections = {name: made[titles[group]] for group in groups for name in group.__dict__["__annotations__"]}
    for f in dataclasses.fields(config):
        choices, kind = f.metadata["choices"], type(f.default)
        how = {"type": kind, "choices": choices, "metavar": None if choices else kind.__name__.upper()}
        how = {"action": argparse.BooleanOptionalAction} if kind is bool else how
        text = f.metadata["help"] + ("" if f.default == "" or f.default is False else f" (default: {f.default})")
        sections[f.name].add_argument("--" + f.name.replace("_", "-"), default=f.default, help=text, **how)
    parser.add_argument("--dry-run", action="store_true", help="check the options and exit without training")
    values = vars(parser.parse_args(argv))
    return config(**{k: v for k, v in values.items() if k != "dry_run"}), values["dry_run"]


def leave(run) -> None:
    """Exit with `run()`'s status (None: 0), an error in one line, past the teardown gloo may abort (pytorch#179291)."""
    try:
        try:
            code = run() or 0
        except RecipeError as err:
            code = fail(str(err), 2 if isinstance(err, UsageError) else 1)
        except OSError as err:  # a full disk, a folder that can't be written: this rank's own
            code = fail(os_error_line(err), 1, everyone=False)
        except Exception as err:  # a bug, the user's code: its traceback (not for a peer gone: its own line says why)
            if not (type(err).__name__ == "DistNetworkError" or any(s in str(err) for s in ("by peer", "Broken pipe"))):
                traceback.print_exc()
            code = fail(f"rank {os.environ.get('RANK', '0')}: {type(err).__name__}: {err}", 1, everyone=False)
    except KeyboardInterrupt:  # Ctrl-C, or torchrun's SIGINT, also one that lands while an error above is said
        code = fail(f"interrupted; {KEPT}", 130)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

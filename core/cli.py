"""The command line of one recipe, derived from TrainConfig's fields and the recipe's own options.

Used by `python -m recipes run NAME` and by a recipe file run directly (`torchrun ... ddp.py`).
Bad input becomes one `error: ...` line on stderr and a non-zero exit, never a traceback.
"""
from __future__ import annotations

import dataclasses
import sys

import click
import torch

from core.ckpt import check_resume_file, shapes_of
from core.config import RecipeError, TrainConfig, check_writable, resolve_factory
from core.data import DATASETS
from core.models import MODELS, build_model
from core.registry import RECIPES, Recipe

_TYPES = {"int": int, "float": float, "str": str}


def _click_option(name: str, default, help: str, choices=None, type_name: str | None = None) -> click.Option:
    flag = f"--{name.replace('_', '-')}"
    if type_name == "bool" or isinstance(default, bool):  # --compile / --no-compile
        return click.Option([f"{flag}/--no-{flag[2:]}"], default=bool(default), show_default=True, help=help)
    kind = click.Choice(choices) if choices else _TYPES.get(type_name or type(default).__name__, str)
    return click.Option([f"--{name.replace('_', '-')}"], type=kind, default=default, show_default=True, help=help)


def shared_options(defaults: dict | None = None) -> list[click.Option]:
    defaults = defaults or {}  # a recipe's own defaults, e.g. --model gpt for the model-parallel recipes
    return [
        _click_option(f.name, defaults.get(f.name, f.default), f.metadata["help"], f.metadata.get("choices"), f.type)
        for f in dataclasses.fields(TrainConfig)
    ]


def validate(cfg: TrainConfig) -> None:
    """Everything that can be checked before a process group exists."""
    resolve_factory(cfg.model, MODELS, option="--model")
    resolve_factory(cfg.data, DATASETS, option="--data")
    check_writable(cfg.out)
    if cfg.resume not in ("", "auto"):  # a missing, truncated or foreign file fails here, on every rank alike
        with torch.device("meta"):  # shapes only: no memory, no weights initialised
            model = build_model(cfg.model)
        check_resume_file(cfg.resume, shapes_of(model))


def recipe_command(recipe: Recipe) -> click.Command:
    own = [_click_option(k, o.default, o.help, o.choices) for k, o in recipe.options.items()]
    dry_run = click.Option(["--dry-run"], is_flag=True, help="check the options and exit without training")
    shared_names = {f.name for f in dataclasses.fields(TrainConfig)}

    def callback(dry_run: bool, **values):
        shared = {k: v for k, v in values.items() if k in shared_names}
        cfg = TrainConfig(**{**shared, "name": shared.get("name") or recipe.name})
        validate(cfg)
        if dry_run:
            click.echo(f"ok: {recipe.name} {cfg.to_dict()}")
            return None
        return recipe.main(cfg, **{k: v for k, v in values.items() if k not in shared_names})

    return click.Command(
        recipe.name, callback=callback, params=shared_options(recipe.defaults) + own + [dry_run],
        help=recipe.summary, short_help=recipe.summary,
    )


def run_cli(command: click.Command, args: list[str] | None = None, *, prog_name: str | None = None) -> int:
    """Run a click command; turn user errors into one stderr line and an exit code."""
    try:
        command.main(args=args, prog_name=prog_name, standalone_mode=False)
        return 0
    except click.exceptions.Exit as exit_:
        return exit_.exit_code
    except click.UsageError as err:
        return _fail(err.format_message(), 2)
    except click.ClickException as err:
        return _fail(err.format_message(), 1)
    except click.exceptions.Abort:
        return _fail("interrupted", 130)
    except RecipeError as err:
        return _fail(str(err), 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _fail(message: str, code: int) -> int:
    message = " ".join(message.split())  # one line, whatever the source of the message
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main_for(main) -> None:
    """`if __name__ == "__main__": main_for(main)` at the end of a recipe file."""
    recipe = next(r for r in RECIPES.values() if r.main is main)
    sys.exit(run_cli(recipe_command(recipe), prog_name=sys.argv[0]))

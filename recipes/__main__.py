"""python -m recipes: list, run and copy out the recipes. The commands are derived from RECIPES."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from core.cli import recipe_command, run_cli
from recipes import PLUGIN_PROBLEMS, RECIPES


def _unknown(name: str) -> click.UsageError:
    return click.UsageError(f"unknown recipe {name!r}; choose one of: {', '.join(sorted(RECIPES))}")


def _recipe(name: str):
    if name not in RECIPES:
        raise _unknown(name)
    return RECIPES[name]


class RecipeGroup(click.Group):
    """`run NAME [OPTIONS]`: one sub-command per registered recipe, built when asked for."""

    def list_commands(self, ctx):
        return sorted(RECIPES)

    def get_command(self, ctx, name):
        return recipe_command(RECIPES[name]) if name in RECIPES else None

    def resolve_command(self, ctx, args):
        if args and args[0] not in RECIPES and not args[0].startswith("-"):
            raise _unknown(args[0])
        return super().resolve_command(ctx, args)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """Small, correct, copy-pasteable PyTorch distributed-training recipes."""
    for problem in PLUGIN_PROBLEMS:
        click.echo(f"warning: {problem}", err=True)


@cli.command("ls")
def list_recipes():
    """A table of the recipes: name, what it builds on, multi-node, what it shows."""
    rows = [("name", "builds on", "multi-node", "what it shows")]
    for _, r in sorted(RECIPES.items()):
        rows.append((r.name, r.builds_on or "-", "yes" if r.multi_node else "no", r.summary))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])


cli.add_command(RecipeGroup("run", help="Run a recipe: `run NAME --help` lists its options."))


@cli.command("cp")
@click.argument("name")
@click.argument("dest", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="overwrite DEST if it exists")
def copy_recipe(name: str, dest: str, force: bool):
    """Copy recipe NAME's file to DEST, to edit it in your own project (it imports `core`)."""
    recipe = _recipe(name)
    target = Path(dest)
    if target.exists() and not force:
        raise click.UsageError(f"{dest} exists; pass --force to overwrite it or pick another name")
    text = Path(recipe.source_file).read_text()
    target.write_text(retarget_commands(text, name, dest))
    click.echo(f"copied {name} to {dest}; run it with: torchrun --standalone --nproc-per-node 2 {dest}")


def retarget_commands(text: str, name: str, dest: str) -> str:
    """Point the docstring's launch commands at the copied file instead of the package."""
    text = re.sub(rf"python -m recipes run {name}\b", f"python {dest}", text)
    text = re.sub(rf"-m recipes run {name}\b", dest, text)
    return re.sub(rf"launch_single_node\.sh {name}\b", f"launch_single_node.sh {dest}", text)


def main() -> None:
    sys.exit(run_cli(cli, prog_name="python -m recipes"))


if __name__ == "__main__":
    main()

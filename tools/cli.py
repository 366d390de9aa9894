"""python -m recipes: list, run, copy, diff, check, plan and plot the recipes; derived from the registry.

`run NAME [OPTIONS]` hands OPTIONS to the recipe's own parser (its Config), so `--help` lists
exactly what that recipe takes, and an option it does not take is a usage error that names the
recipes that do. Bad input becomes one `error: ...` line on stderr and a non-zero exit.
"""

from __future__ import annotations

import difflib
import os
import signal
import sys
from pathlib import Path

import click

from core.kernel.job import RecipeError, fail, os_error_line
from tools.options import KEPT, UsageError, env_number, leave, parse_args
from tools.registry import PLUGIN_PROBLEMS, RECIPES, Recipe, takers


def _recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise click.UsageError(f"unknown recipe {name!r}; choose one of: {', '.join(sorted(RECIPES))}")
    return RECIPES[name]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """Small, correct, copy-pasteable PyTorch distributed-training recipes."""
    for problem in PLUGIN_PROBLEMS if os.environ.get("RANK", "0") == "0" else []:  # once, not once per rank
        click.echo(f"warning: {problem}", err=True)


@cli.command("ls")
def list_recipes():
    """The recipes as a markdown table (the README shows it as printed): name, what it builds on, multi-node, what
    it shows, the opt-in core modules it takes."""
    click.echo("| recipe | builds on | multi-node | what it shows | opt-ins it takes (`core/`) |")
    click.echo("|---|---|---|---|---|")
    for r in RECIPES.values():  # the registry's order: the base first, each recipe after what it builds on
        cells = [f"`{r.name}`", f"`{r.builds_on}`" if r.builds_on else "-", "yes" if r.multi_node else "no"]
        click.echo("| " + " | ".join([*cells, r.summary, ", ".join(r.opt_ins) or "-"]) + " |")


@cli.command("run", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("name", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run_recipe(name: str | None, args: tuple[str, ...]):
    """Run recipe NAME: `run NAME --help` lists its options. Under torchrun every rank runs it."""
    if name in (None, "-h", "--help"):
        click.echo(
            "usage: python -m recipes run NAME [OPTIONS]   (NAME --help: its options)\n\nrecipes: "
            + ", ".join(sorted(RECIPES))
        )
        return
    recipe = _recipe(name)
    module = recipe.load()
    try:
        cfg, dry_run = parse_args(
            module.Config, list(args), prog=f"python -m recipes run {name}", description=recipe.summary
        )
    except UsageError as err:
        raise _explained(err, name, module.Config) from None
    # RANK=abc: one line that names it, before the recipe or the pre-check reads any of them
    _, world_size, _ = (env_number(k, d) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    if "RANK" not in os.environ or dry_run or not os.environ.get("TDR_PRECHECKED"):  # the launcher ran it once
        from tools.precheck import precheck

        warnings = precheck(recipe, module, cfg, world_size=world_size)
        for line in warnings if os.environ.get("RANK", "0") == "0" else []:
            click.echo(f"warning: {line}", err=True)
    if dry_run:  # the launchers' pre-check: also the memory plan's largest peak against the free memory
        from tools.plan_report import precheck_memory

        precheck_memory(name, cfg, world_size=world_size)
        click.echo(f"ok: {name} {vars(cfg)}")
        return
    from tools.join import join

    if "watchdog" in recipe.plugins:  # c10d reads --debug's environment when join below makes the group
        from core.plugins.watchdog import prepare_env

        prepare_env(debug=cfg.debug, out=cfg.out, watchdog=cfg.hang_factor > 0)
    join(timeout_s=cfg.timeout_s)  # under the single-node launcher: the workers' store on loopback only
    module.main(cfg)


def _explained(err: UsageError, name: str, config: type) -> UsageError:
    """An option this recipe does not take: the recipes that do, or the nearest option it does take."""
    option = next((w for w in str(err).split() if w.startswith("-")), "").split("=")[0]  # argparse's line names it
    if not option.startswith("--") or "unrecognized arguments" not in str(err):  # a bad value: argparse's line
        return err
    others = [n for n in takers(option) if n != name]
    if others:
        return UsageError(f"{option}: {name} does not take it; {', '.join(others)} {'do' if others[1:] else 'does'}")
    flags = ["--" + f.replace("_", "-") for f in config.__dataclass_fields__]
    close = difflib.get_close_matches(option, flags, n=1)
    hint = f"did you mean {close[0]}?" if close else "see --help"
    return UsageError(f"{option}: {name} does not take it; no recipe does; {hint}")


@cli.command("cp")
@click.argument("name")
@click.argument("dest", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="overwrite DEST if it exists")
@click.option(
    "--standalone",
    is_flag=True,
    help="one file: the recipe, the kernel and its opt-ins, joined whole (needs no part of this package)",
)
@click.option(
    "--with",
    "features",
    default="",
    metavar="PLUGIN,...",
    help="with --standalone: the plug-ins to join (all: every one the recipe runs with; a wrong name lists them)",
)
def copy_recipe(name: str, dest: str, force: bool, standalone: bool = False, features: str = ""):
    """Copy recipe NAME's file to DEST, to edit it in your own project (it imports `core`, unless --standalone).

    A standalone copy is lean: the features it leaves out are listed in its header, each with the --with that
    brings it back."""
    recipe = _recipe(name)
    if features and not standalone:
        raise click.UsageError("--with: only a --standalone copy leaves features out; add --standalone")
    target = Path(dest)
    if target.exists() and not force:
        raise click.UsageError(f"{dest} exists; pass --force to overwrite it or pick another name")
    if not target.parent.is_dir():
        raise click.UsageError(f"{dest}: the folder {target.parent} does not exist; create it or pick another place")
    from tools.copies import copy_source
    from tools.copy_out import retarget_commands

    if standalone:  # one file that imports nothing of this package
        from tools.copy_out import CopyError, parse_with

        try:
            text = copy_source(name, dest, kept=set(parse_with(features, recipe=name)))
        except CopyError as err:
            raise click.UsageError(str(err)) from None
    else:
        text = retarget_commands(Path(recipe.source_file).read_text(), name, dest)
    target.write_text(text)
    launch = f"torchrun --standalone --nproc-per-node 2 {dest}" if recipe.multi_node else f"python {dest}"
    if standalone:  # what the owner takes on: its size, and where its lines come from
        from tools.copy_out import copy_size

        lines, code = copy_size(text)
        size = f" ({lines:,} lines, {code:,} of code; `python -m tools.copies {name}` says where they come from)"
    click.echo(f"copied {name} to {dest}{size if standalone else ''}; run it with: {launch}")


@cli.command("check", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.option("--model", default=None, help="built-in name or module:function (default: the recipe's)")
@click.option("--data", default=None, help="built-in name or module:function (default: the recipe's)")
@click.option("--loss", default="auto", show_default=True, help="as the recipe's --loss")
@click.option("--nproc", default=2, show_default=True, help="processes of the distributed run")
@click.option("--steps", default=3, show_default=True, help="optimizer steps of each run")
@click.option("--batch-size", default=8, show_default=True, help="per rank; the single process gets the global batch")
@click.option("--seed", default=0, show_default=True)
@click.argument("options", nargs=-1, type=click.UNPROCESSED)
def check_command(
    name: str,
    model: str | None,
    data: str | None,
    loss: str,
    nproc: int,
    steps: int,
    batch_size: int,
    seed: int,
    options: tuple[str, ...],
):
    """Does your model train the same on NPROC processes as on one? Exit status 1 (and the likely cause) if not.
    Further OPTIONS (e.g. --static-graph) go to every run of the recipe."""
    from tools.check import check_recipe  # loads nothing for the other commands

    recipe = _recipe(name)
    if nproc < 2 or steps < 1 or batch_size < 1:
        raise click.UsageError("--nproc must be 2 or more, --steps and --batch-size 1 or more")
    report = check_recipe(
        recipe,
        model=model,
        data=data,
        nproc=nproc,
        steps=steps,
        batch_size=batch_size,
        seed=seed,
        loss=loss,
        options=options,
    )
    click.echo(report.text)
    if not report.equivalent:  # exit status 1, with one `error:` line, like any other failure
        raise click.ClickException(f"check {name}: {report.reason}")


@cli.command("diff")
@click.argument("base")
@click.argument("name")
def diff_recipes(base: str, name: str):
    """What recipe NAME adds to recipe BASE (ddp ddp_amp, ddp_amp fsdp): a unified diff of the two files."""
    old, new = _recipe(base), _recipe(name)
    if new.builds_on == base:
        click.echo(f"# {name} builds on {base}: the lines below are what it adds")
    else:
        parent = f"it builds on {new.builds_on}" if new.builds_on else "it builds on no other recipe"
        other = f"{new.builds_on} {name}" if new.builds_on else f"{name} {base}" if old.builds_on == name else ""
        click.echo(
            f"# {name} does not build on {base} ({parent}{f'; try: python -m recipes diff {other}' * bool(other)})"
        )
    lines = difflib.unified_diff(
        Path(old.source_file).read_text().splitlines(),
        Path(new.source_file).read_text().splitlines(),
        f"{base}: {Path(old.source_file).name}",
        f"{name}: {Path(new.source_file).name}",
        lineterm="",
    )
    colours = {"+": "green", "-": "red", "@": "cyan"}
    for line in lines:  # click.echo drops the colour when stdout is not a terminal
        header = line.startswith(("+++", "---"))
        fg = None if header else colours.get(line[:1])
        click.echo(click.style(line, fg=fg, bold=True) if header else click.style(line, fg=fg) if fg else line)


@cli.command("plan", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("name", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def plan_command(name: str | None, args: tuple[str, ...]):
    """Memory per rank before launch, for NAME with its options: `plan NAME --help` lists them."""
    usage = "usage: python -m recipes plan NAME [ITS OPTIONS] [--nproc N] [--device-memory GIB] [--fixed ...] [--json]"
    if name in (None, "-h", "--help"):
        click.echo(f"{usage}\n\nrecipes: " + ", ".join(sorted(RECIPES)))
        return
    recipe = _recipe(name)
    module = recipe.load()
    from tools.plan_report import plan_options, show_plan  # torch's fake tensors load only for this command

    own, rest = plan_options(list(args))
    if "-h" in rest or "--help" in rest:
        click.echo(
            f"{usage}\n  --nproc N: the job's processes; --device-memory GIB: plan for that device; --fixed "
            f"context=GIB,workspace=GIB,nccl=GIB,headroom=FRACTION (or none): a GPU process's fixed terms "
            f"(default: TDR_FIXED, else published figures: docs/memory-plan.md)\n"
        )
    try:
        cfg, _ = parse_args(module.Config, rest, prog=f"python -m recipes plan {name}", description=recipe.summary)
    except UsageError as err:
        raise _explained(err, name, module.Config) from None
    show_plan(name, cfg, **own, echo=click.echo)


@cli.command("plot")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option(
    "-o", "--out", default="plot.png", show_default=True, type=click.Path(dir_okay=False), help="the PNG to write"
)
def plot_command(run_dirs: tuple[str, ...], out: str):
    """Plot loss, validation accuracy and throughput against step for one or more run folders."""
    from tools.plot import plot_runs  # matplotlib loads only for this command

    click.echo(f"wrote {plot_runs(list(run_dirs), out)}")


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP to a command run without a launcher (a scheduler's preemption, a closed terminal)."""


def _stop_on_signals() -> None:
    """SIGTERM and SIGHUP end this process as Ctrl-C does, in one line naming the signal; one that is ignored
    (`nohup`) stays ignored. Not in a torchrun worker: torchrun and the launcher's supervisor report the signals
    of a launched job. The launcher's pre-check dies with the launcher (TDR_DIE_WITH_PARENT, its PID): a SIGTERM to
    it would otherwise leave the pre-check running, alone."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return

    def stop(signum, _frame):
        raise Stopped(signum)

    for closing in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(closing) is not signal.SIG_IGN:
            signal.signal(closing, stop)
    launcher = os.environ.pop("TDR_DIE_WITH_PARENT", "")  # the launcher's PID: it may have died before this line
    if launcher.isdigit() and int(launcher) != 1:  # PID 1, a container's init: the container ends with it
        from tools.worker import die_with_parent

        die_with_parent(signal.SIGTERM, parent=int(launcher))


def run_cli(args: list[str] | None = None) -> int:
    """Run the command line; user errors become one stderr line and an exit code."""
    _stop_on_signals()
    argv = sys.argv[1:] if args is None else args
    trains = argv[:1] == ["run"] and "--dry-run" not in argv  # only a run that trains has checkpoints to keep
    kept = f"; {KEPT}" if trains else ""
    try:
        cli.main(args=args, prog_name="python -m recipes", standalone_mode=False)
        return 0
    except click.exceptions.Exit as exit_:
        return exit_.exit_code
    except (click.UsageError, UsageError) as err:
        return fail(err.format_message() if isinstance(err, click.UsageError) else str(err), 2)
    except click.ClickException as err:
        return fail(err.format_message(), 1)
    except RecipeError as err:
        return fail(str(err), 1)
    except OSError as err:  # a full disk, a folder that can't be written: with the bytes free
        return fail(os_error_line(err), 1, everyone=False)
    except (click.exceptions.Abort, KeyboardInterrupt) as err:
        stop = err if isinstance(err, Stopped) else err.__cause__  # click turns the interrupt into Abort
        if not isinstance(stop, Stopped):
            return fail("interrupted" + kept, 130)
        signum = stop.args[0]  # the status a scheduler expects of a process its signal ended: 128 + the signal
        return fail(f"stopped by {signal.Signals(signum).name}{kept}", 128 + signum)


def main() -> None:
    leave(run_cli)  # without the interpreter's teardown: see tools/options.py

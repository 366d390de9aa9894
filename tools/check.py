"""Is a model safe to train distributed? A quick self-check to run before a long job.

    python -m recipes check ddp --model mypkg.models:build --data mypkg.data:build

Probes one batch here, then compares the recipe's weights and loss on N processes and on one, on the same global
batch (docs/copying-and-checking.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from core.kernel.job import RecipeError
from core.kernel.train import to_device
from tools.precheck import check_data, check_model, unequal_counts
from tools.probes import RANDOMNESS, Finding, check_call, few, loss_of, one_line, probe, sample_batches

# N ranks sum a gradient in another order: float32 weights end ~1e-5..1e-4 of their training distance apart, a
# real break (BatchNorm, dropout) ~1e-2 and more; bf16/fp16 round partial sums ~1e-2 apart.
REL_TOL, LOSS_RTOL = 1e-3, 1e-5
HALF_REL_TOL, HALF_LOSS_RTOL = 5e-2, 1e-3


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    equivalent: bool = False
    reason: str = ""  # why not, in one line, for the closing `error:` line

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _error_line(stderr: str) -> str:
    """Why a run failed: its `error:` line, or its first exception cut to a sentence (DDP's run to a paragraph)."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", line.strip()) for line in stderr.splitlines()]
    lines = [re.sub(r"^error: rank \d+: ", "", line) for line in lines]  # an uncaught exception: cut as one raised
    mine = [line for line in lines if line.startswith("error: ")]
    if mine:
        return mine[0]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception): ", line)]
    line = (raised or [line for line in lines if line] or ["(no output)"])[0]
    if len(line) <= 240:
        return line
    cut = line.rfind(". ", 0, 240)
    return line[: cut + 1] if cut > 0 else line[: line.rfind(" ", 0, 240)] + " ..."


@dataclass(frozen=True)
class Crash:
    """A run that ended without a summary: which, how ("crashed", "hung"), its error line, its command alone."""

    who: str
    how: str
    line: str
    command: str = ""


def _start(args: list[str], *, env: dict[str, str]) -> subprocess.Popen:
    """`python ARGS` in the user's cwd and environment (and `env`), less any torchrun variables of an outer job."""
    outer = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    env = {k: v for k, v in os.environ.items() if k not in outer} | env
    env.setdefault("OMP_NUM_THREADS", "1")  # N processes on a few cores: no oversubscription
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, *, out: str, timeout_s: float) -> tuple[dict | None, tuple[str, str]]:
    """Wait for a recipe run: its summary record (and run folder), or None and (how it failed, the line why)."""
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, ("hung", f"it did not finish within {timeout_s:g}s (a rank waiting for another?)")
    except BaseException:  # Ctrl-C or SIGTERM to check: the run ends with it (torchrun passes SIGTERM to its ranks)
        proc.terminate()
        proc.communicate()
        raise
    summary = run_summary(out)
    if proc.returncode or summary is None:
        return None, ("crashed", _error_line(stderr))
    return summary, ("", "")


def run_summary(out: str | Path) -> dict | None:
    """The last summary record of the newest run under `out`, with its folder (`run_dir`); None without one."""
    runs = sorted(Path(out).glob("*/metrics.jsonl"))
    records = [json.loads(line) for line in runs[-1].read_text().splitlines() if line.strip()] if runs else []
    summary = next((r for r in reversed(records) if r.get("kind") == "summary"), None)
    return None if summary is None else {**summary, "run_dir": runs[-1].parent}


@dataclass(frozen=True)
class Comparison:
    max_diff: float  # largest |distributed - single| over every parameter element
    where: str  # the tensor it is in
    relative: float  # ||distributed - single|| / ||single - initial||: the disagreement per unit of training


def compare_weights(distributed: Path, single: Path, initial: Path) -> Comparison:
    """How far apart the two runs' weights are, against how far training moved them: AdamW turns rounding noise
    on a ~0 gradient into a step of ~lr/100, which an element-wise tolerance would take for a break."""
    a, b, start = load_file(distributed), load_file(single), load_file(initial)
    if a.keys() != b.keys():
        return Comparison(float("inf"), f"different parameter names: {few(sorted(a.keys() ^ b.keys()))}", float("inf"))
    keys = [k for k in sorted(b) if b[k].is_floating_point() and b[k].numel()]
    diffs = {k: (a[k].double() - b[k].double()) for k in keys}
    where = max(keys, key=lambda k: diffs[k].abs().max().item(), default="")
    apart = sum(d.square().sum().item() for d in diffs.values()) ** 0.5
    moved = sum((b[k].double() - start[k].double()).square().sum().item() for k in keys) ** 0.5
    relative = apart / moved if moved else (0.0 if apart == 0 else float("inf"))
    return Comparison(diffs[where].abs().max().item() if where else 0.0, where, relative)


def check_recipe(recipe, *, timeout_s: float = 600.0, **options) -> Report:
    """Probe the model, then run `recipe` on `nproc` processes and on one; every problem is a Report or one line."""
    try:
        plan = prepare(recipe, timeout_s=timeout_s, **options)
        with tempfile.TemporaryDirectory(prefix="tdr-check-") as tmp:  # the user's cwd stays: their modules import
            return conclude(plan, *_three_runs(plan, tmp=tmp, timeout_s=timeout_s))
    except RecipeError:
        raise
    except Exception as err:  # anything else (a plugin that does not import, a run folder gone): still one line
        raise RecipeError(f"check {recipe.name}: {one_line(err)}") from None


@dataclass
class CheckPlan:
    """One check before its runs: the report so far, the runs' command line (`quiet`: not shown) and environment."""

    report: Report
    args: list[str]
    quiet: list[str]
    env: dict[str, str]
    nproc: int
    steps: int
    batch_size: int
    model: str
    runs_model: str
    half: bool

    @property
    def dropout(self) -> bool:  # the runs take check's factory with dropout off
        return self.runs_model != self.model

    @property
    def global_batch(self) -> int:  # what the distributed run trains on, where its recipe records none
        return self.batch_size * self.nproc


def prepare(
    recipe, *, model=None, data=None, nproc=2, steps=3, batch_size=8, seed=0, loss="auto", options=(), timeout_s=600.0
) -> CheckPlan:
    """Probe the model (None: the recipe's default) and plan the runs; `options`: more of the recipe's own."""
    config = recipe.load().Config
    model, data = model or config().model, data or config().data  # None: the recipe's own default
    own = [*(["--loss", loss] if loss != "auto" else []), *options]
    said = f"check {recipe.name} --model {model} --data {data}{''.join(' ' + o for o in own)}"
    report = Report([f"{said}: {steps} steps on {nproc} processes against 1 process on the same global batch"])
    report.findings = probe_spec(
        recipe, model=model, data=data, loss=loss, batch_size=batch_size, seed=seed, nproc=nproc
    )
    dropout = next((f for f in report.findings if f.cause == RANDOMNESS and f.layers), None)
    env = {}
    if dropout:  # compare the runs bit for bit with the masks off; with them on, they agree in distribution only
        report.findings.remove(dropout)
        env = {"TDR_CHECK_MODEL": model}  # the runs take check's factory below; what is shown names the user's
        off = f"  dropout ({few(list(dropout.layers))}) is off (p=0) in both runs"
        on = "with it on, each rank draws its own masks (seed + rank), as one process draws them over the whole batch"
        report.lines.append(f"{off}: {on}: equal in distribution, not bit for bit")
    runs_model = f"{__name__}:without_dropout" if dropout else model
    args = ["recipes", "run", recipe.name, "--model", runs_model, "--data", data, "--seed", str(seed), *own]
    quiet = ["--log-every", str(steps), "--timeout-s", str(min(timeout_s, 300.0))]  # not shown in a rerun command
    half = "--precision" in own and own[own.index("--precision") + 1] in ("bf16", "fp16")
    return CheckPlan(report, args, quiet, env, nproc, steps, batch_size, model, runs_model, half)


def conclude(plan: CheckPlan, runs: list[dict], crash: Crash | None) -> Report:
    """The report on a check's three runs (distributed, single, initial: their summaries), or on a crash."""
    if crash:
        return _verdict(plan.report, crash=_as_named(crash, plan.model, plan.runs_model) if plan.dropout else crash)
    found = compare_weights(*(Path(r["run_dir"], "model.safetensors") for r in runs))
    distributed, single, _ = runs
    distributed = {"global_batch": plan.global_batch, **distributed}  # a recipe that does not record it
    return judge(plan.report, distributed, single, found, half=plan.half, distribution=plan.dropout)


def judge(report: Report, distributed: dict, single: dict, found: Comparison, *, half: bool, distribution: bool):
    """The verdict on two runs' summaries and weights: equal within the tolerance of their precision, or not."""
    if None in (distributed["train_loss"], single["train_loss"]):  # a summary writes nan or inf as null
        named = (("distributed", distributed), ("one-process", single))
        which = " and ".join(n for n, r in named if r["train_loss"] is None)
        why = "nan or inf, or no target counted: every one -100"
        return _verdict(report, mismatch=f"the {which} run's training loss is not a number ({why})")
    rel_tol, loss_rtol = (HALF_REL_TOL, HALF_LOSS_RTOL) if half else (REL_TOL, LOSS_RTOL)
    loss_diff = abs(distributed["train_loss"] - single["train_loss"])
    loss_tol = loss_rtol * max(abs(single["train_loss"]), 1.0)
    report.lines += [
        f"  global batch {distributed['global_batch']} on each side",
        f"  largest parameter difference  {found.max_diff:.3g}{f' ({found.where})' if found.where else ''}",
        f"  weights apart / moved by training  {found.relative:.3g}; tolerance {rel_tol:g}: "
        f"{'within' if found.relative <= rel_tol else 'OUTSIDE'}",
        f"  training loss difference      {loss_diff:.3g} ({distributed['train_loss']:.6g} against "
        f"{single['train_loss']:.6g}); tolerance {loss_tol:.3g}: {'within' if loss_diff <= loss_tol else 'OUTSIDE'}",
    ]
    if distributed.get("replicas_identical") is False:  # the recipe's own end-of-run comparison of the ranks
        differ = distributed.get("replicas_differ")
        report.lines.append("  replicas identical at the end: no" + (f" ({differ})" if differ else ""))
    report.equivalent = found.relative <= rel_tol and loss_diff <= loss_tol
    mismatch = None if report.equivalent else "the weights or the loss differ beyond the tolerance"
    return _verdict(report, mismatch=mismatch, distribution=distribution)


def _as_named(crash: Crash, model: str, runs_model: str) -> Crash:
    """A crash of runs that took check's without_dropout factory, told with the model as the user named it."""
    command = crash.command.replace(f"TDR_CHECK_MODEL={model} ", "").replace(runs_model, model)
    return dataclasses.replace(
        crash,
        line=crash.line.replace(runs_model, model),
        command=command + "  (check ran it with dropout at p=0)" if command else "",
    )


def without_dropout() -> nn.Module:
    """`check`'s --model for a model with dropout: the user's (TDR_CHECK_MODEL) with every dropout at p=0."""
    model = check_model(os.environ["TDR_CHECK_MODEL"])
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return model


def probe_spec(recipe, *, model: str, data: str, loss: str, batch_size: int, seed: int, nproc: int) -> list[Finding]:
    """Build the model and two batches as the recipe does, and probe them (and, for a recipe that averages its
    replicas' mean losses, targets counted unequally); any failure is one RecipeError line."""
    random.seed(seed)  # as the recipe and the factories plug-in seed: a factory that shuffles with random or numpy
    np.random.seed(seed)
    torch.manual_seed(seed)
    built = check_model(model)
    loss_fn = loss_of(loss, built)  # a bad --loss: one RecipeError line, as below
    found = check_data(data, streams=recipe.streams, recipe=recipe.name)
    batches = sample_batches(found["train"], found["collate"], spec=data, size=batch_size, count=2)
    device = next(built.parameters(), torch.empty(0)).device
    batches = [to_device(b, device) for b in batches]
    takes = frozenset(f.name for f in dataclasses.fields(recipe.load().Config))
    where = f"--model {model} --data {data}"
    try:
        check_call(built, batches[0], loss_fn, where=where)
        found = probe(built, batches[0], other=(batches[1:] or [None])[0], seed=seed, loss=loss, takes=takes)
        uneven = unequal_counts(recipe, batches[0], loss_fn, dp=nproc) if recipe.mean_per_replica else []
        return found + [Finding("targets counted unequally across the ranks", line) for line in uneven]
    except RecipeError as err:  # the loss contract refused this model's output or this batch
        raise RecipeError(str(err) if str(err).startswith(where) else f"{where}: {err}") from None
    except Exception as err:  # the model can't train on this data at all: no point in launching anything
        fix = "fix the model or the data first"
        raise RecipeError(f"{where}: one training step fails ({one_line(err)}); {fix}") from None


def distributed_args(plan: CheckPlan) -> list[str]:
    """The distributed run's command line after `python -m torch.distributed.run ... -m` (without `quiet`)."""
    return [*plan.args, "--max-steps", str(plan.steps), "--batch-size", str(plan.batch_size)]


def one_process_args(plan: CheckPlan, distributed: dict) -> dict[str, list[str]]:
    """The command lines of the one-process run on the global batch ("single") and of the initial weights."""
    args = plan.args
    accum = int(args[args.index("--accum") + 1]) if "--accum" in args else 1  # the one process accumulates too
    global_batch = distributed.get("global_batch", plan.global_batch)
    batch = str(global_batch // accum)  # as the recipe counts it (tensor parallel: one batch)
    return {  # --max-steps on both: a stream without a length needs it even for no step
        "single": [*args, "--max-steps", str(plan.steps), "--batch-size", batch],
        "initial": [*args, "--epochs", "0", "--max-steps", "1", "--batch-size", batch],
    }


def _three_runs(plan: CheckPlan, *, tmp: str, timeout_s: float) -> tuple[list[dict], Crash | None]:
    """The recipe on `nproc` processes, on one with the global batch, and its weights before any step."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(plan.nproc)]
    command, env, quiet = [*torchrun, "-m", *distributed_args(plan)], plan.env, plan.quiet
    out = f"{tmp}/distributed"
    distributed, (how, why) = _finish(_start([*command, *quiet, "--out", out], env=env), out=out, timeout_s=timeout_s)
    if distributed is None:
        rerun = "".join(f"{k}={v} " for k, v in env.items()) + "torchrun " + " ".join(command[2:])
        return [], Crash(f"the run on {plan.nproc} processes", how, why, rerun)
    # One process on the global batch, and the weights before any step, side by side.
    commands = {k: ["-m", *c] for k, c in one_process_args(plan, distributed).items()}
    started = {k: _start([*c, *quiet, "--out", f"{tmp}/{k}"], env=env) for k, c in commands.items()}
    try:
        done = {k: _finish(proc, out=f"{tmp}/{k}", timeout_s=timeout_s) for k, proc in started.items()}
    except BaseException:  # interrupted while waiting for the first: the second ends too
        for proc in started.values():
            proc.kill()
        raise
    for key, (summary, (how, why)) in done.items():
        if summary is None:
            rerun = "".join(f"{k}={v} " for k, v in env.items()) + "python " + " ".join(commands[key])
            batch = commands["single"][-1]
            return [], Crash(f"the single-process run (batch {batch})", how, why, rerun)
    return [distributed, done["single"][0], done["initial"][0]], None


def _verdict(report: Report, *, mismatch: str | None = None, crash: Crash | None = None, distribution=False) -> Report:
    """The closing lines: equivalent or not, and why. `distribution`: the runs were compared with dropout off."""
    if mismatch is None and crash is None:
        said = "yes: distributed training of this model matches one process"
        if distribution:
            masks = "with dropout off the runs match; with it on each rank draws its own masks, as one process would"
            said = f"in distribution, not bit for bit: {masks}"
        report.lines.append(f"equivalent: {said}" + (" (but see the warnings)" if report.findings else ""))
        report.lines += [f"warning: {f.cause}: {f.detail}" for f in report.findings]
        return report
    if crash is not None:  # nothing was compared: the error is the news, and only a cause that crashes explains it
        report.reason = f"{crash.who} {crash.how}: {crash.line}"
        report.lines += [
            f"equivalent: NO: {crash.who} {crash.how}, so nothing was compared",
            f"the run {crash.how}: {crash.line}",
        ]
        causes = [f for f in report.findings if f.crashes]
        report.lines += [f"likely cause: {f.cause}: {f.detail}" for f in causes]
        report.lines += [f"warning: {f.cause}: {f.detail}" for f in report.findings if not f.crashes]
        if not causes:
            report.lines.append(f"rerun it alone to see the whole error: {crash.command}")
        return report
    report.reason = f"{mismatch}; see the likely cause above"
    report.lines.append(f"equivalent: NO: {mismatch}")
    report.lines += [f"likely cause: {f.cause}: {f.detail}" for f in report.findings]
    if not report.findings:
        report.lines.append(
            "likely cause: none of the usual ones (unused parameters, BatchNorm, randomness, "
            "non-deterministic ops) is in the model; look for code that depends on the rank or "
            "on the batch size, e.g. a loss summed instead of averaged over the batch"
        )
    return report

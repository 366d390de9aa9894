"""Is a model safe to train distributed? A quick self-check to run before a long job.

    python -m recipes check ddp --model mypkg.models:build --data mypkg.data:build

Two parts. Probes, in this process with no process group, on one batch of the data: what
usually breaks the equivalence of N ranks and one process, named with its fix (parameters
that get no gradient, BatchNorm, randomness in the forward, non-deterministic ops). Then the
recipe itself, run for a few steps twice: under torchrun on N processes, and as one process on
the same global batch; the final weights and the training loss are compared.

Why the recipe under torchrun, not a spawned gloo world around DDP: it checks what the user
will run (the recipe's own wrapper, DDP, FSDP, tensor or pipeline parallel, its sampler, loss
and schedule), for every registered recipe, plugins included; a model DDP can't train fails
with DDP's own error. The price is two launches: seconds on CPU, not minutes.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import default_collate

from core.config import RecipeError
from core.data import build_data
from core.models import build_model
from core.steps import cross_entropy

# Tolerances. N ranks add a batch's gradient up in another order than one process: ~1e-7 relative in
# float32, which leaves the weights ~1e-5..1e-4 of the distance training moved them apart (see
# compare_weights) and the losses ~1e-7 apart. A real break (BatchNorm, dropout) is ~1e-2 and more.
REL_TOL, LOSS_RTOL = 1e-3, 1e-5


@dataclass
class Finding:
    cause: str  # short: "unused parameters"
    detail: str  # which layers, why it breaks equivalence, and the fix


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    equivalent: bool = False

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


def _forward_backward(model: nn.Module, batch, *, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Outputs and gradients of one training-mode step on a copy of `model` (the original is untouched)."""
    model = copy.deepcopy(model).train()
    torch.manual_seed(seed)
    inputs, targets = batch
    outputs = model(inputs)
    cross_entropy(outputs, targets).backward()
    return outputs.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def probe(model: nn.Module, batch, *, seed: int = 0) -> list[Finding]:
    """What in `model` makes N ranks differ from one process: each finding names the layers and the fix."""
    findings = []
    first = _forward_backward(model, batch, seed=seed)
    unused = [n for n, p in model.named_parameters() if p.requires_grad and n not in first[1]]
    if unused:
        findings.append(
            Finding(
                "unused parameters",
                (
                    f"{_few(unused)} get no gradient, so DDP waits for them and fails at the next step; remove them, "
                    f"freeze them (requires_grad_(False)) or wrap with DDP(..., find_unused_parameters=True)"
                ),
            )
        )
    norms = [
        f"{n} ({type(m).__name__})"
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    ]
    if norms:
        findings.append(
            Finding(
                "BatchNorm without SyncBatchNorm",
                (
                    f"{_few(norms)} normalise{'s' * (len(norms) == 1)} by each rank's share of the batch, not the "
                    f"global batch; use "
                    f"nn.SyncBatchNorm.convert_sync_batchnorm(model) on GPUs, or LayerNorm/GroupNorm"
                ),
            )
        )
    if not _same(first, _forward_backward(model, batch, seed=seed)):
        findings.append(
            Finding(
                "non-deterministic layers",
                (
                    "two steps with the same seed and batch differ; find the op with "
                    "torch.use_deterministic_algorithms(True), or accept a tolerance"
                ),
            )
        )
    elif not _same(first, _forward_backward(model, batch, seed=seed + 1)):
        dropout = [n for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
        where = f"dropout ({_few(dropout)})" if dropout else "randomness in forward() (torch.rand*, F.dropout)"
        findings.append(
            Finding(
                "dropout or other randomness not seeded per rank",
                (
                    f"{where} draws from the RNG: every rank is seeded alike, so all ranks draw the same masks, and no "
                    f"seeding draws the masks one process would; seed each rank apart (seed + rank) and compare "
                    f"distributed with single-process with dropout off (p=0)"
                ),
            )
        )
    findings += _deterministic_check(model, batch, seed=seed)
    return findings


def _deterministic_check(model: nn.Module, batch, *, seed: int) -> list[Finding]:
    """Ops that torch itself knows to be non-deterministic refuse to run in deterministic mode."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _forward_backward(model, batch, seed=seed)
        return []
    except RuntimeError as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "deterministic" not in message or "CUBLAS_WORKSPACE_CONFIG" in message:
            return []  # another failure, or cuBLAS setup only: nothing about the model
        return [Finding("non-deterministic layers", f"{message}; results differ from run to run")]
    finally:
        torch.use_deterministic_algorithms(before)


def sample_batch(data_spec: str, *, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    train, _ = build_data(data_spec)
    return default_collate([train[i] for i in range(min(size, len(train)))])


def _error_line(stderr: str) -> str:
    """The line that says why a run failed: its `error:` line, or the first exception raised in it."""
    lines = [line.strip() for line in stderr.splitlines()]
    mine = [line for line in lines if line.startswith("error: ")]
    raised = [line for line in lines if re.match(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception): ", line)]
    return (mine or raised or [line for line in lines if line] or ["(no output)"])[0][:400]


def _start(args: list[str]) -> subprocess.Popen:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    }
    env.setdefault("OMP_NUM_THREADS", "1")  # N processes on a few cores: no oversubscription
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, *, out: str, timeout_s: float) -> tuple[dict | None, str]:
    """Wait for a recipe run: its summary record (and run folder), or None and the line saying why it failed."""
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, f"did not finish within {timeout_s:g}s (a rank waiting for another?)"
    runs = sorted(Path(out).glob("*/metrics.jsonl"))
    records = [json.loads(line) for line in runs[-1].read_text().splitlines()] if runs else []
    summary = next((r for r in records if r["kind"] == "summary"), None)
    if proc.returncode or summary is None:
        return None, _error_line(stderr)
    return {**summary, "run_dir": runs[-1].parent}, ""


@dataclass(frozen=True)
class Comparison:
    max_diff: float  # largest |distributed - single| over every parameter element
    where: str  # the tensor it is in
    relative: float  # ||distributed - single|| / ||single - initial||: the disagreement per unit of training


def compare_weights(distributed: Path, single: Path, initial: Path) -> Comparison:
    """How far apart the two runs' weights are, measured against how far training moved them.

    An element-wise tolerance can't tell noise from a real break under AdamW: it divides by
    sqrt(v) + eps, so where a gradient is ~0 (an attention key bias, whose true gradient is 0) a
    1e-10 rounding difference becomes a step of ~lr/100. A few such elements barely count in
    the norm over all weights, while a real break (BatchNorm, dropout) moves nearly all of them."""
    a, b, start = load_file(distributed), load_file(single), load_file(initial)
    if a.keys() != b.keys():
        return Comparison(float("inf"), f"different parameter names: {_few(sorted(a.keys() ^ b.keys()))}", float("inf"))
    keys = [k for k in sorted(b) if b[k].is_floating_point() and b[k].numel()]
    diffs = {k: (a[k].double() - b[k].double()) for k in keys}
    where = max(keys, key=lambda k: diffs[k].abs().max().item(), default="")
    apart = sum(d.square().sum().item() for d in diffs.values()) ** 0.5
    moved = sum((b[k].double() - start[k].double()).square().sum().item() for k in keys) ** 0.5
    relative = apart / moved if moved else (0.0 if apart == 0 else float("inf"))
    return Comparison(diffs[where].abs().max().item() if where else 0.0, where, relative)


def check_recipe(
    recipe,
    *,
    model: str,
    data: str,
    nproc: int = 2,
    steps: int = 3,
    batch_size: int = 8,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> Report:
    """Probe the model, then run `recipe` on `nproc` processes and on one, on the same global batch."""
    report = Report(
        [
            f"check {recipe.name} --model {model} --data {data}: {steps} steps on {nproc} processes "
            f"against 1 process on the same global batch"
        ]
    )
    torch.manual_seed(seed)
    built, batch = build_model(model), sample_batch(data, size=batch_size)  # a bad spec: one RecipeError line
    try:
        report.findings = probe(built, batch, seed=seed)
    except Exception as err:  # the model can't train on this data at all: no point in launching anything
        first = (str(err).strip().splitlines() or [""])[0]
        raise RecipeError(
            f"--model {model} --data {data}: one training step fails ({type(err).__name__}: "
            f"{first}); fix the model or the data first"
        ) from None
    args = [
        "-m",
        "recipes",
        "run",
        recipe.name,
        "--model",
        model,
        "--data",
        data,
        "--seed",
        str(seed),
        "--log-every",
        str(steps),
        "--timeout-s",
        str(min(timeout_s, 300.0)),
    ]
    with tempfile.TemporaryDirectory(prefix="tdr-check-") as tmp:  # the user's cwd stays: their modules import
        runs, failure = _three_runs(args, tmp=tmp, nproc=nproc, steps=steps, batch_size=batch_size, timeout_s=timeout_s)
        if failure:
            return _verdict(report, failure)
        found = compare_weights(*(Path(r["run_dir"], "model.safetensors") for r in runs))
    distributed, single, _ = runs
    loss_diff = abs(distributed["train_loss"] - single["train_loss"])
    loss_tol = LOSS_RTOL * max(abs(single["train_loss"]), 1.0)
    report.lines += [
        f"  global batch {distributed['global_batch']} on each side",
        f"  largest parameter difference  {found.max_diff:.3g}{f' ({found.where})' if found.where else ''}",
        f"  weights apart / moved by training  {found.relative:.3g}; tolerance {REL_TOL:g}: "
        f"{'within' if found.relative <= REL_TOL else 'OUTSIDE'}",
        f"  training loss difference      {loss_diff:.3g} ({distributed['train_loss']:.6g} against "
        f"{single['train_loss']:.6g}); tolerance {loss_tol:.3g}: {'within' if loss_diff <= loss_tol else 'OUTSIDE'}",
    ]
    report.equivalent = found.relative <= REL_TOL and loss_diff <= loss_tol
    return _verdict(report, None if report.equivalent else "the weights or the loss differ beyond the tolerance")


def _three_runs(
    args: list[str], *, tmp: str, nproc: int, steps: int, batch_size: int, timeout_s: float
) -> tuple[list[dict], str]:
    """The recipe on `nproc` processes, on one with the global batch, and its weights before any step."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    distributed, why = _finish(
        _start(
            [
                *torchrun,
                *args,
                "--max-steps",
                str(steps),
                "--batch-size",
                str(batch_size),
                "--out",
                f"{tmp}/distributed",
            ]
        ),
        out=f"{tmp}/distributed",
        timeout_s=timeout_s,
    )
    if distributed is None:
        return [], f"the run on {nproc} processes failed: {why}"
    distributed.setdefault("global_batch", batch_size * nproc)
    batch = str(distributed["global_batch"])  # as the recipe itself counts it (tensor parallel: one batch)
    # One process on the global batch, and the weights before any step (--epochs 0), side by side.
    single = _start([sys.executable, *args, "--max-steps", str(steps), "--batch-size", batch, "--out", f"{tmp}/single"])
    initial = _start([sys.executable, *args, "--epochs", "0", "--batch-size", batch, "--out", f"{tmp}/initial"])
    (single, why), (initial, why_initial) = (
        _finish(single, out=f"{tmp}/single", timeout_s=timeout_s),
        _finish(initial, out=f"{tmp}/initial", timeout_s=timeout_s),
    )
    if single is None or initial is None:
        return [], f"the single-process run (batch {batch}) failed: {why or why_initial}"
    return [distributed, single, initial], ""


def _verdict(report: Report, failure: str | None) -> Report:
    if failure is None:
        report.lines.append(
            "equivalent: yes: distributed training of this model matches one process"
            + (" (but see the warnings)" if report.findings else "")
        )
        report.lines += [f"warning: {f.cause}: {f.detail}" for f in report.findings]
        return report
    report.lines.append(f"equivalent: NO: {failure}")
    for finding in report.findings:
        report.lines.append(f"likely cause: {finding.cause}: {finding.detail}")
    if not report.findings:
        report.lines.append(
            "likely cause: none of the usual ones (unused parameters, BatchNorm, randomness, "
            "non-deterministic ops) is in the model; look for code that depends on the rank or "
            "on the batch size, e.g. a loss summed instead of averaged over the batch"
        )
    return report

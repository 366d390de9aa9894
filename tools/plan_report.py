"""The memory plan for people and for the launchers: the table, whether it fits, and what would fit instead
(re-planned, never guessed)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

from core.kernel.job import RecipeError
from tools.options import UsageError, env_number, parse_args
from tools.plan import Plan, plan_recipe
from tools.plan_fixed import GIB, Fixed, fixed_terms, gpu_job, over, parse_fixed
from tools.plan_layout import REPLICAS, mesh_dims
from tools.registry import RECIPES

SHARDED = ("fsdp", "fsdp_tp", "tensor_parallel", "pipeline")
MAX_NPROC = 2**16  # the largest job the plan takes (--nproc, or the launcher's WORLD_SIZE)


def gib(n: int) -> str:
    """GiB with two decimals, or three significant digits below 0.1 GiB (a small model's plan is not all zeros)."""
    value = n / GIB
    return f"{value:.2f}" if value >= 0.1 or value == 0 else f"{value:.3g}"


def table(plan: Plan) -> str:
    """GiB per rank, the largest first; ranks that hold alike share a row; what dominates each peak."""
    groups: dict[tuple, list[int]] = {}
    for r in plan.ranks:
        groups.setdefault(dataclasses.astuple(dataclasses.replace(r, rank=0)), []).append(r.rank)
    rows = [("ranks", "params", "grads", "optimizer", "activations", "buckets", "peak", "dominated by")]
    notes: list[str] = []
    for _, ranks in sorted(groups.items(), key=lambda item: (-item[0][5], item[1][0])):
        r = plan.ranks[ranks[0]]
        values = (r.params_bytes, r.grads_bytes, r.optimizer_bytes, r.activations_bytes, r.buffers_bytes)
        terms = dict(zip(("params", "grads", "optimizer", "activations", "DDP buckets"), values))
        top = max(terms, key=terms.get)
        share = f"{top} ({100 * terms[top] / max(r.peak_bytes, 1):.0f}%)"
        rows.append((_span(ranks), *map(gib, values), gib(r.peak_bytes), share))
        notes += [f"  rank{'s' * (len(ranks) > 1)} {_span(ranks)}: {note}" for note in r.notes]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.rjust(w) if i and i < 7 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    head = f"{plan.recipe} on {plan.world_size} rank{'s' * (plan.world_size > 1)}, GiB per rank"
    return "\n".join([head, *(line.rstrip() for line in lines), *notes])


def _span(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def alternatives(name: str, cfg, *, world_size: int) -> list[tuple[str, str, object, int]]:
    """(label, recipe, cfg, world size) for each change that could lower the largest rank's peak."""
    found = []
    if hasattr(cfg, "accum") and cfg.batch_size > 1:
        b, k = cfg.batch_size, cfg.accum
        while b % 2 == 0 and b > 1:  # the same global batch: half the samples per micro-batch, twice the steps
            b, k = b // 2, k * 2
            changes = {"batch_size": b, "accum": k}
            if name == "pipeline":
                changes["microbatches"] = min(cfg.microbatches, b)
            found.append((f"--batch-size {b} --accum {k}", name, dataclasses.replace(cfg, **changes), world_size))
    if name in REPLICAS or name == "dp":
        args = ["--model", cfg.model, "--data", cfg.data, "--batch-size", str(cfg.batch_size), "--loss", cfg.loss]
        bf16 = ["--precision", "bf16"] if getattr(cfg, "precision", "fp32") != "fp32" else []
        accum = ["--accum", str(cfg.accum)] if hasattr(cfg, "accum") else []
        found.append(("fsdp", "fsdp", parse_args(RECIPES["fsdp"].load().Config, [*args, *bf16, *accum])[0], world_size))
        if name != "dp":
            checkpointed = parse_args(RECIPES["ddp_monitored"].load().Config, [*args, "--activation-checkpointing"])[0]
            found.append(("ddp_monitored --activation-checkpointing", "ddp_monitored", checkpointed, world_size))
    if name in SHARDED:  # a layout more ranks do not allow (heads, stages) is refused by the recipe's check
        found += [(f"--nproc {world_size * f}", name, cfg, world_size * f) for f in (2, 4)]
    return found


def what_fits(
    name: str, cfg, *, world_size: int, device_bytes: int, gpu: bool | None = None, fixed: str | None = None
) -> tuple[list[str], list[str]]:
    """Each alternative re-planned, as 'LABEL (NEED GiB)': the first that fits of each kind, else the closest."""
    fits, misses, done = [], [], set()
    for label, recipe, other, world in alternatives(name, cfg, world_size=world_size):
        kind = label.split()[0]
        if kind in done:
            continue
        try:
            peak = plan_recipe(recipe, other, world_size=world, gpu=gpu).largest.peak_bytes
            need = peak if fixed is None else fixed_of(recipe, other, world_size=world, spec=fixed).need(peak)
        except Exception:  # not a layout this model or shape allows: not an alternative
            continue
        if need <= device_bytes:
            fits.append(f"{label} ({gib(need)} GiB)")
            done.add(kind)
        else:
            misses.append((kind, f"{label} ({gib(need)} GiB)"))
    closest = {kind: text for kind, text in misses if kind not in done}  # the last tried: smallest batch, most ranks
    return fits, list(closest.values())


def refuse_if_over(
    name: str, cfg, plan: Plan, *, device_bytes: int, where: str, gpu: bool | None = None, fixed: str | None = None
) -> None:
    """When the largest rank's peak (plus, with `fixed`, its fixed terms) does not fit: one line saying what would."""
    top = plan.largest
    terms = None if fixed is None else fixed_of(name, cfg, world_size=plan.world_size, spec=fixed)
    if not over(top.peak_bytes, terms, device_bytes):
        return
    fits, misses = what_fits(name, cfg, world_size=plan.world_size, device_bytes=device_bytes, gpu=gpu, fixed=fixed)
    would = f"; would fit: {', '.join(fits)}" if fits else "; no smaller batch, layout or more ranks found that fits"
    would += f"; would not: {', '.join(misses)}" if misses else ""
    need = f"rank {top.rank}'s peak {gib(top.peak_bytes)} GiB"
    if terms is not None:  # both numbers in the one line: what the rank needs, what there is
        need += f" + fixed terms {gib(terms.total(top.peak_bytes))} GiB = {gib(terms.need(top.peak_bytes))} GiB"
        would += "; TDR_FIXED (or plan's --fixed) sets the fixed terms (docs/memory-plan.md)"
    raise RecipeError(f"plan: {need} does not fit {where} ({gib(device_bytes)} GiB){would}")


def fixed_of(name: str, cfg, *, world_size: int, spec: str) -> Fixed:
    """The fixed terms of one process of recipe `name`'s job; `spec`: --fixed, or "" for TDR_FIXED's (or defaults)."""
    return fixed_terms(dims=mesh_dims(name, cfg, world_size), world_size=world_size, spec=spec or None)


def free_bytes(*, world_size: int) -> tuple[int, str, int]:
    """(bytes free, what that is, how many ranks share it): the least free GPU, or the CPU's available memory."""
    if gpu_job():
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        return free, "the free memory of the GPUs", 1
    named = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("NPROC_PER_NODE") or ""  # a node's ranks, if said
    local = int(named) if named.isdigit() and int(named) > 0 else world_size
    available = _mem_available() or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available, f"this machine's available memory for {local} rank{'s' * (local > 1)}", local


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0


def precheck_memory(name: str, cfg, *, world_size: int) -> None:
    """The launchers' memory check: print the plan's largest peak, refuse a job whose plan exceeds free memory."""
    talk = os.environ.get("RANK", "0") == "0"
    try:
        plan = plan_recipe(name, cfg, world_size=world_size)
    except Exception as err:  # a job the plan cannot follow (or a fault of the plan's) is not refused for it
        if talk:
            said = f"the plan failed ({err!r:.200})"
            said = str(err).removeprefix("plan: ") if isinstance(err, RecipeError) else said
            print(f"warning: {' '.join(said.split())}; memory not checked", file=sys.stderr, flush=True)
        return
    free, where, sharing = free_bytes(world_size=world_size)
    top = plan.largest
    fixed = "" if gpu_job() else None  # on GPUs the fixed terms too (TDR_FIXED sets them); on CPUs the plan alone
    if talk:
        terms = "" if fixed is None else fixed_of(name, cfg, world_size=world_size, spec=fixed).total(top.peak_bytes)
        terms = terms and f" + fixed terms {gib(terms)} GiB"
        peak = f"largest peak {gib(top.peak_bytes)} GiB per rank (rank {top.rank}){terms}"
        print(f"plan: {peak}; {where}: {gib(free)} GiB", file=sys.stderr, flush=True)
    refuse_if_over(name, cfg, plan, device_bytes=free // sharing, where=where, fixed=fixed)


def plan_options(args: list[str]) -> tuple[dict, list[str]]:
    """The plan's own options out of a recipe's command line: ({nproc, device_memory, as_json, fixed}, the rest)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--nproc", default=None)
    parser.add_argument("--device-memory", default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--fixed", default="")
    own, rest = parser.parse_known_args(args)
    parse_fixed(own.fixed)  # a term or value it does not take: one line, before anything is planned
    if own.nproc is None:  # the launcher's WORLD_SIZE, or one process
        nproc, said = env_number("WORLD_SIZE", 1), f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}"
    else:
        nproc, said = int(own.nproc) if own.nproc.strip().isdigit() else None, f"--nproc {own.nproc}"
    if nproc is None or not 1 <= nproc <= MAX_NPROC:
        raise UsageError(f"{said}: use 1 to {MAX_NPROC} processes (a whole number), e.g. --nproc 8")
    memory = None
    if own.device_memory is not None:
        try:
            memory = float(own.device_memory)
        except ValueError:
            memory = float("nan")
        if not (math.isfinite(memory) and memory > 0):
            raise UsageError(
                f"--device-memory {own.device_memory}: give the device's memory in GiB, a positive number (e.g. 80)"
            )
    return {"nproc": nproc, "device_memory": memory, "as_json": own.json, "fixed": own.fixed}, rest


def show_plan(name: str, cfg, *, nproc: int, device_memory: float | None, as_json: bool, echo, fixed: str = "") -> None:
    """`python -m recipes plan`: the plan and a GPU process's fixed terms, then one line when they do not fit."""
    gpu = True if device_memory is not None else None  # --device-memory plans for a GPU: foreach, 512-byte blocks
    plan = plan_recipe(name, cfg, world_size=nproc, gpu=gpu)
    top = plan.largest
    terms = fixed_of(name, cfg, world_size=nproc, spec=fixed)
    if as_json:  # the per-rank keys as they were; the fixed terms of the largest rank's process as their own keys
        echo(json.dumps(plan.to_json() | {"fixed": terms.to_json(top.peak_bytes)}))
    else:
        echo("\n".join([table(plan), *terms.block(top.peak_bytes, rank=top.rank, gib=gib)]))
    if device_memory is not None:
        device = int(device_memory * GIB)
        refuse_if_over(name, cfg, plan, device_bytes=device, where="the device's memory", gpu=gpu, fixed=fixed)

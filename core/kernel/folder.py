"""The run folder: a new OUT/NAME-N, or the one of the checkpoint a run resumes; rank 0 chooses, every rank gets it."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import torch.distributed as dist

from core.kernel.ckpt import newest_good, read_checkpoint
from core.kernel.log import RunFolder, open_log, os_error_line, say
from core.kernel.options import RecipeError
from core.kernel.pg import Topology
from core.kernel.seams import BEFORE_JOB, ON_OPEN, RESUME_CHECKS, TRAINS_ON

# The options that shape what is trained: a resumed run keeps them, or it would be another run.
TRAJECTORY = ("lr", "seed", "model", "data", "loss", "precision", "accum", "clip", "epochs", "max_steps", "init_from")
IMPLIED = {"precision": "fp32", "accum": 1, "clip": 0.0}  # how a recipe that does not take the option trains


def finished(cfg, topo: Topology, *, recipe: str) -> dict | None:
    """The summary of the finished run --resume continues, said in one line (nothing is touched); else None."""
    found, resume = None, cfg.resume or "auto" * (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0")
    if topo.rank == 0 and resume:  # rank 0 reads the folder: other nodes need not see it
        ckpt = Path(resume).parent  # RUN/ckpt/step-N continues RUN
        runs = [ckpt.parent] * (ckpt.name == "ckpt") if resume != "auto" else run_dirs(cfg.out, cfg.name or recipe)[-1:]
        with contextlib.suppress(IndexError, KeyError, OSError, ValueError):  # no run, no record, or a torn last line
            last = json.loads((runs[0] / "metrics.jsonl").read_bytes().splitlines()[-1])  # the summary is written last
            if last.pop("kind") == "summary" and not any(hook(cfg, runs[0], resume) for hook in TRAINS_ON):
                found = {**last, "already_finished": True}
                print(f"{runs[0]} already finished at step {last.get('steps')}; nothing to train", flush=True)
    dist.broadcast_object_list(box := [found], src=0)  # rank 0's finding, on every rank
    return box[0]


def open_run(cfg, topo: Topology, *, recipe: str, global_batch: int) -> RunFolder:
    """Rank 0 picks the run folder, refusing a checkpoint that cannot continue in this job; every rank gets it."""
    config = {"recipe": recipe, "world_size": topo.world_size, "global_batch": global_batch, **vars(cfg)}
    prefix, choice = cfg.name or recipe, None
    resume = cfg.resume or "auto" * (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0")  # torchrun restarted it
    if topo.rank == 0:
        open_log(None)  # the lines said while choosing go into train.log
        try:
            runs = run_dirs(cfg.out, prefix)
            path = (newest_good(runs[-1]) if runs else None) if resume == "auto" else Path(resume) if resume else None
            if resume == "auto" and not path:  # not silently a new run
                where = f"{runs[-1]}, the newest {prefix} run, has no usable checkpoint" if runs else f"no {prefix} run"
                say(None, f"--resume auto: {where} in {cfg.out}; starting a new run")
            if path:
                check_continues(path, read_checkpoint(path, tensors=False)[1], config)
            in_run = bool(path) and path.resolve().parent.parent in [r.resolve() for r in runs]
            choice = (path.parent.parent if in_run else run_dirs(cfg.out, prefix, new=True)[-1], path)
            for hook in ON_OPEN:  # before anything in the folder is written: its lock, config.json
                hook(choice[0], config, new=not in_run)
        except (RecipeError, OSError) as err:  # every rank raises it: none waits for a folder that never comes
            choice = os_error_line(err) if isinstance(err, OSError) else str(err)
    dist.broadcast_object_list(box := [choice], src=0)  # rank 0's choice, on every rank
    if isinstance(choice := box[0], str):
        raise RecipeError(choice)
    run = RunFolder(*choice, recipe, config, topo.rank == 0)
    open_log(run)
    say(run, f"run folder {run.path}", level="DEBUG")  # on stderr, where a launcher's supervisor reads it
    for hook in BEFORE_JOB:
        hook(cfg, run)
    return run


def check_continues(path: Path, meta: dict[str, str], config: dict) -> None:
    """One RecipeError line, naming both sides and the fix, when the checkpoint would train another run here."""
    allowed = {key for check in RESUME_CHECKS for key in check(path, meta, config) or ()}  # the longer plug-in's
    saved, batch, now = json.loads(meta.get("config", "{}")), int(meta.get("global_batch", 0)), config["global_batch"]
    if batch and batch != now:  # every later step would differ
        per_rank, rest = divmod(batch, now // config["batch_size"])  # this job's ranks x --accum
        fix = f"--batch-size {per_rank}" if not rest else f"a number of ranks that divides {batch}"
        raise RecipeError(f"{path}: saved with global batch {batch} and this job's is {now}; use {fix}")
    both = [k for k in TRAJECTORY if (k in IMPLIED or k in saved and k in config) and k not in allowed]
    old, new = ({k: side.get(k, IMPLIED.get(k)) for k in both} for side in (saved, config))
    if differ := [k for k in both if old[k] != new[k]]:
        changed = ", ".join(f"--{k.replace('_', '-')} {old[k]} -> {new[k]}" for k in differ)
        fix = [saved.get("recipe", "")] * any(k not in config for k in differ)  # an option this recipe lacks
        fix += [f"--{k.replace('_', '-')} {old[k]}" for k in differ]
        raise RecipeError(f"{path}: other options ({changed}) would train another run; resume with {' '.join(fix)}")


def run_dirs(out: str, prefix: str, *, new: bool = False) -> list[Path]:
    """The folders OUT/PREFIX-N, lowest N first; new: and the next one, made now so that no other job takes it."""
    name = re.compile(re.escape(prefix) + r"-(\d+)")
    named = sorted((int(m[1]), p) for p in Path(out).glob("*") if (m := name.fullmatch(p.name)))  # none: no folder
    if new:
        path = Path(out) / f"{prefix}-{named[-1][0] + 1 if named else 1}"
        try:
            path.mkdir(parents=True)
        except FileExistsError:  # another job took it between the listing and the mkdir
            return run_dirs(out, prefix, new=True)
        named.append((0, path))
    return [p for _, p in named]

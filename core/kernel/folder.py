"""The run folder: a new OUT/NAME-N, or the one of the checkpoint a run resumes; rank 0 chooses, every rank gets it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from pathlib import Path

import torch.distributed as dist

from core.kernel.ckpt import newest_good, read_checkpoint
from core.kernel.log import RunFolder, keep_lines, open_log, os_error_line, say, show
from core.kernel.options import RecipeError
from core.kernel.pg import Topology
from core.kernel.seams import BEFORE_JOB, ON_OPEN, RESUME_CHECKS, TRAINS_ON

# The options that shape what is trained: a resumed run must keep them, or it would be another run. A recipe that
# does not take one trains as IMPLIED says.
TRAJECTORY = ("lr", "seed", "model", "data", "loss", "precision", "accum", "clip", "epochs", "max_steps", "init_from")
IMPLIED = {"precision": "fp32", "accum": 1, "clip": 0.0}
LENGTH = ("epochs", "max_steps")  # larger ones (0 steps: no limit) train on from a checkpoint at its run's end


def finished(cfg, topo: Topology, *, recipe: str) -> dict | None:
    """The summary of the finished run --resume continues, said in one line (nothing is touched); else None."""
    dist.broadcast_object_list(box := [finished_run(cfg, cfg.name or recipe) if topo.rank == 0 else None], src=0)
    found = box[0]
    if found and topo.rank == 0:
        print(f"{found[0]} already finished at step {found[1].get('steps')}; nothing to train", flush=True)
    return found and {**found[1], "already_finished": True}


def finished_run(cfg, prefix: str) -> tuple[str, dict] | None:
    """(the run folder, its summary) when --resume continues a run whose metrics.jsonl ends with its summary."""
    resume = resume_of(cfg)
    if resume == "auto":
        runs = run_dirs(cfg.out, prefix)[-1:]
    else:
        runs = [Path(resume).parent.parent] if Path(resume).parent.name == "ckpt" else []
    try:  # the summary is the last record: nothing is written after it
        last = json.loads((runs[0] / "metrics.jsonl").read_bytes().splitlines()[-1])
    except (IndexError, OSError, ValueError):  # no run, no record, or a torn last line: not finished
        return None
    if last.get("kind") != "summary" or any(trains_on(cfg, runs[0], resume) for trains_on in TRAINS_ON):
        return None
    return str(runs[0]), {k: v for k, v in last.items() if k != "kind"}


def resume_of(cfg) -> str:
    """'auto', a checkpoint path, or '' (a new run): torchrun's restart of a job resumes it as 'auto' does."""
    return cfg.resume or ("auto" if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) else "")


def open_run(cfg, topo: Topology, *, recipe: str, global_batch: int) -> RunFolder:
    """Rank 0 picks the run folder and checks that the checkpoint it resumes can continue in this job; every rank
    gets the same folder, or raises the same error."""
    config = {"recipe": recipe, "world_size": topo.world_size, "global_batch": global_batch, **vars(cfg)}
    choice = None
    if topo.rank == 0:
        try:
            keep_lines()  # the lines said while choosing go into train.log
            choice = _take_folder(cfg, config)
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


def _take_folder(cfg, config: dict) -> tuple[Path, Path | None]:
    prefix, resume = cfg.name or config["recipe"], resume_of(cfg)
    runs = run_dirs(cfg.out, prefix)
    resume_from = Path(resume) if resume not in ("", "auto") else None
    if resume == "auto" and (resume_from := newest_good(runs[-1]) if runs else None) is None:  # not silently new
        where = f"{runs[-1]}, the newest {prefix} run, has no usable checkpoint" if runs else f"no {prefix} run"
        show(f"--resume auto: {where} in {cfg.out}; starting a new run")
    if resume_from is not None:
        check_continues(resume_from, read_checkpoint(resume_from, tensors=False)[1], config)
    in_run = resume_from is not None and resume_from.resolve().parent.parent in [r.resolve() for r in runs]
    path = resume_from.parent.parent if in_run else new_run_dir(cfg.out, prefix)
    for hook in ON_OPEN:  # before anything in the folder is written: its lock, config.json
        hook(path, config, new=not in_run)
    return path, resume_from


def check_continues(path: Path, meta: dict[str, str], config: dict) -> None:
    """One RecipeError line, naming both sides and the fix, when the checkpoint would train another run here: another
    global batch, or another value of an option that shapes training."""
    for check in RESUME_CHECKS:
        check(path, meta, config)
    saved_batch, global_batch = int(meta.get("global_batch", 0)), config["global_batch"]
    if saved_batch and saved_batch != global_batch:  # every later step would differ
        dp = config["world_size"]
        per_rank, rest = divmod(saved_batch, dp * config.get("accum", 1))  # --accum as it is: the line shows it
        fix = f"a number of ranks that divides {saved_batch}" if rest else f"--batch-size {per_rank} at {dp} rank(s)"
        was = f"saved with global batch {saved_batch} ({meta.get('world_size', '?')} rank(s))"
        accum = f" x --accum {config['accum']}" if "accum" in config else ""
        now = f"{global_batch} (--batch-size {config['batch_size']} x {dp} ranks{accum})"
        raise RecipeError(f"{path}: {was} and this job's is {now}; the run would change: use {fix}")
    saved, end = json.loads(meta.get("config", "{}")), json.loads(meta.get("scheduler", "{}"))
    ended = end.get("last_epoch", 0) >= end.get("T_max", 1)  # saved at its run's end: larger ones train on
    longer = [k for k in LENGTH if ended and (config[k] or math.inf) >= (saved.get(k) or math.inf)]
    both = [k for k in TRAJECTORY if (k in IMPLIED or (k in saved and k in config)) and k not in longer]
    old, new = ({k: side.get(k, IMPLIED.get(k)) for k in both} for side in (saved, config))
    if differ := [k for k in both if old[k] != new[k]]:
        recipe, saved_recipe = config["recipe"], meta.get("recipe") or saved.get("recipe")
        across = f"a checkpoint of {saved_recipe} resumed by {recipe}: " if saved_recipe not in (None, recipe) else ""
        changed = ", ".join(f"--{k.replace('_', '-')} {old[k]} -> {new[k]}" for k in differ)
        fix = " ".join(f"--{k.replace('_', '-')} {old[k]}" for k in differ)
        fix = f"{saved_recipe} {fix}" if any(k not in config for k in differ) else fix  # an option this recipe lacks
        raise RecipeError(
            f"{path}: {across}resuming with other options ({changed}) would train another run; resume with {fix} (the "
            f"options it was started with), or start a new run without --resume"
        )


def run_dirs(out: str, prefix: str) -> list[Path]:
    """The folders `out/prefix-N`, oldest (lowest N) first."""
    named = re.compile(re.escape(prefix) + r"-(\d+)")
    found = [(int(m[1]), p) for p in Path(out).glob("*") if (m := named.fullmatch(p.name))]  # none if no folder
    return [p for _, p in sorted(found)]


def new_run_dir(out: str, prefix: str) -> Path:
    """`out/prefix-N`, one past the highest, created now so that no other job takes it."""
    while True:
        taken = run_dirs(out, prefix)
        path = Path(out) / f"{prefix}-{int(taken[-1].name.rsplit('-', 1)[1]) + 1 if taken else 1}"
        with contextlib.suppress(FileExistsError):  # another job took it between the listing and the mkdir
            path.mkdir(parents=True)
            return path

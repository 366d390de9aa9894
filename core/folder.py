"""The run folder: which one a run writes (new, or the one it resumes), the checks a resume must pass, its records.

    runs/ddp-3/config.json       the options, the recipe, the world size (written once, by a fresh run)
    runs/ddp-3/metrics.jsonl     one JSON object a line: kind = train | eval | resume | summary
    runs/ddp-3/model.safetensors final weights of the plain model
    runs/ddp-3/ckpt/             checkpoints
    runs/ddp-3/.lock             held (flock) by the job that writes the folder

Only rank 0 writes or prints; every number it writes has been reduced over the ranks first.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from core.config import flag
from core.dist import Topology, broadcast_object
from core.kernel.job import RecipeError, open_log, os_error_line, say
from core.kernel.seams import BEFORE_JOB
from core.kernel.store import run_dirs
from core.plugins.lock import remove_stale_temporaries, take_lock
from core.plugins.records import write_config
from core.records import RunFolder

SHARDED = ("fsdp", "fsdp_tp", "tensor_parallel", "pipeline", "pipeline_naive")  # their state is laid out by the mesh
# Options that shape what is trained: a resumed run must keep them, or it would be another run.
TRAJECTORY = ("lr", "seed", "model", "data", "loss", "precision", "accum", "clip", "epochs", "max_steps", "init_from")
IMPLIED = {"precision": "fp32", "accum": 1, "clip": 0.0}  # how a recipe that does not take the option trains (ddp)


def open_run(cfg, topo: Topology, *, recipe: str, global_batch: int, newest, header, dp: int = 0) -> RunFolder:
    """Rank 0 picks the run folder, checks the checkpoint it resumes, locks it (a copy: `--with lock`); every rank
    gets the same folder.

    The folder is a new out/NAME-N, or the resumed checkpoint's; rank 0 checks that the checkpoint can continue in
    this job, takes the folder's lock and writes config.json. `newest(run_dir)`: the newest good checkpoint there;
    `header(path)`: a checkpoint's metadata; `dp`: the data-parallel ranks (default: all)."""
    config = {"recipe": recipe, "world_size": topo.world_size, "global_batch": global_batch, **vars(cfg)}
    choice, lock = None, None
    if topo.rank == 0:
        try:
            open_log(None)  # the resume's lines, said before train.log exists, go into it
            choice = _take_folder(cfg, config, newest=newest, header=header, dp=dp or topo.world_size)
            lock = choice.pop("lock", None)  # an open file: it stays with rank 0, the others get the folder
        except (RecipeError, OSError) as err:  # every rank raises it: none waits for a folder that never comes
            choice = os_error_line(err) if isinstance(err, OSError) else str(err)  # (an --out it cannot write)
    choice = broadcast_object(choice)
    if isinstance(choice, str):
        raise RecipeError(choice)
    run = RunFolder(choice["path"], choice["resume_from"], recipe, config, topo.rank == 0, lock)
    open_log(run)  # rank 0: from here every line it prints also goes to RUN/train.log
    say(run, f"run folder {run.path}", level="DEBUG")  # on stderr, where the launcher's supervisor reads it
    for hook in BEFORE_JOB:  # the kernel's plug-ins (take_back) serve this recipe too
        hook(cfg, run)
    return run


def finished(cfg, topo: Topology, *, recipe: str, header) -> dict | None:
    """A run that --resume (or torchrun's restart) continues and that is finished: its summary record, said in one
    line; None when there is something to train. Decided from the folder alone, before anything is built, checked,
    locked or written, so a finished run resumed at any world size trains nothing and leaves every file as it is."""
    # rank 0 reads the folder: other nodes need not see it
    done = finished_run(cfg.out, cfg.name or recipe, resume_of(cfg), cfg, header=header) if topo.rank == 0 else None
    found = broadcast_object(done)
    if found and topo.rank == 0:
        print(f"{found[0]} already finished at step {found[1].get('steps')}; nothing to train", flush=True)
    return found and {**found[1], "already_finished": True}


def finished_run(out: str | os.PathLike, prefix: str, resume: str, cfg=None, header=None) -> tuple[str, dict] | None:
    """(the folder, its summary record) when `resume` ('auto', or a checkpoint RUN/ckpt/step-N) continues a run that
    is finished: one whose metrics.jsonl holds its summary record. The summary is written last, after
    model.safetensors and hf/, so a run stopped before it (a kill during the hf/ write) is not finished: its final
    checkpoint, resumed, writes what is missing. With `cfg` and `header` (a checkpoint's metadata): a run whose
    checkpoint was saved with another --epochs or --max-steps is not finished (it trains longer: check_continues
    refuses fewer steps)."""
    if resume == "auto":
        runs = run_dirs(out, prefix)[-1:]
    else:
        runs = [Path(resume).parent.parent] if Path(resume).parent.name == "ckpt" else []
    try:  # the summary is the last record: nothing is written after it
        last = json.loads((runs[0] / "metrics.jsonl").read_bytes().splitlines()[-1])
    except (IndexError, OSError, ValueError):  # no run, no record, or a torn last line: not finished
        return None
    if cfg is not None and last.get("kind") == "summary" and asks_longer(runs[0], resume, cfg, header=header):
        return None
    return (str(runs[0]), {k: v for k, v in last.items() if k != "kind"}) if last.get("kind") == "summary" else None


def asks_longer(run_dir: Path, resume: str, cfg, *, header) -> bool:
    """Whether the checkpoint a finished run resumes (its newest, for 'auto') was saved with another --epochs or
    --max-steps than `cfg`'s; none, or a damaged one: no."""
    named = [p for p in (run_dir / "ckpt").glob("step-*") if re.fullmatch(r"step-\d+(\.safetensors)?", p.name)]
    path = max(named, key=lambda p: p.name, default=None) if resume == "auto" else Path(resume)
    try:
        saved = json.loads(header(path)["config"])
        return any(saved[k] != getattr(cfg, k) for k in ("epochs", "max_steps"))
    except (KeyError, RecipeError, TypeError, ValueError):  # none (None), or a damaged one
        return False


def resume_of(cfg) -> str:
    """'auto', a checkpoint path, or '' (a new run): torchrun's restart of a job resumes it as 'auto' does."""
    return cfg.resume or ("auto" if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) else "")


def _take_folder(cfg, config: dict, *, newest, header, dp: int) -> dict:
    prefix = cfg.name or config["recipe"]  # RUN/ckpt/step-N of this recipe's runs continues RUN; others start anew
    resume = resume_of(cfg)
    runs = run_dirs(cfg.out, prefix)
    if resume == "auto":
        resume_from = newest(runs[-1]) if runs else None
        if resume_from is None:  # not silently a new run
            where = f"{runs[-1]}, the newest {prefix} run, has no usable checkpoint" if runs else f"no {prefix} run"
            say(None, f"--resume auto: {where} in {cfg.out}; starting a new run")
    else:
        resume_from = Path(resume) if resume else None
    if resume_from is not None:
        check_continues(resume_from, header(resume_from), config, dp=dp)
    in_run = resume_from is not None and resume_from.resolve().parent.parent in [r.resolve() for r in runs]
    path = resume_from.parent.parent if in_run else run_dirs(cfg.out, prefix, new=True)[-1]
    found = {"path": path, "resume_from": resume_from}
    found["lock"] = take_lock(path)  # before anything in the folder is touched
    remove_stale_temporaries(path)  # left by a write that a kill interrupted
    write_config(path, config, new=not in_run)
    return found


def check_continues(path: Path, meta: dict[str, str], config: dict, *, dp: int) -> None:
    """Whether a checkpoint (its header `meta`) continues in this job: one RecipeError line when not.

    It must come from a recipe whose state means the same, have fp16's loss scaler on both sides or neither, the
    same global batch (`dp`: this job's data-parallel ranks), and the same options that shape training. The line
    names both sides and the fix. A copy without `checks` checks the global batch and the options: another one would
    silently train another run. A checkpoint at its run's end takes a larger --epochs or --max-steps: it trains
    longer."""
    check_layout(path, meta, config)
    saved_batch, global_batch = int(meta.get("global_batch", 0)), config["global_batch"]
    if saved_batch and saved_batch != global_batch:  # every later step would differ; the fix keeps it at `dp` ranks
        per_rank, rest = divmod(saved_batch, dp * config.get("accum", 1))  # --accum as it is: the line shows it
        fix = f"a number of ranks that divides {saved_batch}" if rest else f"--batch-size {per_rank} at {dp} rank(s)"
        was = f"saved with global batch {saved_batch} ({meta.get('world_size', '?')} rank(s))"
        accum = f" x --accum {config['accum']}" if "accum" in config else ""  # ddp takes no --accum
        now = f"{global_batch} (--batch-size {config['batch_size']} x {dp} ranks{accum})"
        raise RecipeError(f"{path}: {was} and this job's is {now}; the run would change: use {fix}")
    saved = json.loads(meta.get("config", "{}"))  # the options that shape training (TRAJECTORY), on both sides
    end = json.loads(meta.get("scheduler") or "{}")  # a checkpoint at its run's end: a larger length trains on
    ended = end.get("last_epoch", 0) >= end.get("T_max", 1)  # (0 steps: no limit)
    longer = [k for k in ("epochs", "max_steps") if ended and (config[k] or math.inf) >= (saved.get(k) or math.inf)]
    both = [k for k in TRAJECTORY if k in IMPLIED or (k in saved and k in config)]  # ddp's fp32 is a precision too
    both = [k for k in both if k not in longer]
    old, new = ({k: side.get(k, IMPLIED.get(k)) for k in both} for side in (saved, config))
    if differ := [k for k in both if old[k] != new[k]]:
        recipe, saved_recipe = config["recipe"], meta.get("recipe") or saved.get("recipe")
        across = f"a checkpoint of {saved_recipe} resumed by {recipe}: " if saved_recipe not in (None, recipe) else ""
        changed = ", ".join(f"{flag(k)} {old[k]} -> {new[k]}" for k in differ)
        fix = " ".join(f"{flag(k)} {old[k]}" for k in differ)
        fix = f"{saved_recipe} {fix}" if any(k not in config for k in differ) else fix  # an option this recipe lacks
        raise RecipeError(
            f"{path}: {across}resuming with other options ({changed}) would train another run; resume with {fix} (the "
            f"options it was started with), or start a new run without --resume"
        )


def check_layout(path: Path, meta: dict[str, str], config: dict) -> None:
    """A checkpoint of a recipe whose state is laid out otherwise, or with fp16's loss scaler on one side only."""
    saved, recipe = json.loads(meta.get("config", "{}")), config["recipe"]
    saved_recipe = meta.get("recipe") or saved.get("recipe")
    if saved_recipe and saved_recipe != recipe and {saved_recipe, recipe} & set(SHARDED):
        raise RecipeError(
            f"{path}: a checkpoint of recipe {saved_recipe}, and this run is {recipe}: its state is laid out for "
            f"{saved_recipe}; resume it with {saved_recipe}, or start a new run"
        )
    fp16, precision = json.loads(meta.get("scaler", "null")) is not None, config.get("precision", "fp32")
    if fp16 != (precision == "fp16"):  # the loss scaler's state exists on one side only
        was = "fp16" if fp16 else saved.get("precision", "fp32")
        raise RecipeError(
            f"{path}: a checkpoint trained in {was} and this run asks for --precision {precision}: fp16's loss-scaler "
            f"state does not carry across; resume with --precision {was}, or start a new run"
        )

"""Sharded checkpoints: every rank writes its own shard through torch.distributed.checkpoint (DCP), with the calls
of core.ckpt, so a sharded recipe differs from ddp_amp by `ckpt.` -> `dcp.`:

    run = folder.open_run(cfg, topo, ..., newest=dcp.newest_good, header=dcp.read_metadata)
    start = dcp.load_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler)
    dcp.save_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler, progress=progress, keep=cfg.keep)

    RUN/ckpt/step-000120/
      shard-0000R-model-00001-of-00001.safetensors   rank R-1's tensors (DCP's HuggingFaceStorageWriter)
      checkpoint.json                                  everything else, and what makes the folder complete

Tensors (keyed model/<fqn>, optim/state.<fqn>.<name> as torch's get_state_dict flattens the optimizer state,
rng/<rank>/<kind>): DTensor shards (fully_shard, TP, both) and plain tensors (pipeline stages); one held by several
ranks is written once. checkpoint.json: the run's metadata (recipe, config, global batch, world size, trackers),
progress, scheduler, scaler, the optimizer's hyper-parameters per parameter (param_groups.<fqn>.<name>), the
model's whole shapes, a checksum per tensor of every file (core.checksum) and one over itself. Non-tensor
values go there because DCP's safetensors writer would put them as raw bytes before the header.

Atomic: all ranks write into .step-N.tmp/, rank 0 adds checkpoint.json once every rank is done, then renames the
folder to step-N. A kill at any moment leaves the older checkpoints whole. A folder without a valid
checkpoint.json, or with a shard file missing or damaged, is passed over by `--resume auto` (a warning line) and
named in one line when --resume names it. Loading at another world size reshards (DCP reads each rank's new
slices from the saved chunks). All ranks must see the same folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from core.ckpt import START, train_longer
from core.ckpt_io import fsync_dir
from core.dcp_folder import (
    DONE,
    FORMAT,
    damage,
    extra_files,
    file_checksums,
    file_problems,
    list_sharded,
    read_info,
    write_json,
)
from core.dcp_tensors import rng_tensors, train_tensors, untied, whole_shapes
from core.dist import all_gather_object
from core.kernel.job import RecipeError, say
from core.records import RunFolder, write_record
from core.weights import check_model_matches, model_part

# --- checkpoint.json: read without a process group (the pre-check, and rank 0 picking a folder) ------------------


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """What core.ckpt.read_metadata gives of a one-file checkpoint, from checkpoint.json alone.

    Recipe, config, global_batch, world_size, trackers, scheduler, progress: strings. One RecipeError line when it
    isn't a good one."""
    info = read_info(Path(path))
    shape = {"world_size": str(info["world_size"]), "scheduler": json.dumps(info.get("scheduler") or {})}
    return {**info["metadata"], **shape, "progress": json.dumps(info["progress"])}


def newest_good(run_dir: Path) -> Path | None:
    """The newest checkpoint of RUN/ckpt whose checkpoint.json and every shard read back whole and undamaged.

    Rank 0 reads them all; a newer one is passed over in a warning line that names what is wrong."""
    checkpoints = list_sharded(Path(run_dir) / "ckpt")
    for path in reversed(checkpoints):
        info = read_info(path)
        problems = extra_files(path, info) + file_problems(path, info, sorted(info["checksums"]), values=True)
        if not problems:
            return path
        then = "taking the one before" if path != checkpoints[0] else "it is the oldest"
        say(None, f"warning: --resume auto: skipping {path}, damaged ({problems[0]}); {then}", level="WARNING")
    return None


def check_shapes(path: str | os.PathLike, model: nn.Module) -> None:
    """The pre-check: one RecipeError line when the checkpoint holds another model or lacks a shard file.

    `model`: the plain one (a meta-device one will do). A missing or unreadable shard file is named. The values
    are checked at load."""
    path = Path(path)
    info = read_info(path)
    problems = extra_files(path, info) + file_problems(path, info, sorted(info["checksums"]), values=False)
    if problems:
        raise RecipeError(damage(path, problems))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    fix = "resume with the --model it was trained with, or start a new run"
    check_model_matches(path, {k: tuple(v) for k, v in info["shapes"].items()}, expected, fix=fix)


# --- writing and reading the shards (collectives): core.ckpt's calls, for a recipe -------------------------------


def _first_os_error(err: BaseException, where: Path) -> BaseException:
    """The first OSError among a CheckpointException's ranks (with `where` as its file when it names none), else a
    RuntimeError with its text: an exception the error line reports, not a traceback past it."""
    for cause, _ in err.failures.values():
        if isinstance(cause, OSError):
            return cause if cause.filename else OSError(cause.errno, cause.strerror, str(where))
    return RuntimeError(str(err))


def save_checkpoint(run: RunFolder, *, model, optimizer, progress: dict, keep: int, **stateful) -> Path:
    """Every --ckpt-every steps: RUN/ckpt/step-N/, every rank its own shard; keep the newest `keep` (a collective).

    `model`: the (sharded) model, or core.schedules.root_module of a pipeline rank's stages; `stateful`: the scheduler
    (and the scaler), their state_dict() kept in checkpoint.json, with the run's metadata as core.ckpt's header has
    it."""
    import torch.distributed.checkpoint as dcp  # here: only sharded recipes load DCP

    ckpt_dir = run.path / "ckpt"
    final, tmp = ckpt_dir / f"step-{progress['step']:06d}", ckpt_dir / f".step-{progress['step']:06d}.tmp"
    if dist.get_rank() == 0:
        for stale in ckpt_dir.glob(".step-*.tmp"):  # left by a killed save: saves never overlap
            shutil.rmtree(stale)
        tmp.mkdir(parents=True)
    dist.barrier()
    tensors, optim = train_tensors(model, optimizer)
    tensors |= rng_tensors()  # each rank its own generator: bitwise resume
    try:
        dcp.save(untied(tensors), storage_writer=dcp.HuggingFaceStorageWriter(str(tmp), save_distributed=True))
    except dcp.api.CheckpointException as err:  # a BaseException holding every rank's: a full disk, as its OSError
        raise _first_os_error(err, tmp) from None
    mine = (file_checksums(tmp, rank=dist.get_rank()), optim)  # read back once every file is closed
    everyone, shapes = all_gather_object(mine), whole_shapes(tensors)
    metadata = {"recipe": run.recipe, "config": json.dumps(run.config), "global_batch": str(run.config["global_batch"])}
    metadata["trackers"] = json.dumps({k: v for sink in run.sinks for k, v in sink.state().items()})  # W&B's run id
    if dist.get_rank() == 0:
        info = {"format": FORMAT, "world_size": dist.get_world_size(), "torch": torch.__version__, "progress": progress}
        info |= {"metadata": metadata, "shapes": shapes}
        info |= {key: holder.state_dict() or None for key, holder in stateful.items()}  # a disabled GradScaler's: null
        info["optimizer"] = {k: v for _, values in everyone for k, v in values.items()}  # a pipeline's stages differ
        info["checksums"] = {name: sums for files, _ in everyone for name, sums in files.items()}
        write_json(tmp / DONE, info)
        aside = ckpt_dir / f".step-{progress['step']:06d}.old.tmp"
        if final.exists():  # the same step saved again (a run resumed from before it): swap it out first
            os.replace(final, aside)
        os.replace(tmp, final)
        fsync_dir(ckpt_dir)
        shutil.rmtree(aside, ignore_errors=True)
        for old in list_sharded(ckpt_dir)[:-keep]:  # only once the new one is in place
            shutil.rmtree(old)
    dist.barrier()
    return final


def _verify_files(path: Path, info: dict) -> None:
    """Every rank checks a share of the files (present, checksums, finite values); all ranks fail together."""
    rank, names = dist.get_rank(), sorted(info["checksums"])
    problems = file_problems(path, info, names[rank :: dist.get_world_size()], values=True)
    if rank == 0:
        problems += extra_files(path, info)
    problems = sorted(p for mine in all_gather_object(problems) for p in mine)
    if problems:
        raise RecipeError(damage(path, problems))


def _check_saved(path: Path, info: dict, tensors: dict) -> None:
    """One RecipeError line when the checkpoint holds another model than this job's (a collective: the whole shapes
    are gathered). The `checks` feature: without it DCP's own error says what does not fit."""
    check_model_matches(path, info["shapes"], whole_shapes(tensors), fix="resume with the --model it was trained with")


def load_checkpoint(run: RunFolder, *, model, optimizer, **stateful) -> dict:
    """The train state of the checkpoint the run continues from, every rank its own part; returns the progress.

    Resharded to this job's mesh (DTensor models), its generators too; START for a new run. A collective; `model` and
    `stateful` as save_checkpoint takes them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict  # here: only sharded recipes load DCP

    if run.resume_from is None:
        return dict(START)
    path = Path(run.resume_from)
    info = read_info(path)
    tensors, _ = train_tensors(model, optimizer)  # this rank's shapes and shards, for DCP to fill
    _check_saved(path, info, tensors)
    _verify_files(path, info)
    saved = {key for sums in info["checksums"].values() for key in sums}
    rng = {k: v for k, v in rng_tensors().items() if k in saved}  # none for a rank the saving job lacked
    dcp.load(untied(tensors) | rng, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
    optim = {k.removeprefix("optim/"): v for k, v in tensors.items() if k.startswith("optim/")}
    optim |= {k: tuple(v) if isinstance(v, list) else v for k, v in info["optimizer"].items()}  # JSON made betas lists
    set_state_dict(model, optimizer, model_state_dict=model_part(tensors), optim_state_dict=optim)  # unflattens it
    total = getattr(stateful.get("scheduler"), "T_max", None)  # this job's schedule length, before the checkpoint's
    for key, holder in stateful.items():  # a checkpoint without one (null: a disabled GradScaler) leaves it as it is
        holder.load_state_dict(info.get(key) or {})
    for key, value in rng.items():
        torch.set_rng_state(value) if key.endswith("/cpu") else torch.cuda.set_rng_state(value)
    progress = {**START, **{k: v for k, v in info["progress"].items() if k in START}}
    shape = {"world_size": run.config["world_size"], "global_batch": run.config["global_batch"]}
    where = {k: v for k, v in progress.items() if k != "window"}  # the window's sums are the meter's, not a record's
    write_record(run, {"kind": "resume", "checkpoint": str(path), **where, **shape})
    say(run, f"resumed from {path} at step {progress['step']}")
    if total is not None and stateful["scheduler"].T_max != total:  # a finished run given more steps trains longer
        train_longer(run, stateful["scheduler"], total)
    return progress

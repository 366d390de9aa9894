"""Sharded checkpoints: every rank writes its own shard through torch.distributed.checkpoint (DCP), then rank 0 writes
the kernel's checkpoint file beside them, so the kernel's run folder, resume checks and --resume auto read a sharded
run as they read any other:

    RUN/ckpt/step-000120/                 shard-0000R-model-00001-of-00001.safetensors: rank R-1's tensors
    RUN/ckpt/step-000120.safetensors      every rank's generators; its metadata: progress, scheduler, the optimizer's
                                          other values, and each shard file's checksums

The file, written last and atomically, makes the checkpoint: a folder without one is a save that was cut short, and
a file whose folder lost or damaged a shard is passed over by --resume auto and named when --resume names it. Loading
at another world size reshards (DCP reads each rank's new slices from the saved chunks). All ranks see the folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from core.kernel.ckpt import FORMAT, START, checksum, read_checkpoint, write_tensors
from core.kernel.log import RunFolder, say, write_record
from core.kernel.options import RecipeError
from core.kernel.pg import all_gather_object, broadcast_object
from core.kernel.seams import ON_RESUME, READ_CHECKS


def flat_state(model, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """The model's and the optimizer's tensors for DCP (DTensor shards, or a pipeline rank's stages), and the
    optimizer's other values: torch flattens its state by parameter name, which set_state_dict undoes on any mesh."""
    model_sd, optim = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    tensors = {f"model/{k}": v for k, v in model_sd.items()}
    tensors |= {f"optim/{k}": v for k, v in optim.items() if torch.is_tensor(v)}
    return tensors, {k: v for k, v in optim.items() if not torch.is_tensor(v)}


def untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each storage once (a tied weight under its first name): safetensors refuses shared memory, and loading the
    one fills the other names."""
    out, seen = {}, set()
    for key, value in tensors.items():
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor's shard on this rank
        where = (local.untyped_storage().data_ptr(), local.storage_offset(), local.shape) if local.numel() else key
        out |= {} if where in seen else {key: value}
        seen.add(where)
    return out


def save_sharded(run: RunFolder, *, model, optimizer, progress: dict, keep: int, **stateful) -> Path:
    """RUN/ckpt/step-N/ (every rank its own shard), then step-N.safetensors; all but the newest `keep` go (a
    collective). `stateful`: the scheduler (a scaler), their state_dict() in the file's metadata."""
    path = run.path / "ckpt" / f"step-{progress['step']:06d}.safetensors"
    shards = path.with_suffix("")
    if run.writer:  # the same step saved again (resumed from before it), or saves cut short: their folders go
        path.unlink(missing_ok=True)
        for old in [shards, *(p for p in path.parent.glob("step-*") if not p.with_suffix(".safetensors").exists())]:
            shutil.rmtree(old, ignore_errors=True)
        shards.mkdir(parents=True)
    dist.barrier()
    tensors, optim = flat_state(model, optimizer)
    try:
        dcp.save(untied(tensors), storage_writer=dcp.HuggingFaceStorageWriter(str(shards), save_distributed=True))
    except dcp.api.CheckpointException as err:  # every rank's errors: a full disk's OSError makes the error line
        raise next((e for e, _ in err.failures.values() if isinstance(e, OSError)), RuntimeError(str(err))) from None
    mine = {}
    for file in sorted(shards.glob(f"shard-{dist.get_rank() + 1:05d}-*.safetensors")):  # read back, once closed
        with safe_open(str(file), framework="pt") as f:
            mine[file.name] = {key: checksum(f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118
    rng = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    everyone = all_gather_object((mine, optim, rng))  # each rank its own generators: bitwise resume
    rest = {"config": run.config, "global_batch": run.config["global_batch"], "world_size": len(everyone)}
    rest |= {"progress": progress, "shards": {name: sums for files, _, _ in everyone for name, sums in files.items()}}
    rest["optimizer"] = {k: v for _, values, _ in everyone for k, v in values.items()}  # a pipeline's stages differ
    rest |= {key: holder.state_dict() or None for key, holder in stateful.items()}  # a disabled GradScaler's: null
    if run.writer:
        states = {f"rng/{rank}/{kind}": s for rank, (_, _, own) in enumerate(everyone) for kind, s in own.items()}
        metadata = {"format": FORMAT, "recipe": run.recipe, "torch": torch.__version__}
        write_tensors(path, states, metadata | {key: json.dumps(value) for key, value in rest.items()})
        for old in sorted(path.parent.glob("step-*.safetensors"), key=lambda p: (len(p.name), p.name))[
            :-keep
        ]:  # only once the new one is in place
            old.unlink(missing_ok=True)
            shutil.rmtree(old.with_suffix(""), ignore_errors=True)
    dist.barrier()
    return path


def check_shards(path: Path, tensors: dict, model) -> None:
    """READ_CHECKS: a sharded checkpoint's files (the folder beside it) all there and matching their checksums; the
    other checks (the `checks` plug-in's) see each file's tensors too."""
    shards, folder = json.loads(read_checkpoint(path, tensors=False)[1].get("shards", "null")), path.with_suffix("")
    if shards is None:  # a checkpoint of one file
        return
    problems = [f"{p.name} is not one of its files" for p in folder.glob("*.safetensors") if p.name not in shards]
    for name, sums in shards.items():
        try:
            with safe_open(str(folder / name), framework="pt") as f:  # checks the header and that no byte is missing
                found = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
        except Exception as err:  # noqa: BLE001 - missing, truncated or unreadable
            missing = isinstance(err, FileNotFoundError)
            problems.append(f"shard file {name} is {'missing' if missing else 'unreadable'}")
            continue
        wrong = [k for k, want in sums.items() if k not in found or checksum(found[k]) != want]
        problems += [f"tensor {k} in {name} does not match its checksum" for k in wrong]
        for check in (c for c in READ_CHECKS if c is not check_shards):
            check(folder / name, found, None)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        fix = f"resume from an older checkpoint in {path.parent} (--resume auto skips damaged ones)"
        raise RecipeError(f"{path}: {problems[0]}{more}; {fix}")


def load_sharded(run: RunFolder, *, model, optimizer, **stateful) -> dict:
    """The train state of the checkpoint the run continues from, resharded to this job's mesh, every rank its own part
    (rank 0 checks every file first); returns its progress (START for a new run). A collective."""
    if run.resume_from is None:
        return dict(START)
    payload = None
    if run.writer:
        try:
            payload = read_checkpoint(run.resume_from)
        except RecipeError as err:
            payload = str(err)  # every rank raises it
    payload = broadcast_object(payload)
    if isinstance(payload, str):
        raise RecipeError(payload)
    states, meta = payload
    tensors, _ = flat_state(model, optimizer)  # this rank's shapes and shards, for DCP to fill
    dcp.load(untied(tensors), storage_reader=dcp.HuggingFaceStorageReader(str(run.resume_from.with_suffix(""))))
    optim = {k.removeprefix("optim/"): v for k, v in tensors.items() if k.startswith("optim/")}
    optim |= {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(meta["optimizer"]).items()}  # betas
    model_sd = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim)
    for key, holder in stateful.items():  # the scheduler with this job's T_max (a run given more steps: `longer`)
        saved = json.loads(meta.get(key, "null")) or {}
        holder.load_state_dict(saved | ({"T_max": holder.T_max} if key == "scheduler" else {}))
    for key, state in states.items():  # a rank the saving job did not have keeps its seeded generator
        if key.startswith(f"rng/{dist.get_rank()}/"):
            torch.set_rng_state(state) if key.endswith("/cpu") else torch.cuda.set_rng_state(state)
    progress = {**START, **json.loads(meta["progress"])}
    where = {k: v for k, v in progress.items() if k != "window"}
    where |= {key: run.config[key] for key in ("world_size", "global_batch")}
    write_record(run, {"kind": "resume", "checkpoint": str(run.resume_from), **where})
    say(run, f"resumed from {run.resume_from} at step {progress['step']}")
    for hook in ON_RESUME if "scheduler" in stateful else ():
        hook(
            run,
            json.loads(meta["scheduler"]),
            optimizer=optimizer,
            scheduler=stateful["scheduler"],
            step=progress["step"],
        )
    return progress | {"window": progress["window"] if run.writer else {}}  # the open log window: rank 0 carries it


READ_CHECKS.append(check_shards)

"""Sharded checkpoints: each rank writes its shard into RUN/ckpt/step-N/ (DCP), then rank 0 the kernel's step-N file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from core.kernel.job import RecipeError, RunFolder
from core.kernel.seams import SEAMS
from core.kernel.store import FORMAT, START, checksum, from_rank0, read_checkpoint, resumed, write_tensors


def flat_state(model, optimizer) -> tuple[dict, dict, dict, dict]:
    """(the model's tensors, the optimizer's (flat names), each storage once for DCP, the optimizer's other values)."""
    model_sd, optim = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    # its tensors, and its other values (lr, betas, ...: JSON in the step-N file)
    optim, other = ({k: v for k, v in optim.items() if torch.is_tensor(v) is kind} for kind in (True, False))
    tensors = {f"model/{k}": v for k, v in model_sd.items()} | {f"optim/{k}": v for k, v in optim.items()}
    local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in tensors.items()}  # a DTensor: this rank's
    # the first name at each place bytes are (a set: one look-up each): safetensors refuses shared memory, a tied
    # weight goes once
    first = set({((t.data_ptr(), t.shape) if t.numel() else k): k for k, t in reversed(local.items())}.values())
    return model_sd, optim, {k: v for k, v in tensors.items() if k in first}, other


def save_sharded(run: RunFolder, *, model, optimizer, scheduler, progress: dict, keep: int) -> Path:
    """RUN/ckpt/step-N/ (every rank its shard), then step-N.safetensors; all but the newest `keep` go. A collective."""
    path = run.path / "ckpt" / f"step-{progress['step']:06d}.safetensors"
    if run.writer:  # the same step saved again (resumed from before it), or saves cut short: their folders go
        path.unlink(missing_ok=True)
        for old in (p for p in path.parent.glob("step-*") if not p.with_suffix(".safetensors").exists()):
            shutil.rmtree(old, ignore_errors=True)
        path.with_suffix("").mkdir(parents=True)
    dist.barrier()
    _, _, once, optim = flat_state(model, optimizer)
    try:
        dcp.save(once, storage_writer=dcp.HuggingFaceStorageWriter(str(path.with_suffix("")), save_distributed=True))
    except dcp.api.CheckpointException as err:  # every rank's errors: a full disk's OSError makes the error line
        raise next((e for e, _ in err.failures.values() if isinstance(e, OSError)), RuntimeError(str(err))) from None
    files = sorted(path.with_suffix("").glob(f"shard-{dist.get_rank() + 1:05d}-*.safetensors"))  # read back, closed
    mine = {file.name: {key: checksum(t) for key, t in safetensors.torch.load_file(file).items()} for file in files}
    rng = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    dist.all_gather_object(everyone := [None] * dist.get_world_size(), (mine, optim, rng))  # each rank its own rng
    if run.writer:
        states = {f"rng/{rank}/{kind}": s for rank, (_, _, own) in enumerate(everyone) for kind, s in own.items()}
        meta = {"format": FORMAT, "recipe": run.recipe, "torch": torch.__version__, "config": run.config}
        meta |= {"global_batch": run.config["global_batch"], "world_size": len(everyone), "progress": progress}
        meta["shards"] = {name: sums for files, _, _ in everyone for name, sums in files.items()}
        meta["optimizer"] = {k: v for _, values, _ in everyone for k, v in values.items()}  # a pipeline's stages differ
        write_tensors(path, states, meta | {"scheduler": scheduler.state_dict()})
        for old in sorted(path.parent.glob("step-*.safetensors"), key=lambda p: (len(p.name), p.name))[:-keep]:
            old.unlink(missing_ok=True)  # only once the new one is in place
            shutil.rmtree(old.with_suffix(""), ignore_errors=True)
    dist.barrier()
    return path


def check_shards(path: Path, tensors: dict, model) -> None:
    """SEAMS["read_checks"]: the shard files beside a sharded checkpoint, all there and matching their checksums."""
    shards, folder = json.loads(read_checkpoint(path, tensors=False)[1].get("shards", "null")), path.with_suffix("")
    fix = f"resume from an older checkpoint in {path.parent} (--resume auto skips damaged ones)"
    for extra in (p.name for p in folder.glob("*.safetensors") if shards is not None and p.name not in shards):
        raise RecipeError(f"{path}: {extra} is not one of its files; {fix}")
    for name, sums in (shards or {}).items():
        try:  # checks the header and that no byte is missing
            found = safetensors.torch.load_file(folder / name)
        except Exception as err:  # noqa: BLE001 - missing, truncated or unreadable
            why = "missing" if isinstance(err, FileNotFoundError) else "unreadable"
            raise RecipeError(f"{path}: shard file {name} is {why}; {fix}") from None
        if wrong := [k for k, want in sums.items() if k not in found or checksum(found[k]) != want]:
            raise RecipeError(f"{path}: tensor {wrong[0]} in {name} does not match its checksum; {fix}")
        for check in [c for c in SEAMS["read_checks"] if c is not check_shards]:  # the checks plug-in's, on every file
            check(folder / name, found, None)


def load_sharded(run: RunFolder, *, model, optimizer, scheduler) -> dict:
    """The checkpoint's train state resharded to this mesh; its progress, or START. A collective."""
    if run.resume_from is None:
        return dict(START)
    states, meta = from_rank0(run.writer, lambda: read_checkpoint(run.resume_from))
    model_sd, optim, once, _ = flat_state(model, optimizer)  # this rank's shapes and shards, for DCP to fill
    try:
        dcp.load(once, storage_reader=dcp.HuggingFaceStorageReader(str(run.resume_from.with_suffix(""))))
    except (dcp.api.CheckpointException, RuntimeError, KeyError) as err:  # another model's tensors under one --model
        why = f"its tensors do not fit this model ({str(err).strip().splitlines()[-1][:200]})"
        raise RecipeError(f"{run.resume_from}: {why}; use the model it saved, or a new --out") from None
    optim |= {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(meta["optimizer"]).items()}  # betas
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim)
    return resumed(run, meta, states, optimizer=optimizer, scheduler=scheduler)


SEAMS["read_checks"].append(check_shards)

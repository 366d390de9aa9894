"""Checkpoints and final weights: safetensors files written atomically, every tensor and the header checksummed."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import xxhash
from safetensors import SafetensorError, safe_open
from torch import nn

from core.kernel.log import RunFolder, say, write_record
from core.kernel.options import RecipeError
from core.kernel.seams import CHECKSUMS, ON_RESUME, READ_CHECKS, WRITERS

FORMAT = "torch-dist-recipes/2"  # /2: checksums in every file
START = {"epoch": 0, "samples": 0, "step": 0, "skipped": 0, "window": {}}  # a new run's progress


def checksum(x: torch.Tensor | dict) -> str:
    """XXH3-64 of a tensor's bytes ("xxh3:..."), or CRC32 of a safetensors header but its own checksum ("crc32:...")."""
    if isinstance(x, dict):
        meta = {k: v for k, v in x.get("__metadata__", {}).items() if k != "header_checksum"}
        canonical = json.dumps({**x, "__metadata__": meta}, sort_keys=True, separators=(",", ":"))
        return f"crc32:{zlib.crc32(canonical.encode()):08x}"
    t = x.detach().cpu().contiguous().reshape(-1)
    return "xxh3:" + xxhash.xxh3_64_hexdigest(t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8))


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file with its checksums, written to a temporary file renamed over `path`: never half a file."""
    out = {k: t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True) for k, t in tensors.items()}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # copies: tied weights apart (safetensors refuses them)
    with open(tmp, "wb") as f:  # a write killed midway leaves only this hidden file, which no listing takes
        if WRITERS:  # the fast_writer plug-in: straight from the tensors' memory
            WRITERS[-1](f, out, metadata)
        else:
            meta = {**metadata, "checksums": json.dumps({key: checksum(t) for key, t in out.items()})}
            data = safetensors.torch.save(out, meta)  # its layout sets the offsets the header checksum covers
            meta["header_checksum"] = checksum(json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")]))
            f.write(safetensors.torch.save(out, meta))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    os.fsync(folder)  # the rename itself survives a power cut
    os.close(folder)


def save_checkpoint(run: RunFolder, *, model: nn.Module, optimizer, scheduler, progress: dict, keep: int) -> Path:
    """RUN/ckpt/step-N.safetensors: the train state, every rank's generators too (a collective); `keep` newest stay."""
    mine = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    rng, optim = [None] * dist.get_world_size(), optimizer.state_dict()
    dist.all_gather_object(rng, mine)  # each rank's own generators: bitwise resume
    flat = {f"{index}/{name}": value for index, state in optim["state"].items() for name, value in state.items()}
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    tensors |= {f"optim/{k}": v for k, v in flat.items() if torch.is_tensor(v)}  # other values go to JSON
    tensors |= {f"rng/{rank}/{kind}": state for rank, states in enumerate(rng) for kind, state in states.items()}
    rest = {"param_groups": optim["param_groups"], "scalars": {k: v for k, v in flat.items() if not torch.is_tensor(v)}}
    meta = {"format": FORMAT, "recipe": run.recipe, "torch": torch.__version__, "config": run.config}
    meta |= {"global_batch": run.config["global_batch"], "world_size": len(rng), "optimizer": rest}
    meta |= {"progress": progress, "scheduler": scheduler.state_dict()}
    path = run.path / "ckpt" / f"step-{progress['step']:06d}.safetensors"
    if run.writer:  # a full disk raises OSError here, and the checkpoints before stay whole
        path.parent.mkdir(exist_ok=True)
        write_tensors(path, tensors, {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()})
        for old in sorted(path.parent.glob("step-*.safetensors"), key=lambda p: (len(p.name), p.name))[:-keep]:
            old.unlink()  # only once the new one is in place
    dist.barrier()  # the others wait for it: a kill after this finds the checkpoint
    return path


def read_checkpoint(path: Path, model: nn.Module | None = None, *, tensors: bool = True) -> tuple[dict, dict]:
    """A checkpoint's tensors (or none) and metadata, the header and each tensor checked against its checksum."""
    fix = f"resume from an older checkpoint in {path.parent} (--resume auto skips damaged ones)"
    if not path.is_file():  # a run folder, or its ckpt folder (which step?), or nothing
        raise RecipeError(f"--resume {path}: no such checkpoint file; pass a ckpt/step-N.safetensors, or auto")
    try:
        with safe_open(str(path), framework="pt") as f:  # checks the header and that no byte is missing
            if (meta := f.metadata() or {}).get("format") != FORMAT:
                raise RecipeError(f"{path}: not a checkpoint of this project (format {meta.get('format')!r}); {fix}")
            found = {key: f.get_tensor(key) for key in f.keys()} if tensors else {}  # noqa: SIM118
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (SafetensorError, OSError) as err:
        raise RecipeError(f"{path}: truncated or corrupted ({err}); {fix}") from None
    if meta.get("header_checksum") != checksum(header):
        raise RecipeError(f"{path}: the header does not match its checksum (edited or damaged); {fix}")
    sums = json.loads(meta["checksums"])
    for key, tensor in found.items():  # an older format's checksum: its plug-in's (old_checksums)
        if CHECKSUMS.get(sums.get(key, "").partition(":")[0] + ":", checksum)(tensor) != sums.get(key):
            raise RecipeError(f"{path}: tensor {key} does not match its checksum (the file is damaged); {fix}")
    for check in READ_CHECKS if tensors else ():
        check(path, found, model)
    return found, meta


def newest_good(run_dir: Path) -> Path | None:
    """The newest checkpoint of RUN/ckpt that reads back whole; a damaged newer one is skipped in a warning."""
    for path in sorted((run_dir / "ckpt").glob("step-*.safetensors"), key=lambda p: (len(p.name), p.name))[::-1]:
        try:
            return read_checkpoint(path) and path
        except RecipeError as err:
            why = str(err).removeprefix(f"{path}: ").split("; ")[0]
            say(None, f"warning: --resume auto: skipping {path}, damaged ({why}); trying the one before", "WARNING")
    return None


def load_checkpoint(run: RunFolder, *, model: nn.Module, optimizer, scheduler) -> dict:
    """The checkpoint's train state on every rank (rank 0 reads and sends it); its progress, or START for a new run."""
    if run.resume_from is None:
        return dict(START)
    try:
        payload = read_checkpoint(run.resume_from, model) if run.writer else None
    except RecipeError as err:
        payload = str(err)  # every rank raises it
    dist.broadcast_object_list(box := [payload], src=0)  # our own tensors between our processes, not the file
    if isinstance(payload := box[0], str):
        raise RecipeError(payload)
    tensors, meta = payload
    model.load_state_dict({k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")})
    rest, state = json.loads(meta["optimizer"]), {}
    for key, value in ({k[6:]: v for k, v in tensors.items() if k.startswith("optim/")} | rest["scalars"]).items():
        state.setdefault(int(key.split("/")[0]), {})[key.split("/", 1)[1]] = value
    groups = [{k: tuple(v) if k == "betas" else v for k, v in group.items()} for group in rest["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})  # JSON made AdamW's betas a list
    saved = json.loads(meta["scheduler"])  # with this job's T_max: a run given more steps (--with longer) trains on
    scheduler.load_state_dict(saved | {"T_max": scheduler.T_max})
    for key in (k for k in tensors if k.startswith(f"rng/{dist.get_rank()}/")):  # a new rank keeps its seeded ones
        torch.set_rng_state(tensors[key]) if key.endswith("/cpu") else torch.cuda.set_rng_state(tensors[key])
    progress = {**START, **json.loads(meta["progress"])}
    where = {k: v for k, v in progress.items() if k != "window"} | {
        k: run.config[k] for k in ("world_size", "global_batch")
    }
    write_record(run, {"kind": "resume", "checkpoint": str(run.resume_from), **where})
    say(run, f"resumed from {run.resume_from} at step {progress['step']}")
    for hook in ON_RESUME:
        hook(run, saved, optimizer=optimizer, scheduler=scheduler, step=progress["step"])
    return progress | {"window": progress["window"] if run.writer else {}}  # the open log window: rank 0 carries it


def write_weights(run: RunFolder, state: dict[str, torch.Tensor]) -> Path:
    """Rank 0 writes the final weights as RUN/model.safetensors."""
    path = run.path / "model.safetensors"
    if run.writer:
        write_tensors(path, state, {"recipe": run.recipe} | {k: v for k, v in run.config.items() if k == "model"})
    return path

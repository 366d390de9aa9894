"""Checkpoints and the final weights: safetensors files rank 0 writes atomically, every tensor and the header
checksummed and verified on load, nothing unpickled (docs/checkpoints.md has the layout)."""

from __future__ import annotations

import json
import os
import re
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
from core.kernel.pg import all_gather_object, broadcast_object
from core.kernel.seams import CHECKSUMS, ON_RESUME, READ_CHECKS, WRITERS

FORMAT = "torch-dist-recipes/2"  # /2: checksums in every file
START = {"epoch": 0, "samples": 0, "step": 0, "skipped": 0, "window": {}}  # a new run's progress


def checksum(t: torch.Tensor) -> str:
    """XXH3-64 of the tensor's bytes, "xxh3:16 hex digits"; dtype and shape are the header's."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return "xxh3:" + xxhash.xxh3_64_hexdigest(t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8))


def header_checksum(header: dict) -> str:
    """CRC32 of the header in a canonical form, without its own `header_checksum` field."""
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if k != "header_checksum"}
    canonical = json.dumps({**header, "__metadata__": meta}, sort_keys=True, separators=(",", ":"))
    return f"crc32:{zlib.crc32(canonical.encode()):08x}"


def write_plain(f, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file with the checksums in its header, through safetensors' own writer."""
    meta = {**metadata, "checksums": json.dumps({key: checksum(t) for key, t in tensors.items()})}
    data = safetensors.torch.save(tensors, meta)  # its layout sets the offsets the header checksum covers
    meta["header_checksum"] = header_checksum(json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")]))
    f.write(safetensors.torch.save(tensors, meta))


def atomic_write(path: Path, write) -> None:
    """Call `write(file)` on a temporary file, fsync, rename it over `path`: readers see the old file or the new one,
    never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # a write to an open file names none: the disk-full line names this one's folder
        raise err if err.filename else OSError(err.errno, err.strerror, str(tmp)) from None
    finally:
        tmp.unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    os.fsync(folder)  # the rename itself survives a power cut
    os.close(folder)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file with its checksums, written atomically."""
    atomic_write(path, lambda f: (WRITERS or [write_plain])[-1](f, savable(tensors), metadata))


def savable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing storage (safetensors refuses tied weights)."""
    out, seen = {}, set()
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        out[key] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The checkpoints of a folder, oldest first (the temporary files of an interrupted write are not)."""
    found = {
        int(m[1]): p
        for p in ckpt_dir.glob("step-*.safetensors")
        if (m := re.fullmatch(r"step-(\d+)\.safetensors", p.name))
    }
    return [found[step] for step in sorted(found)]


def save_checkpoint(run: RunFolder, *, model: nn.Module, optimizer, scheduler, progress: dict, keep: int) -> Path:
    """RUN/ckpt/step-N.safetensors with the whole train state, every rank's generators too (a collective); then all
    but the newest `keep` go."""
    mine = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    rng = all_gather_object(mine)  # each rank its own generators: bitwise resume
    optim = optimizer.state_dict()  # its state by parameter index: tensors to the file, other values to JSON
    flat = {f"{index}/{name}": value for index, state in optim["state"].items() for name, value in state.items()}
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    tensors |= {f"optim/{key}": value for key, value in flat.items() if torch.is_tensor(value)}
    tensors |= {f"rng/{rank}/{kind}": state for rank, states in enumerate(rng) for kind, state in states.items()}
    scalars = {key: value for key, value in flat.items() if not torch.is_tensor(value)}
    metadata = {"format": FORMAT, "recipe": run.recipe, "torch": torch.__version__}
    rest = {"config": run.config, "global_batch": run.config["global_batch"], "world_size": len(rng)}
    rest |= {"optimizer": {"param_groups": optim["param_groups"], "scalars": scalars}, "progress": progress}
    rest["scheduler"] = scheduler.state_dict()
    path = run.path / "ckpt" / f"step-{progress['step']:06d}.safetensors"
    if run.writer:  # a full disk raises OSError here, and the checkpoints before stay whole
        path.parent.mkdir(exist_ok=True)
        write_tensors(path, tensors, metadata | {key: json.dumps(value) for key, value in rest.items()})
        for old in list_checkpoints(path.parent)[:-keep]:  # only once the new one is in place
            old.unlink(missing_ok=True)
    dist.barrier()  # the others wait for it: a kill after this finds the checkpoint
    return path


def read_metadata(path: Path) -> dict[str, str]:
    """A checkpoint's metadata, no tensor read (one RecipeError line when the file is not a checkpoint)."""
    return _open(path, lambda f: None)[1]


def read_checkpoint(path: Path, model: nn.Module | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A checkpoint's tensors and metadata, the header and every tensor checked against its checksum."""
    tensors, meta = _open(path, lambda f: {key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    fix = f"resume from an older checkpoint in {path.parent} (--resume auto skips damaged ones)"
    verify(path, tensors, meta, fix=fix)
    for check in READ_CHECKS:
        check(path, tensors, model)
    return tensors, meta


def verify(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str], *, fix: str) -> None:
    """One RecipeError line naming the header or the tensor that does not match its checksum."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    if meta.get("header_checksum") != header_checksum(header):
        raise RecipeError(f"{path}: the header does not match its checksum (edited or damaged); {fix}")
    sums = json.loads(meta["checksums"])
    for key, tensor in tensors.items():
        recorded = sums.get(key, "")
        sum_of = next((fn for prefix, fn in CHECKSUMS.items() if recorded.startswith(prefix)), checksum)
        if sum_of(tensor) != recorded:
            raise RecipeError(f"{path}: tensor {key} does not match its checksum (the file is damaged); {fix}")


def _open(path: Path, read):
    if not path.is_file():  # a run folder, or its ckpt folder (which step?), or nothing
        folder = "a folder, not a checkpoint file; pass one of its files, or --resume auto"
        raise RecipeError(f"--resume {path}: {folder if path.is_dir() else 'no such checkpoint file'}")
    try:
        with safe_open(str(path), framework="pt") as f:  # checks the header and that no byte is missing
            metadata = f.metadata() or {}
            if metadata.get("format") == FORMAT:
                return read(f), metadata
    except (SafetensorError, OSError) as err:
        raise RecipeError(f"{path}: truncated or corrupted ({err}); resume from an older checkpoint") from None
    found = metadata.get("format")
    raise RecipeError(f"{path}: not a checkpoint of this project (format {found!r}); resume from a ckpt/step-N file")


def newest_good(run_dir: Path) -> Path | None:
    """The newest checkpoint of RUN/ckpt that reads back whole and undamaged; a newer one is passed over in a line."""
    checkpoints = list_checkpoints(run_dir / "ckpt")
    for path in reversed(checkpoints):
        try:
            read_checkpoint(path)
            return path
        except RecipeError as err:
            why = str(err).removeprefix(f"{path}: ").split("; resume from")[0]
            then = "taking the one before" if path != checkpoints[0] else "it is the oldest"
            say(None, f"warning: --resume auto: skipping {path}, damaged ({why}); {then}", level="WARNING")
    return None


def load_checkpoint(run: RunFolder, *, model: nn.Module, optimizer, scheduler) -> dict:
    """The train state of the checkpoint the run continues from, into every rank; returns its progress (START for a
    new run). Rank 0 reads and verifies the file and sends it (other nodes need not see it)."""
    if run.resume_from is None:
        return dict(START)
    payload = None
    if run.writer:
        try:
            payload = read_checkpoint(run.resume_from, model)
        except RecipeError as err:
            payload = str(err)  # every rank raises it
    payload = broadcast_object(payload)  # our own tensors between our own processes, not the file
    if isinstance(payload, str):
        raise RecipeError(payload)
    tensors, meta = payload
    model.load_state_dict({k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")})
    rest, state = json.loads(meta["optimizer"]), {}
    flat = {key.removeprefix("optim/"): value for key, value in tensors.items() if key.startswith("optim/")}
    for key, value in (flat | rest["scalars"]).items():
        index, name = key.split("/", 1)
        state.setdefault(int(index), {})[name] = value
    groups = [{k: tuple(v) if k == "betas" else v for k, v in group.items()} for group in rest["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})  # JSON made AdamW's betas a list
    saved = json.loads(meta["scheduler"])  # with this job's T_max: a run given more steps (--with longer) trains on
    scheduler.load_state_dict(saved | {"T_max": scheduler.T_max})
    mine = f"rng/{dist.get_rank()}/"  # a rank the saving job did not have keeps its seeded generator
    for key in (k for k in tensors if k.startswith(mine)):  # cuda's: set when CUDA is first used (none on a CPU)
        torch.set_rng_state(tensors[key]) if key.endswith("/cpu") else torch.cuda.set_rng_state(tensors[key])
    progress = {**START, **json.loads(meta["progress"])}
    where = {k: v for k, v in progress.items() if k != "window"}
    where |= {key: run.config[key] for key in ("world_size", "global_batch")}
    write_record(run, {"kind": "resume", "checkpoint": str(run.resume_from), **where})
    say(run, f"resumed from {run.resume_from} at step {progress['step']}")
    for hook in ON_RESUME:
        hook(run, saved, optimizer=optimizer, scheduler=scheduler, step=progress["step"])
    return progress | {"window": progress["window"] if run.writer else {}}  # the open log window: rank 0 carries it


def write_weights(run: RunFolder, state: dict[str, torch.Tensor]) -> Path:
    """Rank 0 writes the final weights as RUN/model.safetensors."""
    path = run.path / "model.safetensors"
    if run.writer:
        named = {"model": run.config["model"]} if "model" in run.config else {}  # the --model it was trained as
        write_tensors(path, state, {"recipe": run.recipe, **named})
    return path

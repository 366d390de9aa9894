"""Checkpoints: one safetensors file, written by rank 0, atomically, holding the whole train state.

    RUN/ckpt/step-000120.safetensors
      tensors   model/<key>, optim/<param index>/<name>, rng/<rank>/cpu, rng/<rank>/cuda
      metadata  format, recipe, config, world_size, global_batch, torch, checksums, header_checksum,
                and JSON for the rest: optimizer param groups, LR scheduler, GradScaler,
                progress (epoch, samples of the epoch's global order consumed, step, skipped)

A kill at any moment leaves the last good checkpoint whole (core.ckpt_io.atomic_write). Every tensor and the
header carry a checksum, verified on load with the values themselves; `--resume auto` passes over a damaged
file to the one before. Nothing is unpickled. Progress is counted in samples of the global order, so a
checkpoint resumes at another world size when the global batch is the same.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn

from core.ckpt_io import atomic_write, list_checkpoints, read_header, savable, verify
from core.dist import all_gather_object, broadcast_object
from core.kernel.job import RecipeError, say
from core.kernel.store import FORMAT
from core.plugins.fast_writer import write_fast
from core.records import RunFolder, write_record
from core.weights import check_model_matches, model_part

# The progress of a run that starts afresh; `window`: the open log window's sums (core.meter.open_window).
START = {"epoch": 0, "samples": 0, "step": 0, "skipped": 0, "window": {}}


def snapshot(run: RunFolder, *, model: nn.Module, optimizer, progress: dict, **stateful):
    """(tensors, metadata) of the whole train state: every rank's generators are gathered (a collective).

    `stateful`: the scheduler (and the scaler): anything with state_dict(), kept as JSON under its keyword."""
    mine = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    rng = all_gather_object(mine)  # each rank its own generators: bitwise resume
    optim = optimizer.state_dict()  # its state by parameter index: tensors to the file, other values to JSON
    flat = {f"{index}/{name}": value for index, state in optim["state"].items() for name, value in state.items()}
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    tensors |= {f"optim/{key}": value for key, value in flat.items() if torch.is_tensor(value)}
    tensors |= {f"rng/{rank}/{kind}": state for rank, states in enumerate(rng) for kind, state in states.items()}
    scalars = {key: value for key, value in flat.items() if not torch.is_tensor(value)}
    # who wrote it and the job's shape (what a resume checks), then the train state that is not tensors, as JSON
    metadata = {"format": FORMAT, "recipe": run.recipe, "torch": torch.__version__}
    rest = {"config": run.config, "global_batch": run.config["global_batch"], "world_size": len(rng)}
    rest |= {"optimizer": {"param_groups": optim["param_groups"], "scalars": scalars}, "progress": progress}
    rest |= {key: holder.state_dict() or None for key, holder in stateful.items()}  # a disabled GradScaler's: null
    rest["trackers"] = {k: v for sink in run.sinks for k, v in sink.state().items()}  # W&B's run id
    return tensors, metadata | {key: json.dumps(value) for key, value in rest.items()}


def write_checkpoint(path: Path, tensors: dict, metadata: dict, *, keep: int) -> None:
    """Rank 0: write the file atomically, then drop all but the newest `keep` (only once the new one is in place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: write_fast(f, tensors, metadata))
    for old in list_checkpoints(path.parent)[:-keep]:
        old.unlink(missing_ok=True)


def save_checkpoint(run: RunFolder, *, model: nn.Module, optimizer, progress: dict, keep: int, **state) -> Path:
    """Every --ckpt-every steps: RUN/ckpt/step-N.safetensors with the whole train state (a collective).

    Rank 0 writes, the others wait for it, so a kill after this finds the checkpoint. `state`: snapshot's `stateful`."""
    tensors, metadata = snapshot(run, model=model, optimizer=optimizer, progress=progress, **state)
    path = run.path / "ckpt" / f"step-{progress['step']:06d}.safetensors"
    if run.writer:  # a full disk raises OSError here, and the checkpoints before stay whole
        write_checkpoint(path, savable(tensors), metadata, keep=keep)
    if dist.is_initialized():
        dist.barrier()
    return path


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a checkpoint, every checksum and value verified (one RecipeError line)."""
    tensors, metadata = _open(path, lambda f: {key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    verify(Path(path), read_header(path), tensors)
    return tensors, metadata


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """A checkpoint's metadata, no tensor read (one RecipeError line when the file is not a checkpoint)."""
    return _open(path, lambda f: None)[1]


def _open(path: str | os.PathLike, read):
    path = Path(path)
    if not path.is_file():  # a run folder, or its ckpt folder (which step?), or nothing
        folder = "a folder, not a checkpoint file; pass one of its files, or --resume auto"
        raise RecipeError(f"--resume {path}: {folder if path.is_dir() else 'no such checkpoint file'}")
    try:
        with safe_open(str(path), framework="pt") as f:  # checks the header and that no byte is missing
            metadata = f.metadata() or {}
            if metadata.get("format") == FORMAT:
                return read(f), metadata
    except (SafetensorError, OSError) as err:
        refuse_pickle(path)
        raise RecipeError(f"{path}: truncated or corrupted ({err}); resume from an older checkpoint") from None
    found = metadata.get("format")
    raise RecipeError(f"{path}: not a checkpoint of this project (format {found!r}); resume from a ckpt/step-N file")


def refuse_pickle(path: Path) -> None:
    """A torch.save (pickle) file given as a checkpoint: one line that says so (it is never unpickled)."""
    with open(path, "rb") as f:
        pickled = f.read(2) in (b"PK", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # torch.save, pickle
    if pickled:
        raise RecipeError(
            f"{path}: a pickle (torch.save) file, not a safetensors checkpoint; it is never unpickled "
            f"here: resume from a ckpt/step-N.safetensors file"
        ) from None


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


def load_checkpoint(run: RunFolder, *, model: nn.Module, optimizer, **stateful) -> dict:
    """The train state of the checkpoint the run continues from, into every rank; returns the progress.

    START for a new run; `stateful` as snapshot takes it. A collective: rank 0 reads and verifies the file and sends
    it (other nodes need not see it)."""
    if run.resume_from is None:
        return dict(START)
    payload = None
    if run.writer:
        try:
            payload = read_checkpoint(run.resume_from)
            check_shapes(run.resume_from, payload[0], model)
        except RecipeError as err:
            payload = str(err)  # every rank raises it
    payload = broadcast_object(payload)  # our own tensors between our own processes, not the file
    if isinstance(payload, str):
        raise RecipeError(payload)
    tensors, meta = payload
    model.load_state_dict(model_part(tensors))
    optimizer.load_state_dict(_optimizer_state(tensors, json.loads(meta["optimizer"])))
    total = getattr(stateful.get("scheduler"), "T_max", None)  # this job's schedule length, before the checkpoint's
    for key, holder in stateful.items():  # a checkpoint without one (null: a disabled GradScaler) leaves it as it is
        holder.load_state_dict(json.loads(meta.get(key, "null")) or {})
    mine = f"rng/{dist.get_rank() if dist.is_initialized() else 0}/"  # a rank the saving job lacked keeps its own
    for key in (k for k in tensors if k.startswith(mine)):  # cuda's: set when CUDA is first used (none on a CPU)
        torch.set_rng_state(tensors[key]) if key.endswith("/cpu") else torch.cuda.set_rng_state(tensors[key])
    progress = {**START, **json.loads(meta["progress"])}
    shape = {"world_size": run.config["world_size"], "global_batch": run.config["global_batch"]}
    where = {k: v for k, v in progress.items() if k != "window"}  # the window's sums are the meter's, not a record's
    write_record(run, {"kind": "resume", "checkpoint": str(run.resume_from), **where, **shape})
    say(run, f"resumed from {run.resume_from} at step {progress['step']}")
    if total is not None and stateful["scheduler"].T_max != total:  # a finished run given more steps trains longer
        train_longer(run, stateful["scheduler"], total)
    return progress


def train_longer(run: RunFolder, scheduler, total: int) -> None:
    """A finished run trains on to `total` steps: the cosine recomputed over the new total, as a function of the step
    (torchtitan's way). The saved state alone would climb back along the old cosine, and a new T_max alone would
    scale the last rate, 0: each group's rate is set once from the closed form, then the scheduler steps as usual
    (core.kernel.store.load_checkpoint does the same)."""
    old, scheduler.T_max = scheduler.T_max, total
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler._get_closed_form_lr()):
        group["lr"] = lr
    write_record(run, {"kind": "extend", "step": scheduler.last_epoch, "old_total": old, "new_total": total})


def _optimizer_state(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict] = {}
    flat = {key.removeprefix("optim/"): value for key, value in tensors.items() if key.startswith("optim/")}
    for key, value in (flat | rest["scalars"]).items():
        index, name = key.split("/", 1)
        state.setdefault(int(index), {})[name] = value
    groups = [{k: tuple(v) if k == "betas" else v for k, v in group.items()} for group in rest["param_groups"]]
    return {"state": state, "param_groups": groups}  # JSON made tuples (AdamW's betas) into lists


def check_shapes(path: Path, tensors: dict, model: nn.Module) -> None:
    """One RecipeError line naming the keys that differ when the checkpoint holds another model than `model`.

    It names the missing, the unexpected and the misshapen keys."""
    saved = {k: tuple(v.shape) for k, v in model_part(tensors).items()}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    fix = "resume with the --model it was trained with, or start a new run"
    check_model_matches(path, saved, expected, fix=fix)

"""Checkpoints: safetensors files written by rank 0, atomically, holding the whole train state.

    ckpt/step-000120.safetensors
      tensors   model/<key>, optim/<param index>/<name>, rng/<rank>/cpu, rng/<rank>/cuda
      metadata  format, recipe, config, world_size, global_batch, torch, checksums, header_checksum,
                and JSON for the rest: optimizer param groups, LR scheduler, GradScaler,
                progress (epoch, samples of the epoch's global order consumed, step, ...)

Written to a temporary name, fsynced, then renamed: a kill at any moment leaves the last good
checkpoint whole. Every tensor and the header carry a checksum (core.ckpt_io), verified on
load with the values themselves (finite weights and optimizer state): a damaged file is refused,
and `--resume auto` passes over it to the one before. Nothing is unpickled. A CheckpointSaver
with background=True blocks the step only while the state is copied to host memory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn

# Re-exported: the recipes, core.run and tools import these from core.ckpt.
from core.ckpt_checks import check_compatible, check_global_batch, check_model_matches  # noqa: F401
from core.ckpt_io import (  # noqa: F401  # noqa: F401
    FORMAT,
    atomic_write,
    list_checkpoints,
    read_header,
    remove_stale_temporaries,
    tensor_checksum,
    verify,
    write_safetensors,
)
from core.ckpt_save import CheckpointSaver, savable, save_checkpoint, save_weights  # noqa: F401
from core.config import RecipeError
from core.dist import broadcast_object, is_rank0
from core.models import unwrap


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, index, name = key.split("/", 2)
        state.setdefault(int(index), {})[name] = value
    for key, value in rest["scalars"].items():
        index, name = key.split("/", 1)
        state.setdefault(int(index), {})[name] = value
    groups = [
        {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()}
        for group in rest["param_groups"]
    ]  # JSON made tuples (betas) into lists
    return {"state": state, "param_groups": groups}


def _open_checked(path: str | os.PathLike, read):
    """Run read(safe_open handle) on a checkpoint; one RecipeError line when the file isn't a good one."""
    path = Path(path)
    if path.is_dir():  # a run folder, or its ckpt folder: which step?
        raise RecipeError(f"--resume {path}: a folder, not a checkpoint file; pass one of its files, or --resume auto")
    if not path.is_file():
        raise RecipeError(f"--resume {path}: no such checkpoint file")
    try:
        with safe_open(str(path), framework="pt") as f:  # checks the header and that no byte is missing
            metadata = f.metadata() or {}
            if metadata.get("format") == FORMAT:
                return read(f), metadata
    except (SafetensorError, OSError) as err:
        with open(path, "rb") as f:
            head = f.read(2)
        if head == b"PK" or head[:1] == b"\x80":  # torch.save's zip, or a raw pickle
            raise RecipeError(
                f"{path}: a pickle (torch.save) file, not a safetensors checkpoint; it is never "
                f"unpickled here: resume from a ckpt/step-N.safetensors file"
            ) from None
        raise RecipeError(
            f"{path}: not a readable checkpoint ({err}); it is truncated or corrupted: "
            f"resume from an older one in {path.parent}"
        ) from None
    if str(metadata.get("format", "")).startswith("torch-dist-recipes/"):
        raise RecipeError(
            f"{path}: a checkpoint of format {metadata['format']!r}, written before checksums; "
            f"this version reads {FORMAT!r}: start a new run"
        )
    raise RecipeError(
        f"{path}: a safetensors file but not a checkpoint of this project "
        f"(format {metadata.get('format')!r}); resume from a ckpt/step-N.safetensors file"
    )


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """A checkpoint's header (no tensor is read); one RecipeError line when the file is not a checkpoint."""
    return _open_checked(path, lambda f: None)[1]


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and header of a checkpoint, every checksum and value verified (one RecipeError line)."""
    tensors, meta = _open_checked(path, lambda f: {key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    verify(Path(path), read_header(path), tensors)
    return tensors, meta


def check_resume_file(path: str | os.PathLike, model_shapes: dict[str, tuple]) -> dict[str, str]:
    """Before any process group: the file is whole, undamaged and holds this model; returns its header."""
    tensors, meta = read_checkpoint(path)
    check_model_matches(
        Path(path),
        {k.removeprefix("model/"): tuple(v.shape) for k, v in tensors.items() if k.startswith("model/")},
        model_shapes,
    )
    return meta


def newest_good(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint that reads back whole and undamaged; each newer one is passed over with one line."""
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            read_checkpoint(path)
            return path
        except RecipeError as err:
            reason = str(err).removeprefix(f"{path}: ").split("; resume from")[0]
            print(
                f"warning: --resume auto: skipping {path}, damaged ({reason}); taking the one before", file=sys.stderr
            )
    return None


def is_readable(path: Path) -> bool:
    try:
        read_checkpoint(path)
        return True
    except RecipeError:
        return False


def shapes_of(model: nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in unwrap(model).state_dict().items()}


def load_checkpoint(
    path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int, scheduler=None, scaler=None
) -> dict:
    """Restore the whole train state on every rank and return the progress. A collective.

    Rank 0 reads and verifies the file (other nodes need not see it) and broadcasts it, or the
    one-line reason it can't be used, so every rank fails or succeeds together. Any world size
    may load it: the state is whole; rank r takes rank r's saved RNG state where there is one
    and keeps its seeded generator otherwise (`world_size` is this job's, for the caller's records).
    """
    payload = None
    if is_rank0():
        try:
            tensors, meta = read_checkpoint(path)
            check_model_matches(
                path,
                {k.removeprefix("model/"): v.shape for k, v in tensors.items() if k.startswith("model/")},
                shapes_of(model),
            )
            payload = (tensors, meta)
        except RecipeError as err:
            payload = str(err)
    payload = broadcast_object(payload)  # our own tensors between our own processes, not the file
    if isinstance(payload, str):
        raise RecipeError(payload)
    tensors, meta = payload
    rank = dist.get_rank() if dist.is_initialized() else 0
    return restore(tensors, meta, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, rank=rank)


def restore(tensors: dict, meta: dict, *, model: nn.Module, optimizer, scheduler=None, scaler=None, rank: int = 0):
    """Put a checkpoint's state into this process as rank `rank`; returns the progress.
    A rank the saving job did not have keeps its seeded generators (a larger world)."""
    unwrap(model).load_state_dict({k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")})
    optim = {k: v for k, v in tensors.items() if k.startswith("optim/")}
    optimizer.load_state_dict(_unflatten_optimizer(optim, json.loads(meta["optimizer"])))
    if scheduler is not None and json.loads(meta["scheduler"]) is not None:
        scheduler.load_state_dict(json.loads(meta["scheduler"]))
    if scaler is not None and json.loads(meta.get("scaler", "null")) is not None:
        scaler.load_state_dict(json.loads(meta["scaler"]))
    if f"rng/{rank}/cpu" in tensors:
        torch.set_rng_state(tensors[f"rng/{rank}/cpu"])
    if torch.cuda.is_available() and f"rng/{rank}/cuda" in tensors:
        torch.cuda.set_rng_state(tensors[f"rng/{rank}/cuda"])
    return json.loads(meta["progress"])


def sharded(model) -> bool:
    """Pipeline stages (a list), fully_shard or DTensor parameters: checkpoints are written by every rank (DCP).
    fully_shard leaves the root's parameters gathered, as plain tensors, after a forward without backward
    (evaluation): its reshard() method says what they are then."""
    if isinstance(model, list | tuple):
        return True
    plain = unwrap(model)
    return hasattr(plain, "reshard") or any(type(p).__name__ == "DTensor" for p in plain.parameters())


def state_bytes(*holders) -> int:
    """Roughly what a checkpoint of these modules and optimizers takes on disk."""
    states = [h.state_dict() for h in holders]
    tensors = [
        t
        for s in states
        for t in (s.values() if "state" not in s else (v for p in s["state"].values() for v in p.values()))
    ]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def model_state(model) -> dict[str, torch.Tensor]:
    """The plain model's full state dict: gathered from DTensor shards to rank 0 (a collective), or as it is."""
    plain = unwrap(model)
    if sharded(plain):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(plain, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return plain.state_dict()

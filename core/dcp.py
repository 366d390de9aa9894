"""Sharded checkpoints: every rank writes its own shard through torch.distributed.checkpoint (DCP).

    ckpt/step-000120/
      shard-0000R-model-00001-of-00001.safetensors   rank R-1's tensors (DCP's HuggingFaceStorageWriter)
      checkpoint.json                                  everything else, and what makes the folder complete

Tensors (keyed model/<fqn>, optim/<fqn>/<name>, rng/<rank>/<kind>): DTensor shards (fully_shard,
TP, both) and plain tensors (pipeline stages); one held by several ranks is written once.
checkpoint.json: world size, progress, scheduler, scaler, optimizer hyper-parameters, the recipe's
metadata, model shapes, a checksum per tensor of every file and one over itself. Non-tensor values
go there because DCP's safetensors writer would put them as raw bytes before the header.

Atomic: all ranks write into .step-N.tmp/, rank 0 adds checkpoint.json once every rank is done,
then renames the folder to step-N. A kill at any moment leaves the older checkpoints whole, and a
folder without a valid checkpoint.json is never picked. Loading at another world size reshards
(DCP reads each rank's new slices from the saved chunks). All ranks must see the same folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from core.ckpt import check_model_matches
from core.ckpt_io import tensor_checksum
from core.config import RecipeError
from core.dcp_meta import (  # noqa: F401  (re-exported: the checks live there)
    DONE,
    FORMAT,
    STEP_DIR,
    check_sharded,
    digest,
    latest_sharded,
    list_sharded,
    read_info,
    refuse_mismatch,
)
from core.dist import barrier


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if _world() == 1:
        return [obj]
    out = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _root(model: nn.Module | list[nn.Module]) -> nn.Module:
    """One module for several pipeline stages of a rank, their blocks under their own names."""
    if isinstance(model, nn.Module):
        return model
    root, blocks = nn.Module(), nn.Module()
    for stage in model:
        for name, block in stage.blocks.named_children():
            blocks.add_module(name, block)
    root.add_module("blocks", blocks)
    return root


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """The model's global shapes (DTensor.shape is the whole tensor's), merged over ranks: a collective."""
    mine = {k.removeprefix("model/"): list(v.shape) for k, v in tensors.items() if k.startswith("model/")}
    return {k: v for shapes in _gather(mine) for k, v in shapes.items()}


def _train_tensors(model, optimizer) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Flat tensors for DCP, the optimizer's param groups and its non-tensor per-parameter state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # here: only sharded recipes load DCP

    model_sd, optim_sd = get_state_dict(_root(model), optimizer)
    tensors = {f"model/{k}": v for k, v in model_sd.items()}
    scalars = {}
    for fqn, state in optim_sd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{fqn}/{name}"] = value
            else:
                scalars[f"{fqn}/{name}"] = value
    return tensors, optim_sd["param_groups"], scalars


def _rng_tensors(rank: int) -> dict[str, torch.Tensor]:
    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    return {f"rng/{rank}/{kind}": state for kind, state in ({"cpu": torch.get_rng_state()} | cuda).items()}


def _file_checksums(folder: Path) -> dict[str, dict[str, str]]:
    """{file: {key: checksum}} of this rank's own safetensors file(s) in `folder`, read back from disk."""
    name = re.compile(rf"shard-{_rank() + 1:05d}-model-\d+-of-\d+\.safetensors")
    out = {}
    for path in sorted(p for p in folder.iterdir() if name.fullmatch(p.name)):
        with safe_open(str(path), framework="pt") as f:
            out[path.name] = {key: tensor_checksum(f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118
    return out


def _write_json(path: Path, info: dict) -> None:
    with open(path, "w") as f:
        json.dump({**info, "self_checksum": digest(info)}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power cut
    finally:
        os.close(fd)


def save_sharded(
    ckpt_dir: str | os.PathLike,
    *,
    model: nn.Module | list[nn.Module],
    optimizer: torch.optim.Optimizer,
    progress: dict,
    scheduler=None,
    scaler=None,
    keep: int = 2,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write ckpt_dir/step-N/ (N = progress["step"]), every rank its own shard; keep the newest `keep`.

    A collective. `model`: the (sharded) model, or a list of this rank's pipeline stages."""
    import torch.distributed.checkpoint as dcp  # here: only sharded recipes load DCP

    ckpt_dir = Path(ckpt_dir)
    final, tmp = ckpt_dir / f"step-{progress['step']:06d}", ckpt_dir / f".step-{progress['step']:06d}.tmp"
    if _rank() == 0:
        for stale in ckpt_dir.glob(".step-*.tmp"):  # left by a killed save: saves never overlap
            shutil.rmtree(stale)
        tmp.mkdir(parents=True)
    barrier()
    tensors, groups, scalars = _train_tensors(model, optimizer)
    tensors |= _rng_tensors(_rank())
    dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp), save_distributed=True))
    everyone, shapes = _gather((_file_checksums(tmp), scalars)), _shapes(tensors)  # every rank's file is closed
    if _rank() == 0:
        info = {
            "format": FORMAT,
            "world_size": _world(),
            "torch": torch.__version__,
            "progress": progress,
            "metadata": dict(metadata or {}),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
            "optim_scalars": {k: v for _, s in everyone for k, v in s.items()},
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "checksums": {name: sums for files, _ in everyone for name, sums in files.items()},
            "shapes": shapes,
        }
        _write_json(tmp / DONE, info)
        aside = ckpt_dir / f".step-{progress['step']:06d}.old.tmp"
        if final.exists():  # the same step saved again (a run resumed from before it): swap it out first
            os.replace(final, aside)
        os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        shutil.rmtree(aside, ignore_errors=True)
        for old in list_sharded(ckpt_dir)[:-keep] if keep > 0 else []:  # only once the new one is in place
            shutil.rmtree(old)
    barrier()
    return final


def _verify_files(path: Path, info: dict) -> None:
    """Every rank checks a share of the files (checksums, finite values); all ranks fail together."""
    names = sorted(info["checksums"])
    extra = sorted({p.name for p in path.glob("*.safetensors")} - set(names))  # DCP's reader would read them too
    problems = [f"{name} is not one of its files" for name in extra[:1] if _rank() == 0]
    for name in names[_rank() :: _world()]:
        try:
            with safe_open(str(path / name), framework="pt") as f:
                for key, want in info["checksums"][name].items():
                    t = f.get_tensor(key)
                    if tensor_checksum(t) != want:
                        problems.append(f"tensor {key} in {name} does not match its checksum")
                    elif t.is_floating_point() and not torch.isfinite(t).all():
                        problems.append(f"tensor {key} in {name} holds NaN or inf")
        except Exception as err:  # noqa: BLE001 a missing, truncated or unreadable file
            problems.append(f"{name} is unreadable ({type(err).__name__}: {err})")
    problems = sorted(p for mine in _gather(problems) for p in mine)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RecipeError(
            f"{path}: {problems[0]}{more}; the checkpoint is damaged: resume from an older "
            f"step-N folder in {path.parent}"
        )


def _optimizer_state(path: Path, tensors: dict, groups: list[dict], info: dict) -> dict:
    """The optimizer state dict for set_state_dict: loaded tensors, saved scalars and hyper-parameters
    over this rank's own param groups (their "params" differ between pipeline stages)."""
    if len(groups) != len(info["param_groups"]):
        raise RecipeError(
            f"{path}: the optimizer had {len(info['param_groups'])} param groups, this one has "
            f"{len(groups)}; resume with the optimizer setup it was saved with"
        )
    state: dict[str, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            fqn, name = key.removeprefix("optim/").rsplit("/", 1)
            state.setdefault(fqn, {})[name] = value
    for key, value in info["optim_scalars"].items():
        fqn, name = key.rsplit("/", 1)
        if fqn in state:
            state[fqn][name] = value
    groups = [
        {**mine, **{k: tuple(v) if isinstance(v, list) else v for k, v in was.items()}}
        for mine, was in zip(groups, info["param_groups"])
    ]  # JSON made tuples (betas) lists
    return {"state": state, "param_groups": groups}


def load_sharded(
    path: str | os.PathLike,
    *,
    model: nn.Module | list[nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    scaler=None,
) -> dict:
    """Restore the train state saved by save_sharded on every rank, resharding where the world size
    changed (DTensor models), and return the progress dict. A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict  # here: only sharded recipes load DCP

    path = Path(path)
    info = read_info(path)
    tensors, groups, _ = _train_tensors(model, optimizer)
    check_model_matches(path, info["shapes"], _shapes(tensors))  # the stages of all ranks make the model
    _verify_files(path, info)
    saved = {key for sums in info["checksums"].values() for key in sums}
    rng = {k: v for k, v in _rng_tensors(_rank()).items() if k in saved}  # none for a rank the saving job lacked
    optim_sd = _optimizer_state(path, tensors, groups, info)  # refuses before the read; DCP fills the tensors
    dcp.load(tensors | rng, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
    model_sd = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    set_state_dict(_root(model), optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if scheduler is not None and info["scheduler"] is not None:
        scheduler.load_state_dict(info["scheduler"])
    if scaler is not None and info["scaler"] is not None:
        scaler.load_state_dict(info["scaler"])
    for key, value in rng.items():
        torch.set_rng_state(value) if key.endswith("/cpu") else torch.cuda.set_rng_state(value)
    return info["progress"]

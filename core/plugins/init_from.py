"""Plug-in `init_from`: --init-from, a new run from earlier weights (a run's model.safetensors or checkpoint, or a
Hugging Face folder), loaded into the plain model before DDP wraps it. Pickles are refused, never unpickled."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from core.kernel.job import Options, RecipeError, option
from core.kernel.seams import CHECKSUMS, SEAMS
from core.kernel.store import checksum

INDEX = "model.safetensors.index.json"  # a sharded Hugging Face folder: tensor name -> file
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class InitFrom(Options):
    """initial weights"""

    init_from: str = option("", "start from these weights: a .safetensors file or a Hugging Face folder (no pickle)")


def weight_files(path: str) -> list[Path]:
    """The safetensors files `path` names: itself, or a folder's model.safetensors, or the shards its index lists."""
    where = Path(path)
    step = where if where.is_dir() else where.parent
    if step.parent.name == "ckpt" and step.with_suffix(".safetensors").is_file():  # shard_ckpt's step-N/, a file
        raise RecipeError(
            f"--init-from {path}: a sharded training checkpoint (each file holds some ranks' shards), not weights; "
            f"start from the run's model.safetensors or hf/, or continue it with --resume {step}.safetensors"
        )
    if where.is_dir() and (where / INDEX).is_file():
        files = [where / name for name in index_files(where / INDEX, path=path)]
    elif where.is_dir() and not (where / "model.safetensors").is_file():
        files = [p for p in sorted(where.iterdir()) if p.suffix in PICKLES] or [where / "model.safetensors"]
    else:
        files = [where / "model.safetensors" if where.is_dir() else where]
    for file in files:
        if file.suffix in PICKLES:
            raise RecipeError(
                f"--init-from {path}: {file.name} is a pickle, never unpickled here (loading one can run any code); "
                f"where you trust it, convert it to safetensors (save_pretrained, or safetensors.torch.save_file)"
            )
        if file.suffix != ".safetensors" or not file.is_file():
            why = "not a .safetensors file" if file.exists() else "no such file"
            raise RecipeError(f"--init-from {path}: {why} ({file.name}); give a .safetensors file or a HF folder")
    return files


def index_files(index: Path, *, path: str) -> list[str]:
    """The files a Hugging Face index's weight_map names, each once; one line when the index is not one."""
    try:
        names = list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))
        if not names or not all(isinstance(n, str) for n in names):
            raise TypeError("its weight_map names no files")
        return names
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise RecipeError(
            f"--init-from {path}: {INDEX} is not a readable index ({type(err).__name__}: {err}); it must be JSON "
            f'with "weight_map": {{tensor name: file}}: write the folder again with save_pretrained'
        ) from None


def read_weights(path: str, *, shapes_only: bool = False) -> dict:
    """Every tensor at `path` by name (or only its shape), checked against the checksums a run's files carry."""
    found = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                meta = f.metadata() or {}
                if shapes_only:
                    part = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
                else:
                    part = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
        except (SafetensorError, OSError) as err:
            raise RecipeError(f"--init-from {file}: not a readable safetensors file ({err})") from None
        if "checksums" in meta and not shapes_only:  # written by this project; Hugging Face files carry none
            check_sums(file, part, meta)
        if "progress" in meta:  # a training checkpoint of this project's: its model/ part is the weights
            part = {k.removeprefix("model/"): v for k, v in part.items() if k.startswith("model/")}
        found |= part
    return found


def check_sums(file: Path, tensors: dict, meta: dict[str, str]) -> None:
    """One RecipeError line naming the header or the tensor of a run's file that does not match its checksum."""
    with open(file, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    if meta.get("header_checksum") != checksum(header):
        raise RecipeError(f"{file}: the header does not match its checksum (edited or damaged); use an undamaged copy")
    sums = json.loads(meta["checksums"])
    for key, tensor in tensors.items():  # an older format's checksum: its plug-in's (old_checksums)
        if CHECKSUMS.get(sums.get(key, "").partition(":")[0] + ":", checksum)(tensor) != sums.get(key):
            raise RecipeError(
                f"{file}: tensor {key} does not match its checksum (the file is damaged); use an undamaged copy of it"
            )


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Each state-dict name of a tensor the model holds under several names (tied weights) -> all its names."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return {name: names for names in groups.values() if len(names) > 1 for name in names}


def check_model_matches(where, saved: dict, expected: dict, *, fix: str, tied=None) -> None:
    """One RecipeError line naming the first missing, unexpected and misshapen keys of `saved` (name -> shape); a tied
    name the file leaves out (lm_head.weight) is not missing."""
    tied = tied or {}
    misshapen = sorted(k for k in expected if k in saved and tuple(saved[k]) != tuple(expected[k]))
    problems = {
        "missing keys": sorted(k for k in expected if k not in saved and not any(t in saved for t in tied.get(k, ()))),
        "unexpected keys": sorted(k for k in saved if k not in expected),
        "shape mismatches": [f"{k} {tuple(saved[k])} vs {tuple(expected[k])}" for k in misshapen],
    }
    found = [f"{what}: {', '.join(keys[:3])}{' ...' * (len(keys) > 3)}" for what, keys in problems.items() if keys]
    if found:
        raise RecipeError(f"{where} holds another model ({'; '.join(found)}); {fix}")


def check_weights(path: str, model: nn.Module) -> None:
    """One line naming the keys when the weights at `path` do not fit the model; reads their headers only."""
    expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    shapes = read_weights(path, shapes_only=True)
    fix = "use weights saved from this --model, or load another layout with from_pretrained in your --model factory"
    check_model_matches(f"--init-from {path}", shapes, expected, fix=fix, tied=tied_names(model))


def load_weights(model: nn.Module, path: str) -> None:
    """The weights at `path` into the plain model (before DDP, fully_shard or parallelize_module wraps it)."""
    check_weights(path, model)
    state = read_weights(path)
    for name, names in tied_names(model).items():  # one tensor under several names: each from the one the file has
        first = next(n for n in names if n in state)
        if not torch.equal(state.setdefault(name, state[first]), state[first]):
            raise RecipeError(
                f"--init-from {path}: {first} and {name} differ, but the model ties them (one tensor); start from "
                f"weights trained with them tied, or untie them in the model factory"
            )
    model.load_state_dict(state)


def init_from_weights(cfg, model: nn.Module) -> None:
    if cfg.init_from:  # a new run from earlier weights (a resumed run then takes its checkpoint's)
        load_weights(model, cfg.init_from)


def started_from(cfg, run, model) -> dict:
    return {"init_from": cfg.init_from} if cfg.init_from else {}


SEAMS["option_groups"].append(InitFrom)
SEAMS["after_build"].append(init_from_weights)
SEAMS["after_job"].append(started_from)

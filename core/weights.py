"""Starting from weights: a .safetensors file (a run's model.safetensors) or a Hugging Face folder.

    check_weights(cfg.init_from, model)   # the pre-check: the safetensors headers against the model's shapes
    load_weights(model, cfg.init_from)    # the plain model, before DDP, fully_shard or parallelize_module

Pickles (.bin, .pt) are refused, never unpickled: loading one can run any code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from core.checksum import checksum_matches
from core.ckpt_io import header_checksum, read_header
from core.config import RecipeError

INDEX = "model.safetensors.index.json"  # a sharded Hugging Face folder: tensor name -> file
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
FIX = "point it at a .safetensors file (a run's model.safetensors) or a Hugging Face folder with safetensors weights"


def weight_files(path: str | os.PathLike, *, option: str = "--init-from") -> list[Path]:
    """The safetensors files `path` names: itself, or a folder's model.safetensors or the shards its index lists."""
    folder = Path(path)
    if not folder.is_dir():
        files = [folder]
    elif (folder / INDEX).is_file():
        try:
            files = [
                folder / name for name in dict.fromkeys(json.loads((folder / INDEX).read_text())["weight_map"].values())
            ]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise RecipeError(f"{option} {path}: {INDEX} is not a Hugging Face index ({err!r}); {FIX}") from None
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLES)
        held = f" (it holds {', '.join(pickles)}: pickles, never unpickled)" if pickles else ""
        raise RecipeError(f"{option} {path}: no model.safetensors or {INDEX} in this folder{held}; {FIX}")
    for file in files:
        if file.suffix in PICKLES:
            raise RecipeError(
                f"{option} {file}: a pickle, never unpickled (loading one can run any code); where you trust it, "
                "convert it to safetensors (from_pretrained(...).save_pretrained(DIR) or safetensors.torch.save_file)"
            )
        if not file.is_file() or file.suffix != ".safetensors":
            raise RecipeError(
                f"{option} {file}: {'not a .safetensors file' if file.exists() else 'no such file'}; {FIX}"
            )
    return files


def _open(file: Path, option: str):
    try:
        return safe_open(file, "pt")
    except (SafetensorError, OSError) as err:
        raise RecipeError(f"{option} {file}: not a readable safetensors file ({err}); {FIX}") from None


def saved_shapes(path: str | os.PathLike, *, option: str = "--init-from") -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the safetensors headers alone (no tensor is read)."""
    shapes = {}
    for file in weight_files(path, option=option):
        with _open(file, option) as f:
            shapes |= {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    return shapes


def read_weights(path: str | os.PathLike, *, option: str = "--init-from") -> dict[str, torch.Tensor]:
    """Every tensor at `path` by name, checked against the checksums a run's files carry."""
    tensors = {}
    for file in weight_files(path, option=option):
        with _open(file, option) as f:
            part, meta = {key: f.get_tensor(key) for key in f.keys()}, f.metadata() or {}
        if "checksums" in meta:  # written by this project (core.ckpt_io); Hugging Face files carry none
            sums, header = json.loads(meta["checksums"]), read_header(file)
            bad = [k for k, t in part.items() if not checksum_matches(t, sums.get(k, ""))]
            if bad or meta.get("header_checksum") != header_checksum(header):
                damaged = f"tensor {bad[0]}" if bad else "the header"
                raise RecipeError(f"{option} {file}: {damaged} does not match its checksum (the file is damaged)")
        tensors |= part
    return tensors


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Each state-dict name of a tensor the model holds under several names (tied weights) -> all its names."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return {name: names for names in groups.values() if len(names) > 1 for name in names}


def _some(keys: list[str], n: int = 3) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def check_weights(path: str | os.PathLike, model: nn.Module, *, option: str = "--init-from") -> None:
    """One RecipeError line unless `path` holds the model's state-dict names with its shapes (headers only; the
    model may be on the meta device). A tied name the file leaves out (lm_head.weight) is not missing."""
    saved, tied = saved_shapes(path, option=option), tied_names(model)
    expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    missing = [k for k in expected if k not in saved and not any(t in saved for t in tied.get(k, ()))]
    unexpected = [k for k in saved if k not in expected]
    misshapen = [f"{k} {list(saved[k])} (the model's: {list(s)})" for k, s in expected.items() if saved.get(k, s) != s]
    found = {"missing": missing, "unexpected": unexpected, "misshapen": misshapen}
    problems = "; ".join(f"{what} {_some(keys)}" for what, keys in found.items() if keys)
    if problems:
        raise RecipeError(
            f"{option} {path}: does not fit {type(model).__name__}: {problems}; use weights saved from this "
            "--model (same class and config), or build a Hugging Face checkpoint of another layout with "
            "from_pretrained in your --model factory"
        )


def load_weights(model: nn.Module, path: str | os.PathLike, *, option: str = "--init-from") -> None:
    """Copy the weights at `path` into the plain model (before DDP, fully_shard or parallelize_module wraps it)."""
    check_weights(path, model, option=option)
    state = read_weights(path, option=option)
    for name, names in tied_names(model).items():  # one tensor, several names: every name from the one the file has
        first = next(n for n in names if n in state)
        if name not in state:
            state[name] = state[first]
        elif not torch.equal(state[name], state[first]):
            raise RecipeError(f"{option} {path}: {first} and {name} differ, but the model ties them (one tensor)")
    model.load_state_dict(state)

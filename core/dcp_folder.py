"""A sharded checkpoint's folder on disk, read and checked without a process group (core.dcp writes and loads it).

    RUN/ckpt/step-000120/
      shard-0000R-model-00001-of-00001.safetensors   rank R-1's tensors
      checkpoint.json                                  everything else, with a checksum over itself

The pre-check and rank 0 picking a folder read it here; so do the ranks checking their share at load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from core.checksum import checksum_matches
from core.ckpt_io import atomic_write
from core.kernel.job import RecipeError
from core.kernel.store import checksum

FORMAT = "torch-dist-recipes/dcp/2"  # /2: the optimizer state flattened by parameter name, as torch flattens it
DONE = "checkpoint.json"
STEP_DIR = re.compile(r"step-(\d+)")


def digest(info: dict) -> str:
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()


def read_info(path: Path) -> dict:
    """checkpoint.json, checked whole (its own checksum); a RecipeError line when it isn't a good one."""
    if (path / "ckpt").is_dir() or path.name == "ckpt":  # a run folder, or its ckpt folder: which step?
        raise RecipeError(f"--resume {path}: a folder of checkpoints, not one; pass one of them, or --resume auto")
    if path.is_file() and (path.parent / DONE).is_file():  # a file of a step folder: the folder is the checkpoint
        raise RecipeError(f"--resume {path}: a file inside a sharded checkpoint; pass its folder: {path.parent}")
    fix = f"resume from another step-N folder in {path.parent}"
    try:
        info = json.loads((path / DONE).read_text())
        sealed = info.pop("self_checksum")
    except (OSError, ValueError, KeyError, AttributeError) as err:
        raise RecipeError(f"{path}: not a complete sharded checkpoint ({type(err).__name__}: {err}); {fix}") from None
    if digest(info) != sealed:
        raise RecipeError(f"{path / DONE}: its checksum does not match its contents (edited or corrupted); {fix}")
    if info.get("format") != FORMAT:
        raise RecipeError(f"{path}: format {info.get('format')!r}, not {FORMAT!r}; use the version that wrote it")
    return info


def list_sharded(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (step-N folders with a valid checkpoint.json) in ckpt_dir, oldest first."""
    found = {int(m[1]): p for p in Path(ckpt_dir).glob("step-*") if (m := STEP_DIR.fullmatch(p.name)) and _complete(p)}
    return [found[step] for step in sorted(found)]


def _complete(path: Path) -> bool:
    try:
        return bool(read_info(path))
    except RecipeError:
        return False  # incomplete or damaged: never picked


def file_problems(path: Path, info: dict, names: list[str], *, values: bool) -> list[str]:
    """What is wrong with these shard files of the checkpoint, each problem naming the file.

    Missing, unreadable, and (values=True) a tensor that does not match its checksum or holds NaN or inf."""
    problems = []
    for name in names:
        try:
            with safe_open(str(path / name), framework="pt") as f:  # checks the header and that no byte is missing
                for key, want in info["checksums"][name].items() if values else ():
                    t = f.get_tensor(key)
                    if not checksum_matches(t, want):
                        problems.append(f"tensor {key} in {name} does not match its checksum")
                    problems.extend(non_finite(t, f"tensor {key} in {name}"))
        except FileNotFoundError:
            problems.append(f"shard file {name} is missing")
        except Exception as err:  # noqa: BLE001 a truncated or unreadable file
            problems.append(f"shard file {name} is unreadable ({type(err).__name__}: {' '.join(str(err).split())})")
    return problems


def non_finite(tensor: torch.Tensor, what: str) -> list[str]:
    """A value no training state holds, its checksum right (a diverged run's checkpoint): the `checks` feature."""
    return [f"{what} holds NaN or inf"] if tensor.is_floating_point() and not torch.isfinite(tensor).all() else []


def damage(path: Path, problems: list[str]) -> str:
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    fix = f"resume from an older step-N folder in {path.parent} (--resume auto skips damaged ones)"
    return f"{path}: {problems[0]}{more}; the checkpoint is damaged: {fix}"


def extra_files(path: Path, info: dict) -> list[str]:
    extra = sorted({p.name for p in path.glob("*.safetensors")} - set(info["checksums"]))  # DCP would read them too
    return [f"{name} is not one of its files" for name in extra[:1]]


def file_checksums(folder: Path, *, rank: int) -> dict[str, dict[str, str]]:
    """{file: {key: checksum}} of rank `rank`'s own safetensors file(s) in `folder`, read back from disk."""
    name = re.compile(rf"shard-{rank + 1:05d}-model-\d+-of-\d+\.safetensors")
    out = {}
    for path in sorted(p for p in folder.iterdir() if name.fullmatch(p.name)):
        with safe_open(str(path), framework="pt") as f:
            out[path.name] = {key: checksum(f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118
    return out


def write_json(path: Path, info: dict) -> None:
    text = json.dumps({**info, "self_checksum": digest(info)}, indent=1, sort_keys=True)
    atomic_write(path, lambda f: f.write(text.encode()))

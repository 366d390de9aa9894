"""A sharded checkpoint's checkpoint.json, read without a process group: is a step-N folder complete and
whole, which is the newest, and can this job load it (the pre-check's questions). Written by core.dcp."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from core.config import RecipeError

FORMAT = "torch-dist-recipes/dcp/1"
DONE = "checkpoint.json"
STEP_DIR = re.compile(r"step-(\d+)")


def digest(info: dict) -> str:
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()


def read_info(path: Path) -> dict:
    """checkpoint.json, checked whole (its own checksum); a RecipeError line when it isn't a good one."""
    if (path / "ckpt").is_dir() or path.name == "ckpt":  # a run folder, or its ckpt folder: which step?
        raise RecipeError(f"--resume {path}: a folder of checkpoints, not one; pass one of them, or --resume auto")
    try:
        info = json.loads((path / DONE).read_text())
        sealed = info.pop("self_checksum")
    except (OSError, ValueError, KeyError, AttributeError) as err:
        raise RecipeError(
            f"{path}: not a complete sharded checkpoint ({type(err).__name__}: {err}); "
            f"resume from another step-N folder in {path.parent}"
        ) from None
    if digest(info) != sealed:
        raise RecipeError(
            f"{path / DONE}: its checksum does not match its contents (edited or corrupted); "
            f"resume from another step-N folder in {path.parent}"
        )
    if info.get("format") != FORMAT:
        raise RecipeError(
            f"{path}: format {info.get('format')!r}, not {FORMAT!r}; resume from a checkpoint "
            f"written by this project's sharded save"
        )
    return info


def list_sharded(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (step-N folders with a valid checkpoint.json) in ckpt_dir, oldest first."""
    found = []
    for path in Path(ckpt_dir).glob("step-*"):
        if (m := STEP_DIR.fullmatch(path.name)) and path.is_dir():
            try:
                read_info(path)
            except RecipeError:
                continue  # incomplete or damaged: never picked
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def latest_sharded(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in run_dir/ckpt, or None."""
    found = list_sharded(Path(run_dir) / "ckpt")
    return found[-1] if found else None


def check_sharded(path: str | os.PathLike) -> dict:
    """The pre-check, before any process group (reads checkpoint.json only): world_size, recipe,
    global_batch, mesh ({"dp": 2, "tp": 2}), progress, metadata, shapes (whole model: key -> shape). From
    save_sharded's metadata strings "recipe", "global_batch", "mesh" (JSON); unrecorded: None, None, {}."""
    info = read_info(Path(path))
    meta = info["metadata"]
    return {
        "world_size": info["world_size"],
        "recipe": meta.get("recipe"),
        "global_batch": int(meta["global_batch"]) if "global_batch" in meta else None,
        "mesh": json.loads(meta.get("mesh", "{}")),
        "progress": info["progress"],
        "metadata": meta,
        "shapes": {k: tuple(v) for k, v in info["shapes"].items()},
    }


def refuse_mismatch(path: str | os.PathLike, found: dict, *, recipe: str, mesh: dict[str, int]) -> None:
    """One RecipeError line when this job can't load check_sharded's `found`: another recipe, or a mesh
    whose non-"dp" dimensions (tp, pp: no resharding) differ. dp may change: DCP reshards it."""
    if found["recipe"] is not None and found["recipe"] != recipe:
        raise RecipeError(
            f"--resume {path}: written by recipe {found['recipe']}, this is {recipe}; "
            f"resume it with `{found['recipe']}` or start a new run"
        )
    for dim in sorted((found["mesh"].keys() | mesh.keys()) - {"dp"}):
        was, now = found["mesh"].get(dim, 1), mesh.get(dim, 1)
        if was != now:
            raise RecipeError(
                f"--resume {path}: saved with {dim}={was}, this job has {dim}={now}; {dim} "
                f"shards can't be resharded: launch with {dim}={was} or start a new run"
            )

"""Whether a checkpoint can continue in this job: its model, recipe, precision, global batch and options.

Each check raises core.config.RecipeError with one line naming both sides and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.config import RecipeError

MODEL_PARALLEL = ("fsdp", "fsdp_tp", "tensor_parallel", "pipeline", "pipeline_naive")  # state not held whole
# Options that shape what is trained: a resumed run must keep them, or it would be another run.
TRAJECTORY = ("lr", "seed", "model", "data", "loss", "precision", "accum", "clip", "epochs", "max_steps")


def _few(items: list[str]) -> str:
    return ", ".join(items[:3]) + (f" (+{len(items) - 3} more)" if len(items) > 3 else "")


def check_model_matches(path: Path, saved: dict[str, tuple], expected: dict[str, tuple]) -> None:
    """Name the missing and unexpected keys and the shape mismatches (key -> shape dicts), in one line."""
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys())
    shapes = [
        f"{k} {tuple(saved[k])} vs {tuple(expected[k])}"
        for k in sorted(expected.keys() & saved.keys())
        if tuple(saved[k]) != tuple(expected[k])
    ]
    problems = [
        f"{label}: {_few(found)}"
        for label, found in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes))
        if found
    ]
    if problems:
        raise RecipeError(
            f"{path} holds another model ({'; '.join(problems)}); resume with the --model it was "
            f"trained with, or start a new run"
        )


def saved_precision(meta: dict[str, str]) -> str:
    """The precision a checkpoint was trained in: fp16 when it holds a loss scaler's state."""
    if json.loads(meta.get("scaler", "null")) is not None:
        return "fp16"
    return json.loads(meta.get("config", "{}")).get("precision", "fp32")


def check_compatible(path: Path, meta: dict[str, str], *, recipe: str, precision: str) -> None:
    """A recipe continues another's checkpoint when the train state means the same in both.

    ddp, ddp_amp, ddp_monitored and dp hold the same whole fp32 state (ddp under ddp_amp is fine);
    a model-parallel recipe's state is laid out by its mesh, so only the same recipe continues it;
    fp16 carries a loss scaler that bf16 and fp32 have not (and the reverse), so that boundary is refused.
    """
    saved_recipe = meta.get("recipe") or json.loads(meta.get("config", "{}")).get("recipe")
    if saved_recipe and saved_recipe != recipe and (saved_recipe in MODEL_PARALLEL or recipe in MODEL_PARALLEL):
        raise RecipeError(
            f"{path}: a checkpoint of recipe {saved_recipe}, and this run is {recipe}: its state is "
            f"laid out for {saved_recipe}; resume it with {saved_recipe}, or start a new run"
        )
    saved = saved_precision(meta)
    if (saved == "fp16") != (precision == "fp16"):
        raise RecipeError(
            f"{path}: a checkpoint trained in {saved} and this run asks for --precision {precision}: "
            f"fp16's loss-scaler state does not carry across; resume with --precision {saved}, "
            f"or start a new run"
        )


def check_global_batch(
    path: Path, meta: dict[str, str], *, global_batch: int, world_size: int, accum: int = 1, allow: bool = False
) -> None:
    """The data position is carried in samples of the global order: exact only for the same global batch."""
    progress = json.loads(meta.get("progress", "{}"))
    saved = int(meta.get("global_batch") or progress.get("global_batch") or 0)
    if not saved or saved == global_batch or allow:
        return
    per_rank = global_batch // (world_size * accum)
    if saved % (world_size * accum) == 0:
        fix = f"use --batch-size {saved // (world_size * accum)} at {world_size} rank(s) and --accum {accum}"
    elif saved % (world_size * per_rank) == 0:
        fix = f"use --accum {saved // (world_size * per_rank)} with --batch-size {per_rank}"
    else:
        fix = f"use a number of ranks that divides {saved}"
    raise RecipeError(
        f"{path}: saved with global batch {saved} ({meta.get('world_size', '?')} ranks) and this job's "
        f"is {global_batch} (--batch-size {per_rank} x {world_size} ranks x --accum {accum}); the run "
        f"would change: {fix}"
    )


def check_continues(path: Path, meta: dict[str, str], cfg, *, recipe: str, global_batch: int, dp: int) -> None:
    """All that a checkpoint's header says about resuming it in this job (`dp`: its data-parallel size):
    the recipe and precision continue it, the global batch is the saved one, the options that shape
    training are unchanged. Run.start calls it before the folder is touched, whatever started the run."""
    check_compatible(path, meta, recipe=recipe, precision=getattr(cfg, "precision", "fp32"))
    check_global_batch(path, meta, global_batch=global_batch, world_size=dp, accum=getattr(cfg, "accum", 1))
    saved = json.loads(meta.get("config", "{}"))
    changed = [
        f"--{k.replace('_', '-')} {saved[k]} -> {getattr(cfg, k)}"
        for k in TRAJECTORY
        if k in saved and hasattr(cfg, k) and saved[k] != getattr(cfg, k)
    ]
    if changed:
        raise RecipeError(
            f"{path}: resuming with other options ({', '.join(changed)}) would train another run; "
            f"resume with the options it was started with, or start a new run without --resume"
        )

"""Plug-in `checks`: the resume checks beyond those every copy makes (the global batch, the options that shape
training, the checksums): a checkpoint of a sharded recipe, of a model of other shapes, with fp16's loss
scaler on one side only, or holding a value no training state can (NaN, inf, a negative average of squares), is
refused in one line, and `--resume auto` passes over a diverged one."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from core.kernel.job import RecipeError
from core.kernel.seams import SEAMS

SHARDED = ("fsdp", "fsdp_tp", "tensor_parallel", "pipeline", "pipeline_naive")  # their state is laid out by the mesh
NON_NEGATIVE = ("exp_avg_sq", "max_exp_avg_sq", "square_avg")  # optimizer averages of squares


def check_layout(path: Path, meta: dict[str, str], config: dict) -> None:
    """A checkpoint of a recipe whose state is laid out otherwise, or with fp16's loss scaler on one side only."""
    saved, recipe = json.loads(meta.get("config", "{}")), config["recipe"]
    saved_recipe = meta.get("recipe") or saved.get("recipe")
    if saved_recipe and saved_recipe != recipe and {saved_recipe, recipe} & set(SHARDED):
        raise RecipeError(
            f"{path}: a checkpoint of recipe {saved_recipe}, and this run is {recipe}: its state is laid out for "
            f"{saved_recipe}; resume it with {saved_recipe}, or start a new run"
        )
    progress = json.loads(meta.get("progress", "{}"))  # a kernel checkpoint keeps the scaler's state in its progress
    fp16 = json.loads(meta.get("scaler", "null")) is not None or "scaler" in progress
    precision = config.get("precision", "fp32")
    if fp16 != (precision == "fp16"):  # the loss scaler's state exists on one side only
        was = "fp16" if fp16 else saved.get("precision", "fp32")
        raise RecipeError(
            f"{path}: a checkpoint trained in {was} and this run asks for --precision {precision}: fp16's loss-scaler "
            f"state does not carry across; resume with --precision {was}, or start a new run"
        )


def check_read(path: Path, tensors: dict[str, torch.Tensor], model: nn.Module | None) -> None:
    """Values no training state holds (a diverged run's checkpoint, its checksums right), and the model's shapes."""
    fix = f"resume from an older checkpoint in {path.parent} (--resume auto skips damaged ones)"
    for key, tensor in tensors.items():
        if key.startswith(("model/", "optim/")) and tensor.is_floating_point():
            if not bool(torch.isfinite(tensor).all()):
                raise RecipeError(
                    f"{path}: tensor {key} holds a non-finite value (NaN or inf); the run had "
                    f"diverged or the file is damaged; {fix}"
                )
            if key.rsplit("/", 1)[-1] in NON_NEGATIVE and bool((tensor < 0).any()):
                raise RecipeError(f"{path}: tensor {key} holds a negative value (an average of squares cannot); {fix}")
    if model is not None:
        saved = {k.removeprefix("model/"): tuple(v.shape) for k, v in tensors.items() if k.startswith("model/")}
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        problems = {
            "missing keys": sorted(k for k in expected if k not in saved),
            "unexpected keys": sorted(k for k in saved if k not in expected),
            "shape mismatches": [
                f"{k} {saved[k]} vs {expected[k]}" for k in sorted(expected) if saved.get(k, expected[k]) != expected[k]
            ],
        }
        found = [f"{what}: {', '.join(keys[:3])}{' ...' * (len(keys) > 3)}" for what, keys in problems.items() if keys]
        if found:
            fix = "resume with the --model it was trained with, or start a new run"
            raise RecipeError(f"{path} holds another model ({'; '.join(found)}); {fix}")


SEAMS["resume_checks"].append(check_layout)
SEAMS["read_checks"].append(check_read)

"""The final weights of the recipes not yet on the kernel (core/kernel/store.py writes ddp's; --init-from is the
init_from plug-in's):

    weights.write_weights(run, model.state_dict())  # rank 0: RUN/model.safetensors
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.ckpt_io import atomic_write, savable
from core.kernel.job import RecipeError
from core.plugins.fast_writer import write_fast
from core.records import RunFolder


def model_part(tensors: dict) -> dict:
    """A training checkpoint's model entries (keys `model/NAME`) under the model's own names."""
    return {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}


def write_weights(run: RunFolder, state: dict[str, torch.Tensor]) -> Path:
    """Rank 0 writes the final weights as RUN/model.safetensors, loadable with safetensors.torch.load_file."""
    path = run.path / "model.safetensors"
    if run.writer:
        model = {"model": run.config["model"]} if "model" in run.config else {}  # a copy without --model: none
        atomic_write(path, lambda f: write_fast(f, savable(state), {"recipe": run.recipe, **model}))
    return path


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

"""The final weights of the recipes not yet on the kernel (core/kernel/ckpt.py writes ddp's; --init-from is the
init_from plug-in's):

    weights.write_weights(run, model.state_dict())  # rank 0: RUN/model.safetensors
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.kernel.ckpt import atomic_write, savable
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

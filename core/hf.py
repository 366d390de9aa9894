"""The final weights as a Hugging Face folder too (opt-in): what AutoModel*.from_pretrained(folder) loads.

    find_hf_model(model, attr=cfg.hf_attr)                     # the pre-check: one line if there is none
    write_hf_folder(model, state, run_dir / "hf", attr=cfg.hf_attr, max_shard_mb=cfg.hf_shard_mb)   # rank 0

transformers' own save_pretrained writes it (config.json, generation_config.json, safetensors, an index above
the size), from the full state dict the run gathered: the model only lends its config, class and tied names,
so a meta-device copy of it serves as well (pipeline stages).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from core.config import RecipeError
from core.weights import tied_names


def find_hf_model(model: nn.Module, *, attr: str = "") -> nn.Module:
    """The transformers PreTrainedModel at attribute path `attr` of the plain model ('' is the model itself)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        raise RecipeError("--hf-folder needs transformers: pip install transformers, or drop --hf-folder") from None
    found = model
    for part in attr.split(".") if attr else ():
        if not hasattr(found, part):
            raise RecipeError(
                f"--hf-attr {attr}: {type(found).__name__} has no attribute {part}; name the attribute path "
                "to the transformers model inside --model's module"
            )
        found = getattr(found, part)
    if not isinstance(found, PreTrainedModel):
        where = f"--hf-attr {attr} is {type(found).__name__}" if attr else f"--model builds {type(model).__name__}"
        raise RecipeError(
            f"--hf-folder: {where}, not a transformers PreTrainedModel; name the attribute that holds one "
            "with --hf-attr (e.g. --hf-attr backbone), or drop --hf-folder"
        )
    return found


def write_hf_folder(
    model: nn.Module, state: dict[str, torch.Tensor], out_dir: str | os.PathLike, *, attr: str = "", max_shard_mb: float
) -> Path:
    """Write out_dir/ with save_pretrained from `state` (the plain model's full state dict), shards of at most
    max_shard_mb (10**6 bytes) with model.safetensors.index.json above that; tied weights are written once."""
    from transformers.utils import logging as hf_logging

    hf = find_hf_model(model, attr=attr)
    prefix = f"{attr}." if attr else ""
    state = {key[len(prefix) :]: t for key, t in state.items() if key.startswith(prefix)}
    for name, names in tied_names(hf).items():  # one tensor under each name: save_pretrained then writes one name
        if name in state and names[0] in state:
            state[name] = state[names[0]]
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no progress bar in a run's log
    try:
        hf.save_pretrained(tmp, state_dict=state, max_shard_size=max(1, int(max_shard_mb * 10**6)))
        shutil.rmtree(out, ignore_errors=True)  # an earlier folder goes only once the new one is whole
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # what a failed write left
        if bars:
            hf_logging.enable_progress_bar()
    return out

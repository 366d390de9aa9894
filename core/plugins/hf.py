"""Plug-in `hf`: the final weights as RUN/hf/ too, which AutoModel*.from_pretrained loads, when the model is (or holds
at --hf-attr) a transformers model. transformers' own save_pretrained writes it, from the plain model's state."""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from core.kernel.job import Options, RecipeError, RunFolder, option, say
from core.kernel.seams import SEAMS


@dataclass(frozen=True)
class HFExport(Options):
    """Hugging Face folder"""

    hf_attr: str = option("", "where --model's module holds its transformers model, e.g. backbone (default: itself)")
    hf_shard_mb: float = option(
        5000.0, "largest weights file of RUN/hf, in MB", check=lambda v: v > 0, fix="use above 0"
    )


def hf_model(model: nn.Module, *, attr: str = "") -> nn.Module | None:
    """The transformers PreTrainedModel at attribute path `attr` of the plain model ('' the model itself), or None.
    A named `attr` that is not one is a RecipeError line."""
    found = model
    for part in filter(None, attr.split(".")):
        if not hasattr(found, part):
            raise RecipeError(f"--hf-attr {attr}: {type(found).__name__} has no attribute {part}; name the path to it")
        found = getattr(found, part)
    transformers = sys.modules.get("transformers")  # a model of its classes means it was imported
    if transformers is not None and isinstance(found, transformers.PreTrainedModel):
        return found
    if attr:
        where = f"{type(model).__name__} holds a {type(found).__name__} there"
        raise RecipeError(f"--hf-attr {attr}: {where}, not a transformers model; name the attribute that holds one")
    return None


def write_hf_folder(
    run: RunFolder, model: nn.Module, state: dict[str, torch.Tensor], *, attr: str = "", max_shard_mb: float = 5000.0
) -> Path | None:
    """Rank 0: RUN/hf/, which AutoModel*.from_pretrained loads, when the model is a transformers model.

    The model is one, or holds one at `attr`; the folder is written from the plain model's full state dict, in
    shards of at most max_shard_mb (10**6 bytes) with an index above that. transformers' own save_pretrained
    writes it: config.json, generation_config.json, safetensors; tied weights once."""
    hf = hf_model(model, attr=attr)
    if hf is None or not run.writer:
        return None
    from transformers.utils import logging as hf_logging

    prefix = f"{attr}." if attr else ""
    state = {key[len(prefix) :]: t for key, t in state.items() if key.startswith(prefix)}
    for name, names in tied_in(hf).items():  # one tensor under each name: save_pretrained then writes one name
        if name in state and names[0] in state:
            state[name] = state[names[0]]
    out = run.path / "hf"
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no progress bar in a run's log
    try:
        try:
            hf.save_pretrained(tmp, state_dict=state, max_shard_size=max(1, int(max_shard_mb * 10**6)))
        except (OSError, SafetensorError) as err:  # a full disk: the line names the folder, not a traceback
            raise _os_error(err, tmp) from None
        mode = (tmp / "config.json").stat().st_mode & 0o777  # as open() made it; safetensors writes its files 0600
        for path in tmp.iterdir():
            path.chmod(mode)
        shutil.rmtree(out, ignore_errors=True)  # an earlier folder goes only once the new one is whole
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # what a failed write left
        if bars:
            hf_logging.enable_progress_bar()
    say(run, f"hf folder {out} (AutoModel*.from_pretrained loads it)")
    return out


def _os_error(err: Exception, where: Path) -> OSError:
    """safetensors' writer reports an OS error as a SafetensorError naming neither the file nor the errno: as an
    OSError that does; one with no file name names `where`."""
    if isinstance(err, OSError):
        return err if err.filename else OSError(err.errno, err.strerror, str(where))
    code = re.search(r"os error (\d+)", str(err))
    if code is None:
        return OSError(errno.EIO, str(err), str(where))
    return OSError(int(code[1]), os.strerror(int(code[1])), str(where))


def tied_in(model: nn.Module) -> dict[str, list[str]]:
    """Each state-dict name of a tensor the model holds under several names -> all its names."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return {name: names for names in groups.values() if len(names) > 1 for name in names}


def hf_after_job(cfg, run: RunFolder, model: nn.Module) -> None:
    write_hf_folder(run, model, model.state_dict(), attr=cfg.hf_attr, max_shard_mb=cfg.hf_shard_mb)


SEAMS["option_groups"].append(HFExport)
SEAMS["after_job"].append(hf_after_job)

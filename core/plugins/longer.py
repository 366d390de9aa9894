"""Plug-in `longer`: a finished run resumed with a larger --epochs or --max-steps trains on, its cosine schedule
stretched over the new total (docs/checkpoints.md#training-longer); without it a finished run stays finished."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from core.kernel.ckpt import read_checkpoint
from core.kernel.folder import LENGTH
from core.kernel.log import write_record
from core.kernel.options import RecipeError
from core.kernel.seams import ON_RESUME, TRAINS_ON


def asks_for_more(cfg, run_dir: Path, resume: str) -> bool:
    """The checkpoint --resume continues was saved with other lengths than this command's."""
    with contextlib.suppress(IndexError, KeyError, RecipeError):  # no checkpoint, or a damaged one: finished as it is
        path = (
            Path(resume)
            if resume != "auto"
            else sorted((run_dir / "ckpt").glob("step-*.safetensors"), key=lambda p: (len(p.name), p.name))[-1]
        )
        saved = json.loads(read_checkpoint(path, tensors=False)[1]["config"])
        return any(saved[key] != getattr(cfg, key) for key in LENGTH)
    return False


def stretch(run, saved: dict, *, optimizer, scheduler, step: int) -> None:
    """The learning rate where the cosine over the new total is at this step (closed form), and an `extend` record."""
    if saved["T_max"] != scheduler.T_max:
        for group, lr in zip(optimizer.param_groups, scheduler._get_closed_form_lr()):
            group["lr"] = lr
        write_record(run, {"kind": "extend", "step": step, "old_total": saved["T_max"], "new_total": scheduler.T_max})


TRAINS_ON.append(asks_for_more)
ON_RESUME.append(stretch)

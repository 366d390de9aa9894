"""Plug-in `longer`: a finished run resumed with a larger --epochs or --max-steps trains on, its cosine schedule
stretched over the new total (docs/checkpoints.md#training-longer); without it a finished run stays finished."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

from core.kernel.job import RecipeError, write_record
from core.kernel.seams import SEAMS
from core.kernel.store import read_checkpoint

LENGTH = ("epochs", "max_steps")  # larger ones (0 steps: no limit) train on from a checkpoint at its run's end


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


def may_grow(path: Path, meta: dict[str, str], config: dict) -> list[str]:
    """The lengths a resume may make larger (0 steps: no limit), when the checkpoint was saved at its run's end."""
    saved, end = json.loads(meta.get("config", "{}")), json.loads(meta.get("scheduler", "{}"))
    if end.get("last_epoch", 0) < end.get("T_max", 1):
        return []
    return [k for k in LENGTH if (config[k] or math.inf) >= (saved.get(k) or math.inf)]


SEAMS["trains_on"].append(asks_for_more)
SEAMS["resume_checks"].append(may_grow)
SEAMS["on_resume"].append(stretch)

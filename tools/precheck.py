"""The pre-check: everything that can be refused before any process starts, said in one line.

The launchers run it once (`python -m recipes run NAME ... --dry-run`) before torchrun; a
single-process `python -m recipes run` runs it first too. Nothing is written by it.
"""

from __future__ import annotations

import os

import torch

from core import ckpt, data, dcp, models, steps
from core.ckpt_checks import check_continues
from core.folder import check_free, check_writable, find_resume
from core.sharded_run import ShardedRun  # either kind of checkpoint


def precheck(recipe, module, cfg) -> None:
    """Raise RecipeError (one line) for anything that would fail once processes are running."""
    if hasattr(module, "check"):  # the recipe's own structural checks (mesh sizes, model structure)
        module.check(cfg)
    check_writable(cfg.out)
    data.check_data_factory(cfg.data)  # the factories are called once, here: a bad one fails now
    models.check_model_factory(cfg.model)
    steps.make_loss(cfg.loss)
    if getattr(cfg, "resume", "") or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        check_resume(recipe.name, module, cfg)


def check_resume(recipe: str, module, cfg) -> None:
    path = find_resume(cfg.resume, out=cfg.out, prefix=cfg.name or recipe, newest=ShardedRun.newest_checkpoint)
    if path is None:
        return  # --resume auto and nothing to resume: a fresh run
    if path.parent.name == "ckpt":
        check_free(path.parent.parent)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = module.mesh(cfg, world_size) if hasattr(module, "mesh") else {"dp": world_size}  # the recipe's own
    global_batch = cfg.batch_size * mesh["dp"] * getattr(cfg, "accum", 1)
    if path.is_dir():  # a sharded checkpoint: a DCP folder, one shard per rank
        found = dcp.check_sharded(path)
        dcp.refuse_mismatch(path, found, recipe=recipe, mesh=mesh)
        ckpt.check_model_matches(path, found["shapes"], _shapes(cfg.model))
        meta = {**found["metadata"], "world_size": str(found["world_size"])}
    else:  # whole, undamaged, this model
        meta = ckpt.check_resume_file(path, _shapes(cfg.model))
    check_continues(path, meta, cfg, recipe=recipe, global_batch=global_batch, dp=mesh["dp"])


def _shapes(spec: str) -> dict[str, tuple]:
    with torch.device("meta"):  # shapes only: no memory, no weights initialised
        return {k: tuple(v.shape) for k, v in models.build_model(spec).state_dict().items()}

"""The pre-check: everything that can be refused before any process starts, said in one line.

The launchers run it once (`python -m recipes run NAME ... --dry-run`) before torchrun; a single-process
`python -m recipes run` runs it first too. Nothing is written by it. A copied recipe does not carry it.
"""

from __future__ import annotations

import errno
import inspect
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from core import ckpt, data, folder, models, stream
from core.config import RecipeError
from core.factory import resolve_factory
from core.loss import make_loss


def precheck(recipe, module, cfg) -> None:
    """Raise RecipeError (one line) for anything that would fail once processes are running."""
    if hasattr(module, "check"):  # the recipe's own structural checks (mesh sizes, model structure)
        module.check(cfg)
    check_writable(cfg.out)
    check_data(cfg.data, streams=recipe.streams, recipe=recipe.name)
    model = check_model(cfg.model)
    make_loss(cfg.loss, model=model)
    if cfg.init_from:
        from core.weights import load_weights

        load_weights(model, cfg.init_from)
    if getattr(cfg, "resume", "") or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        check_resume(recipe.name, module, cfg, model)


def call_checked(spec: str, builtins: dict, *, option: str):
    """What the factory returns, called with no arguments; one line for arguments it needs or what it raised."""
    factory = resolve_factory(spec, builtins, option=option)
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # some builtins and C functions have no signature to read
        params = []
    needed = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if needed:
        raise RecipeError(
            f"{option} {spec}: the factory needs arguments ({', '.join(needed)}); it is called with none: give "
            f"them defaults or wrap it in a function that takes none"
        )
    try:
        return factory()
    except RecipeError:
        raise
    except (Exception, SystemExit) as err:  # the user's code: name it and what it raised, in one line
        what = f"exited ({err.code})" if isinstance(err, SystemExit) else f"raised {type(err).__name__}"
        raise RecipeError(f"{option} {spec}: the factory {what}: {' '.join(str(err).split())[:300]}") from None


def check_data(spec: str, *, streams: bool, recipe: str) -> dict:
    """Call the data factory once, check what it returns, and collate two training samples."""
    result = call_checked(spec, data.DATASETS, option="--data")
    shape = "the factory must return (train, val) or (train, val, collate_fn)"
    if not (isinstance(result, tuple | list) and len(result) in (2, 3)):
        raise RecipeError(f"--data {spec}: {shape}; it returned {type(result).__name__}")
    train, val, collate = (*result, None)[:3]
    for name, dataset in (("train", train), ("val", val)):
        if dataset is None and name == "val":
            continue
        if stream.is_stream(dataset):
            if not streams:
                from tools.registry import RECIPES

                takers = ", ".join(r.name for r in RECIPES.values() if r.streams)
                raise RecipeError(
                    f"--data {spec}: its {name} set is a stream (an IterableDataset); {recipe} reads map-style data "
                    f"sets (__getitem__ and __len__); {takers} take streams"
                )
        elif not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")) or isinstance(dataset, str):
            raise RecipeError(f"--data {spec}: {shape}; its {name} is of type {type(dataset).__name__}, not a data set")
    if collate is not None and not callable(collate):
        raise RecipeError(f"--data {spec}: {shape}; its collate_fn is of type {type(collate).__name__}")
    samples = _first(train, 2)
    if not samples:
        raise RecipeError(f"--data {spec}: the training set is empty")
    tuple_ok = isinstance(samples[0], tuple | list) and len(samples[0]) >= 2
    if collate is None and not (isinstance(samples[0], Mapping) or tuple_ok):
        raise RecipeError(
            f"--data {spec}: a training sample is of type {type(samples[0]).__name__}; a sample must be an "
            f"(input, target) pair, an (input, ..., target) tuple or a dict of tensors, or the factory must also "
            f"return a collate_fn"
        )
    try:
        (collate or torch.utils.data.default_collate)(samples)
    except Exception as err:  # e.g. sequences of different lengths and no collate_fn to pad them
        raise RecipeError(
            f"--data {spec}: collating two training samples raised {type(err).__name__}: "
            f"{' '.join(str(err).split())[:200]}; return a collate_fn as the third item of the factory's result"
        ) from None
    return {"train": train, "val": val, "collate": collate, "stream": stream.is_stream(train)}


def _first(dataset, n: int) -> list:
    if stream.is_stream(dataset):
        return [s for _, s in zip(range(n), dataset)]
    return [dataset[i] for i in range(min(n, len(dataset)))]


def check_model(spec: str) -> torch.nn.Module:
    """Call the model factory once; the model, or one line naming what it returned."""
    model = call_checked(spec, models.MODELS, option="--model")
    if not isinstance(model, torch.nn.Module):
        raise RecipeError(f"--model {spec}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def check_writable(out: str) -> None:
    """Fail now, not after an hour of training, when the output folder can't be written; creates nothing."""
    existing = os.path.abspath(out)
    while not os.path.isdir(existing):  # the nearest folder that exists must let us create the rest
        if os.path.dirname(existing) == existing or os.path.exists(existing):
            raise RecipeError(f"--out {out}: cannot write there ({existing} is not a folder); pick a writable one")
        existing = os.path.dirname(existing)
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-check-"):
            pass
    except OSError as err:
        raise RecipeError(f"--out {out}: cannot write there ({err.strerror or err}); pick a writable one") from None


def disk_error(err: OSError) -> str:
    """A failed write as one line: for a full disk with the folder and the bytes free, else with the OS's reason."""
    path = Path(err.filename or ".")
    folder_ = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = os.statvfs(folder_).f_bavail * os.statvfs(folder_).f_frsize
        return f"{folder_}: the disk is full ({free:,} bytes free); free some space or point --out at another disk"
    return f"{err.filename or folder_}: {err.strerror or err}; check the folder"


def check_resume(recipe: str, module, cfg, model) -> None:
    """The checkpoint --resume names (or auto finds) is whole, holds this model and continues in this job."""
    dcp = _sharded(module)
    newest, header = (dcp.newest_good, dcp.read_metadata) if dcp else (ckpt.newest_good, ckpt.read_metadata)
    runs = folder.run_dirs(cfg.out, cfg.name or recipe)
    resume = cfg.resume or "auto"
    path = (newest(runs[-1]) if runs else None) if resume == "auto" else Path(resume)
    if path is None:
        return  # --resume auto and nothing to resume: a fresh run
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = module.mesh(cfg, world_size) if hasattr(module, "mesh") else {"dp": world_size}
    global_batch = cfg.batch_size * mesh["dp"] * getattr(cfg, "accum", 1)
    config = {"recipe": recipe, "world_size": world_size, "global_batch": global_batch, **cfg.to_dict()}
    if dcp is None:  # whole, undamaged, and this model, then the header's options
        tensors, _ = ckpt.read_checkpoint(path)
        ckpt.check_shapes(path, tensors, model)
    else:
        dcp.check_shapes(path, model)
    folder.check_continues(path, header(path), config, dp=mesh["dp"])


def _sharded(module):
    """The sharded-checkpoint module a recipe imports (core.dcp), or None for the one-file checkpoints."""
    return getattr(module, "dcp", None)

"""The pre-check: what a run would refuse once its ranks are up, refused before any process starts (the launchers'
`--dry-run`, or first in a single process), in one line with the fix: the factories called once, one training step
on the first samples, the resume checked with the functions the run calls. It writes nothing; a copy lacks it."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

import core.attach  # noqa: F401 - the package's plug-ins and built-ins (cnn, gpt, synthetic, text)
from core.accum import make_loaders
from core.kernel.job import RecipeError
from core.kernel.seams import SEAMS
from core.kernel.store import check_continues, newest_good, read_checkpoint, run_dirs
from core.kernel.train import IGNORE, Topology, to_device
from core.plugins.factories import DATASETS, MODELS, resolve_factory
from core.plugins.stream import is_stream
from core.shard import BLOCKS
from tools.plan_fixed import gpu_job
from tools.probes import (
    batchnorm_layers,
    check_call,
    collated,
    few,
    first_samples,
    loss_of,
    losses_that_work,
    one_line,
    train_step,
    unused_parameters,
)


def precheck(recipe, module, cfg, *, world_size: int = 1) -> list[str]:
    """One RecipeError line for what would fail once the job's `world_size` processes run; else its warnings."""
    if hasattr(module, "check"):  # the recipe's own structural checks (mesh sizes, model structure)
        module.check(cfg)
    check_writable(cfg.out)
    takes = {f.name for f in dataclasses.fields(cfg)}
    dp = module.mesh(cfg, world_size)["dp"] if hasattr(module, "mesh") else world_size
    found = check_data(cfg.data, streams=recipe.streams, recipe=recipe.name)
    check_steps(found, cfg, dp=dp)
    model = check_model(cfg.model)
    for pick in BLOCKS:  # the blocks plug-in: --blocks NAME names a container of the model (fsdp, fsdp_tp)
        pick(cfg, model)
    check_devices(model, spec=cfg.model, sync_batchnorm=getattr(cfg, "sync_batchnorm", False))
    init_from = getattr(cfg, "init_from", "")  # a third-party recipe's Config may not take --init-from
    if init_from:
        from core.plugins.init_from import load_weights

        load_weights(model, init_from)
    check_trainable(model, spec=cfg.model, init_from=init_from)
    if getattr(cfg, "hf_attr", ""):  # refused here, not after the whole run when hf/ is written
        from core.plugins.hf import hf_model

        hf_model(model, attr=cfg.hf_attr)
    samples = first_samples(found["train"], min(2, cfg.batch_size), spec=cfg.data)
    batch = collated(samples, found["collate"], spec=cfg.data)
    grads = check_step(model, batch, model_spec=cfg.model, data_spec=cfg.data, loss=cfg.loss)
    if "find_unused_parameters" in takes and not (cfg.find_unused_parameters or cfg.static_graph):
        check_unused(model, grads, spec=cfg.model)
    auto = loss_of("auto", model)  # the model's own loss, else cross-entropy
    warnings = unequal_counts(recipe, batch, auto, dp=dp) if recipe.mean_per_replica else []
    if getattr(cfg, "resume", "") or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        check_resume(recipe.name, cfg, model, world_size=world_size, dp=dp)
    return warnings + (batchnorm_warnings(model) if "sync_batchnorm" in takes and not cfg.sync_batchnorm else [])


def call_checked(spec: str, builtins: dict, *, option: str):
    """What the factory returns, called with no arguments; one line for arguments it needs, what it raised, or
    its exit (sys.exit in a factory would otherwise end the pre-check as a success)."""
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
        if isinstance(err, SystemExit):  # would end the pre-check, and with code 0 pass it
            raise RecipeError(
                f"{option} {spec}: the factory called sys.exit({err.code!r}) instead of returning; return the "
                f"{'model' if option == '--model' else 'data sets'}, or raise an exception that says what is wrong"
            ) from None
        raise RecipeError(f"{option} {spec}: the factory raised {one_line(err)}") from None


def check_data(spec: str, *, streams: bool, recipe: str) -> dict:
    """The data factory called once: (train, val[, collate_fn]) of data sets and samples this recipe can read."""
    result = call_checked(spec, DATASETS, option="--data")
    shape = "the factory must return (train, val) or (train, val, collate_fn)"
    if not (isinstance(result, tuple | list) and len(result) in (2, 3)):
        raise RecipeError(f"--data {spec}: {shape}; it returned {type(result).__name__}")
    train, val, collate = (*result, None)[:3]
    for name, dataset in (("train", train), ("val", val))[: 1 + (val is not None)]:  # val may be None
        if is_stream(dataset):
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
        raise RecipeError(f"--data {spec}: {shape}; its collate_fn is of type {type(collate).__name__}, not a function")
    samples = first_samples(train, 2, spec=spec)
    if not samples:
        raise RecipeError(f"--data {spec}: the training set is empty")
    tuple_ok = isinstance(samples[0], tuple | list) and len(samples[0]) >= 2
    if collate is None and not (isinstance(samples[0], Mapping) or tuple_ok):
        raise RecipeError(
            f"--data {spec}: a training sample is of type {type(samples[0]).__name__}; a sample must be an "
            f"(input, target) pair, an (input, ..., target) tuple or a dict of tensors, or the factory must also "
            f"return a collate_fn"
        )
    collated(samples, collate, spec=spec)
    return {"train": train, "val": val, "collate": collate, "stream": is_stream(train)}


def check_steps(found: dict, cfg, *, dp: int) -> None:
    """The run's length as the run reckons it (core.accum's make_loaders, the stream plug-in's, on rank 0's share): a
    batch larger than one rank's share of the data set, or a stream without a length and no --max-steps, is one line."""
    topo = Topology(0, dp, torch.device("cpu"))  # rank 0's share; every rank's is as long
    steps = SimpleNamespace(**{"accum": 1, **vars(cfg)})  # ddp takes no --accum: one micro-batch a step
    total = make_loaders(steps, topo, found["train"], None, found["collate"])[2]
    if found["stream"] and total == 0 and cfg.epochs > 0 and not cfg.max_steps:  # a stream shorter than one step
        fix = f"the stream ({len(found['train'])} samples) holds no step for {dp} rank(s); use a smaller --batch-size"
        raise RecipeError(f"--batch-size {cfg.batch_size} --accum {steps.accum}: {fix} or fewer ranks")


def check_model(spec: str) -> nn.Module:
    """Call the model factory once; the model, or one line naming what it returned."""
    model = call_checked(spec, MODELS, option="--model")
    if not isinstance(model, nn.Module):
        raise RecipeError(f"--model {spec}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def check_trainable(model: nn.Module, *, spec: str, init_from: str = "") -> None:
    """Something to train, and weights that are numbers: a model with no parameter that requires grad, or one
    starting from nan or inf, is one line (its run would fail at the first step, blaming --lr)."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # a frozen -inf mask is no fault
    if not trained:
        raise RecipeError(
            f"--model {spec}: the model has no parameter that requires grad, so there is nothing to train; return a "
            f"model with trainable parameters (unfreeze some with requires_grad_(True))"
        )
    bad = [n for n, p in trained if p.is_floating_point() and not bool(p.isfinite().all())]
    if bad:
        origin = f"--init-from {init_from}" if init_from else f"--model {spec}"
        raise RecipeError(
            f"{origin}: the weights {few(bad)} hold nan or inf before training; start from finite weights"
            + (" (another file, or none)" if init_from else " (check the factory's initialisation)")
        )


def check_devices(model: nn.Module, *, spec: str, sync_batchnorm: bool) -> None:
    """SyncBatchNorm runs on GPUs only: --sync-batchnorm, or SyncBatchNorm layers in the model, on a CPU job is one
    line (torch would refuse it only in the first forward, with one process it would do nothing)."""
    if gpu_job():
        return
    if sync_batchnorm:
        raise RecipeError(
            "--sync-batchnorm: torch's SyncBatchNorm runs on GPUs only, and this job runs on CPU; leave "
            "--sync-batchnorm off (each rank then keeps its own BatchNorm statistics)"
        )
    synced = [n for n, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if synced:
        raise RecipeError(
            f"--model {spec}: SyncBatchNorm layers ({few(synced)}) run on GPUs only, and this job runs on CPU; "
            f"return plain BatchNorm from the factory on CPU (ddp's --sync-batchnorm converts them on GPUs)"
        )


def check_step(model: nn.Module, batch, *, model_spec: str, data_spec: str, loss: str) -> dict[str, torch.Tensor]:
    """One forward and backward of the first samples, as the recipes take them (the kernel's Loss); the gradients.
    A sample that does not fit the forward's signature names the call and the signature; a --loss that cannot
    work names the ones that would."""
    where = f"--model {model_spec} --data {data_spec}"
    batch = to_device(batch, next(model.parameters(), torch.empty(0)).device)
    synced = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)]
    try:
        loss_fn = loss_of(loss, model)  # as the recipes take it (the loss plug-in's --loss)
        check_call(model, batch, loss_fn, where=where)
        for layer in synced:  # SyncBatchNorm trains on GPUs only; here its running statistics stand in
            layer.eval()
        return train_step(model, batch, loss_fn)[1]
    except RecipeError as err:
        failed = str(err)
    except Exception as err:  # the user's model or data raised
        failed = f"one training step on the first samples raised {one_line(err).rstrip('.')}"
    finally:
        for layer in synced:
            layer.train()
    working = " or ".join(losses_that_work(model, batch, besides=loss))
    if failed.startswith(where):  # the sample does not fit the signature: its own fix, and a --loss that fits
        raise RecipeError(failed + (f"; --loss {working} fits this model and data" if working else ""))
    problem = failed.removeprefix(f"--loss {loss}: ").split("; ")[0]  # the loss's problem; the fix is below
    fix = (
        f"use --loss {working}, with which this model and data give a loss" if working else "fix the model or the data"
    )
    raise RecipeError(f"{where} --loss {loss}: {problem}; {fix}")


def check_unused(model: nn.Module, grads: dict, *, spec: str) -> None:
    """DDP waits for every parameter's gradient: one that no forward uses ends the run at its second step."""
    unused = unused_parameters(model, grads)
    if unused:
        raise RecipeError(
            f"--model {spec}: parameters {few(unused)} get no gradient in a training step, so DDP would fail at the "
            f"next one; pass --find-unused-parameters (a graph walk every step) or --static-graph (the same unused "
            f"set every step), or remove or freeze them (requires_grad_(False)) in the factory"
        )


def unequal_counts(recipe, batch, loss_fn, *, dp: int) -> list[str]:
    """The line for a recipe that averages its replicas' mean losses (ddp, dp) when the first samples count
    different numbers of targets (-100 padding): a target then weighs more on a replica that counts fewer."""
    own = isinstance(batch, Mapping) or loss_fn.targets_as is not None  # the model's own loss, in each replica
    replicas = dp if recipe.multi_node else (torch.cuda.device_count() if gpu_job() and own else 1)  # dp: one process
    targets = batch.get("labels") if isinstance(batch, Mapping) else batch[-1]
    if replicas < 2 or not torch.is_tensor(targets) or targets.is_floating_point() or targets.dim() < 1:
        return []
    targets = targets[..., 1:] if loss_fn.shifts and isinstance(batch, Mapping) else targets  # a causal LM's count
    counts = targets.ne(IGNORE).reshape(len(targets), -1).sum(1).tolist()
    if len(set(counts)) < 2:
        return []
    return [
        f"the first samples hold {' and '.join(map(str, counts))} counted targets (not -100): {recipe.name} averages "
        f"the mean losses of its {replicas} replicas, so where their batches count unequal targets a target weighs "
        f"more on the replica with fewer than in one process; ddp_amp weighs every target of the global batch alike "
        f"(token-exact weights)"
    ]


def batchnorm_warnings(model: nn.Module) -> list[str]:
    """The line the DDP recipes' runs print for BatchNorm layers: each rank keeps its own statistics."""
    names = batchnorm_layers(model)
    if not names:
        return []
    fix = "--sync-batchnorm shares them" if gpu_job() else "--sync-batchnorm (GPUs only) would share them"
    return [
        f"BatchNorm layers {few(names)} normalise with each rank's own batch and keep per-rank running statistics, "
        f"so the replicas' buffers end up different; {fix}"
    ]


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


def check_resume(recipe: str, cfg, model, *, world_size: int, dp: int) -> None:
    """The checkpoint --resume names (or auto finds) is whole, holds this model and continues in this job."""
    runs, resume = run_dirs(cfg.out, cfg.name or recipe), cfg.resume or "auto"
    if finished_run(cfg, recipe, resume):
        return  # at any world size, its --epochs and --max-steps: the run is finished and trains nothing
    path = (newest_good(runs[-1]) if runs else None) if resume == "auto" else Path(resume)
    if path is not None:  # else --resume auto and nothing to resume: a fresh run
        with contextlib.suppress(OSError), open(path, "rb") as f:  # torch.save's zip or pickle: said, never unpickled
            if f.read(2) in (b"PK", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"):
                why = "a pickle (torch.save) file, not a safetensors checkpoint; it is never unpickled here"
                raise RecipeError(f"{path}: {why}: resume from a ckpt/step-N.safetensors file")
        batch = cfg.batch_size * dp * getattr(cfg, "accum", 1)
        meta = read_checkpoint(path, tensors=False)[1]  # whole, undamaged, and this model (a sharded one: its shards)
        read_checkpoint(path, None if "shards" in meta else model)
        check_continues(path, meta, {"recipe": recipe, "world_size": world_size, "global_batch": batch, **vars(cfg)})


def finished_run(cfg, recipe: str, resume: str) -> bool:
    """The kernel's `finished` without its process group: the last record is the summary and no plug-in trains on."""
    ckpt = Path(resume).parent  # RUN/ckpt/step-N continues RUN
    runs = [ckpt.parent] * (ckpt.name == "ckpt") if resume != "auto" else run_dirs(cfg.out, cfg.name or recipe)[-1:]
    with contextlib.suppress(IndexError, OSError, ValueError):  # no run, no record, or a torn last line
        last = json.loads((runs[0] / "metrics.jsonl").read_bytes().splitlines()[-1])
        return last.get("kind") == "summary" and not any(hook(cfg, runs[0], resume) for hook in SEAMS["trains_on"])
    return False

"""Shared by the model-parallel tests: run a recipe's train() on a gloo rank as its main() would, and the same
training as one plain process on the same global batches."""

from __future__ import annotations

import importlib

import torch
from safetensors.torch import load_file

from core import data, models, steps
from core.dist import Topology
from core.sharded_run import ShardedRun

BASE = dict(model="gpt", data="text", epochs=1, max_steps=3, batch_size=8, lr=1e-3, log_every=1)


def config(name: str, **changes):
    """recipes.<name>.Config with the tests' small run (3 steps of 8 samples per rank) and `changes`."""
    return importlib.import_module(f"recipes.{name}").Config(**{**BASE, **changes})


def run_recipe(topo, name: str, cfg) -> dict:
    """On each rank: recipes.<name>.train inside Run.start, as main() calls it; returns the summary."""
    module = importlib.import_module(f"recipes.{name}")
    plan = module.mesh(cfg, topo.world_size)
    global_batch = cfg.batch_size * plan["dp"] * cfg.accum
    with ShardedRun.start(cfg, topo, recipe=name, global_batch=global_batch, mesh=plan) as run:
        return module.train(cfg, topo, run)


def reference(cfg, *, replicas: int) -> dict[str, torch.Tensor]:
    """One process, one model, each step on the concatenation of the `replicas` data shares' next --accum
    batches, clipped at --clip, under autocast at --precision."""
    torch.manual_seed(cfg.seed)
    model = models.build_model(cfg.model)
    train_set, _, _ = data.build_data(cfg.data)
    loaders = [
        data.make_loader(
            train_set,
            Topology(r, r, replicas, replicas, 0, torch.device("cpu"), "gloo"),
            batch_size=cfg.batch_size,
            seed=cfg.seed,
        )
        for r in range(replicas)
    ]
    for loader in loaders:
        loader.sampler.set_epoch(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.max_steps)
    accum = getattr(cfg, "accum", 1)
    for _, shares in zip(range(cfg.max_steps), zip(*(_groups(loader, accum) for loader in loaders))):
        batch = tuple(torch.cat(parts) for parts in zip(*(b for share in shares for b in share)))
        steps.train_step(
            model, [batch], optimizer=optimizer, loss_fn=steps.cross_entropy, clip=cfg.clip, precision=cfg.precision
        )
        scheduler.step()
    return model.state_dict()


def _groups(loader, k: int):
    batches = iter(loader)
    while group := [b for _, b in zip(range(k), batches)]:
        yield group


def assert_same_weights(summary: dict, expected: dict[str, torch.Tensor], *, atol: float, rtol: float) -> None:
    """The recipe's saved model.safetensors against the reference, key for key."""
    saved = load_file(summary["weights"])
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, atol=atol, rtol=rtol, msg=lambda m, k=key: f"{k}: {m}")

"""Shared by the model-parallel tests: run a recipe's train() on a gloo rank, and the same
training as one plain process on the same global batches."""
from __future__ import annotations

import importlib

import torch
from safetensors.torch import load_file

from core import data, models, steps
from core.config import TrainConfig
from core.dist import Topology


def run_recipe(topo, name: str, cfg: TrainConfig, options: dict) -> dict:
    """On each rank: recipes.<name>.train as main() would call it; returns rank 0's summary."""
    module = importlib.import_module(f"recipes.{name}")
    if name == "fsdp":  # builds its own model inside train()
        return module.train(cfg, topo, **options)
    torch.manual_seed(cfg.seed)  # what main() does before init_pg
    return module.train(cfg, topo, models.build_model(cfg.model), **options)


def reference(cfg: TrainConfig, *, replicas: int) -> dict[str, torch.Tensor]:
    """One process, one model, each step on the concatenation of the `replicas` data shares."""
    torch.manual_seed(cfg.seed)
    model = models.build_model(cfg.model)
    train_set, _ = data.build_data(cfg.data)
    loaders = [data.make_loader(train_set, Topology(r, r, replicas, replicas, 0, torch.device("cpu"), "gloo"),
                                batch_size=cfg.batch_size, seed=cfg.seed) for r in range(replicas)]
    for loader in loaders:
        loader.sampler.set_epoch(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.max_steps)
    for _, shares in zip(range(cfg.max_steps), zip(*loaders)):
        batch = tuple(torch.cat(parts) for parts in zip(*shares))
        steps.step_plain(model, batch, optimizer=optimizer, loss_fn=steps.cross_entropy)
        scheduler.step()
    return model.state_dict()


def assert_same_weights(summary: dict, expected: dict[str, torch.Tensor], *, atol: float, rtol: float) -> None:
    """The recipe's saved model.safetensors against the reference, key for key."""
    saved = load_file(summary["weights"])
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, atol=atol, rtol=rtol, msg=lambda m, k=key: f"{k}: {m}")

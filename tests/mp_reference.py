"""Shared by the model-parallel tests: run a recipe's train() on a gloo rank as its main() would, the same training
as one plain process on the same global batches, and small models for --model module:function."""

from __future__ import annotations

import hashlib
import importlib

import torch
from safetensors.torch import load_file
from torch import nn

import core.plugins.loss  # noqa: F401 - --loss, as the recipes take it
from core.accum import step_amp
from core.exact_loss import make_exact_loss
from core.kernel.loss import make_loss
from core.kernel.train import Topology, make_loader
from core.plugins.factories import data_from_spec, model_from_spec
from core.plugins.init_from import load_weights
from core.shard import fsdp_policy, shard_blocks
from core.sp_plan import sp_plan
from core.tp_plan import plan_of

BASE = dict(model="gpt", data="mp_reference:short_text", epochs=1, max_steps=3, batch_size=8, lr=1e-3, log_every=1)


def apply_fsdp(model: nn.Module, *, mesh) -> nn.Module:
    """fully_shard each block, then the root, in fp32: the fsdp recipes' lines (core.shard's blocks and policy)."""
    from torch.distributed.fsdp import fully_shard

    for block in shard_blocks(None, model):
        fully_shard(block, mesh=mesh, **fsdp_policy("fp32"))
    return fully_shard(model, mesh=mesh, **fsdp_policy("fp32"))


def apply_tp(model: nn.Module, mesh, *, sequence_parallel: bool = False) -> nn.Module:
    """The recipes' TP split (core.tp_plan.plan_of) over a 1-D `mesh`, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, sp_plan(model, plan_of(model, tp=mesh.size()), enabled=sequence_parallel))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights gathered from the shards on rank 0 ({} on the others; a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def config(name: str, **changes):
    """recipes.<name>.Config with the tests' small run (3 steps of 8 samples per rank) and `changes`."""
    return importlib.import_module(f"recipes.{name}").Config(**{**BASE, **changes})


def run_recipe(topo, name: str, cfg) -> dict:
    """On each rank: recipes.<name>.train, as its main() calls it (train opens the run folder itself)."""
    from core.plugins.lock import HELD

    while HELD:  # run folders' locks of this worker's earlier runs: a real run is a process of its own
        HELD.pop().close()
    return importlib.import_module(f"recipes.{name}").train(cfg, topo)


def run_recipe_rng(topo, name: str, cfg) -> tuple[dict, str]:
    """run_recipe, and a digest of this rank's generator state when it ends (which stream the rank drew from)."""
    summary = run_recipe(topo, name, cfg)
    return summary, hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def reference(cfg, *, replicas: int) -> dict[str, torch.Tensor]:
    """One process, one model (from --init-from's weights when given), each step on the concatenation of the
    `replicas` data shares' next --accum batches, clipped at --clip, under autocast at --precision, with the loss
    the recipe takes."""
    torch.manual_seed(cfg.seed)
    train_set, _, _ = data_from_spec(cfg)  # as the recipe builds them
    model = model_from_spec(cfg)
    if cfg.init_from:
        load_weights(model, cfg.init_from)
    loss_fn = make_exact_loss(make_loss(cfg, model), model=model)
    loaders = [
        make_loader(
            train_set,
            Topology(r, replicas, torch.device("cpu")),
            batch_size=cfg.batch_size,
            collate_fn=None,
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
        step_amp(model, [batch], optimizer=optimizer, loss_fn=loss_fn, clip=cfg.clip, precision=cfg.precision)
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


# --- factories for --model / --data mp_reference:NAME (the tests folder is on the workers' path) -----------------


def short_text():
    """The `text` data with 40 validation windows (of ~600): each run's evaluation, a collective a batch under
    tensor parallelism, stays short; the training set is text's own."""
    from core.gpt import text

    train, val = text()
    return train, torch.utils.data.Subset(val, range(40))


def odd_text():
    """The `text` data with 37 validation windows: no group of a schedule divides them (16 + 16 + 5 at 2 x 8)."""
    train, val = short_text()
    return train, torch.utils.data.Subset(val, range(37))


def tiny_llama() -> nn.Module:
    """A transformers Llama from a tiny config (no download) over the text data's 128 characters: it declares its
    own tensor-parallel plan (config.base_model_tp_plan)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


class DropoutGPT(nn.Module):
    """The tiny GPT with dropout after its embedding: each rank's masks come from its own generator."""

    def __init__(self):
        super().__init__()
        from core.gpt import GPT

        gpt = GPT(dim=32, heads=2, layers=2)
        gpt.blocks.insert(1, nn.Dropout(0.2))
        self.blocks = gpt.blocks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.blocks(tokens)


def dropout_gpt() -> nn.Module:
    return DropoutGPT()


class CountingMLP(nn.Module):
    """The MLP with a buffer forward adds its inputs to: each rank counts its own share, so the replicas' buffers
    differ at the end (as a running statistic that is not BatchNorm's does)."""

    def __init__(self):
        super().__init__()
        from core.kernel.builtin import MLP

        self.mlp = MLP(hidden=32, depth=2)
        self.register_buffer("inputs_seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.inputs_seen += x.detach().sum()
        return self.mlp(x)


def counting_mlp() -> nn.Module:
    return CountingMLP()


class PaddedTargets(torch.utils.data.Dataset):
    """`base`'s (tokens, targets) samples with the targets -100 on a tail of the sample's own length, and every third
    sample's wholly: a micro-batch may count no target at all, as with padded sequences."""

    def __init__(self, base):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        tokens, targets = self.base[i]
        targets = targets.clone()
        targets[0 if i % 3 == 0 else 2 + (5 * i) % (len(targets) - 2) :] = -100
        return tokens, targets


def padded_text():
    """43 training windows of `text` (5 batches of 8 and a smaller last one of 3) and 40 validation windows, targets
    padded with -100 (PaddedTargets)."""
    train, val = short_text()
    return PaddedTargets(torch.utils.data.Subset(train, range(43))), PaddedTargets(val)

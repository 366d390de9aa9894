"""What a sharded checkpoint holds, as flat tensors for DCP: the model's and the optimizer's (DTensor shards or a
pipeline rank's stages), each storage once, and this rank's generators."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from core.dist import all_gather_object
from core.weights import model_part


def root_module(model: nn.Module | list[nn.Module]) -> nn.Module:
    """One module for several pipeline stages of a rank, their blocks under their own names."""
    if isinstance(model, nn.Module):
        return model
    root, blocks = nn.Module(), nn.Module()
    for stage in model:
        for name, block in stage.blocks.named_children():
            blocks.add_module(name, block)
    root.add_module("blocks", blocks)
    return root


def whole_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """The model's whole shapes (DTensor.shape is the whole tensor's), merged over ranks: a collective."""
    mine = {k: list(v.shape) for k, v in model_part(tensors).items()}
    return {k: v for shapes in all_gather_object(mine) for k, v in shapes.items()}


def train_tensors(model, optimizer) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Flat tensors for DCP, the optimizer's param groups and its non-tensor per-parameter state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # here: only sharded recipes load DCP

    model_sd, optim_sd = get_state_dict(root_module(model), optimizer)
    flat = {f"{fqn}/{name}": value for fqn, state in optim_sd["state"].items() for name, value in state.items()}
    tensors = {f"model/{k}": v for k, v in model_sd.items()}
    tensors |= {f"optim/{key}": value for key, value in flat.items() if torch.is_tensor(value)}
    return tensors, optim_sd["param_groups"], {key: value for key, value in flat.items() if not torch.is_tensor(value)}


def untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors with each storage once: a tied weight under its first name only.

    A tied weight: lm_head and the embedding. safetensors refuses shared memory; loading into that one fills the
    other names, which share its storage."""
    out, seen = {}, set()
    for key, value in tensors.items():
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor's shard on this rank
        where = (
            (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)) if local.numel() else key
        )
        if where not in seen:
            out[key] = value
        seen.add(where)
    return out


def rng_tensors() -> dict[str, torch.Tensor]:
    """This rank's generators, under its rank."""
    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    return {f"rng/{dist.get_rank()}/{kind}": state for kind, state in ({"cpu": torch.get_rng_state()} | cuda).items()}

"""What a sharded checkpoint holds, as flat tensors for DCP: the model's and the optimizer's (DTensor shards or a
pipeline rank's stages), each storage once, and this rank's generators."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from core.dist import all_gather_object
from core.weights import model_part


def whole_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """The model's whole shapes (DTensor.shape is the whole tensor's), merged over ranks: a collective."""
    mine = {k: list(v.shape) for k, v in model_part(tensors).items()}
    return {k: v for shapes in all_gather_object(mine) for k, v in shapes.items()}


def train_tensors(model: nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Flat tensors for DCP, and the optimizer's other values: torch's flattening of the optimizer state by parameter
    name (state.<fqn>.<name>, param_groups.<fqn>.<name>), which set_state_dict undoes on any rank's parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # only sharded recipes: DCP

    model_sd, optim = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    tensors = {f"model/{k}": v for k, v in model_sd.items()}
    tensors |= {f"optim/{k}": v for k, v in optim.items() if torch.is_tensor(v)}
    return tensors, {k: v for k, v in optim.items() if not torch.is_tensor(v)}


def untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors with each storage once: a tied weight under its first name only.

    A tied weight: lm_head and the embedding. safetensors refuses shared memory; loading into that one fills the
    other names, which share its storage."""
    out, seen = {}, set()
    for key, value in tensors.items():
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor's shard on this rank
        where = (local.untyped_storage().data_ptr(), local.storage_offset(), local.shape) if local.numel() else key
        if where not in seen:
            out[key] = value
        seen.add(where)
    return out


def rng_tensors() -> dict[str, torch.Tensor]:
    """This rank's generators, under its rank."""
    cuda = {"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {}
    return {f"rng/{dist.get_rank()}/{kind}": state for kind, state in ({"cpu": torch.get_rng_state()} | cuda).items()}

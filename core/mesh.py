"""The device mesh, and a model whose every forward is a collective: its precision option, evaluation, whole weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from core.exact_loss import forward_exact
from core.kernel.job import Options, RecipeError, RunFolder, option
from core.kernel.store import write_weights
from core.kernel.train import Tally, summarize, to_device


@dataclass(frozen=True)
class ShardedPrecision(Options):
    """mixed precision"""

    # no fp16: its loss scaler would have to skip a step on every shard alike
    precision: str = option("fp32", "compute precision (bf16: in fully_shard or autocast)", choices=("fp32", "bf16"))


def build_mesh(topo, dims: dict[str, int]):
    """A DeviceMesh over all ranks, e.g. {"dp": 2, "tp": 2} (rank = dp_index * tp + tp_index), or one error line."""
    if (total := math.prod(dims.values())) != (world := topo.world_size):
        shape = " x ".join(f"{name}={size}" for name, size in dims.items())
        raise RecipeError(f"a {shape} mesh needs {total} processes but the world size is {world}; launch {total}")
    return dist.init_device_mesh(topo.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))


@torch.no_grad()
def evaluate_sharded(model: nn.Module, loader, *, loss_fn, device: torch.device) -> dict[str, float]:
    """Evaluation where a rank whose share ran out repeats its last batch uncounted: all run as many forwards."""
    if loader is None:
        return {}
    tally, batches, last = Tally(device), iter(loader), None
    model.eval()
    while True:
        last = last if (batch := next(batches, None)) is None else batch
        flags = torch.tensor([batch is not None, last is None], device=device, dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if not flags[0]:
            break
        if flags[1]:  # a rank with no batch at all takes rank 0's first: every rank sees the flag, all broadcast
            dist.broadcast_object_list(box := [last], src=0)
            last = box[0] if last is None else last
        metrics = forward_exact(model, to_device(last, device), loss_fn)[1]  # a collective: every rank runs it
        tally.add(metrics if batch is not None else {})
    model.train()
    getattr(model, "reshard", lambda: None)()  # fully_shard keeps the root gathered after a forward alone: free it
    return summarize(tally.reduce(), prefix="val_")


def whole_model(model: nn.Module, build, run: RunFolder) -> tuple[nn.Module, str]:
    """A plain twin given the whole weights one tensor at a time (a collective), each rank its own buffers; rank 0
    writes them as RUN/model.safetensors (its path, a str for the summary)."""
    with torch.device("meta"):
        twin = build()
    local = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731 - a DTensor's whole tensor
    twin.load_state_dict({key: local(t).cpu() for key, t in model.state_dict().items()}, assign=True)
    return twin, str(write_weights(run, twin.state_dict()))

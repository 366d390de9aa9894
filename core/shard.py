"""fully_shard's pieces, for fsdp (fsdp_tp, tensor_parallel and pipeline take the mesh, the full weights and the
sharded evaluation): the device mesh, the blocks to shard one by one, the precision policy, the gradient sync held
back while micro-batches accumulate, the whole model gathered from the shards, and evaluation where every forward
is a collective. The recipe calls torch's fully_shard itself."""

from __future__ import annotations

import math
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from core.kernel.loader import to_device
from core.kernel.numbers import Tally, summarize
from core.kernel.options import Options, RecipeError, option
from core.kernel.pg import broadcast_object

BLOCKS: list = []  # fn(cfg, model) -> (name, container) or None: the blocks fully_shard wraps one by one (--blocks)


@dataclass(frozen=True)
class ShardedPrecision(Options):
    title = "mixed precision"
    # no fp16: its loss scaler would have to skip a step on every shard alike
    precision: str = option(
        "fp32", "compute precision (bf16: fully_shard's MixedPrecisionPolicy, or autocast)", choices=("fp32", "bf16")
    )


def build_mesh(topo, dims: dict[str, int]):
    """A DeviceMesh over all ranks, e.g. {"dp": 2, "tp": 2}: rank = dp_index * tp + tp_index; sizes that do not
    multiply to the world size are one RecipeError line."""
    if (total := math.prod(dims.values())) != topo.world_size or min(dims.values()) < 1:
        shape = " x ".join(f"{name}={size}" for name, size in dims.items())
        raise RecipeError(
            f"a {shape} mesh needs {total} processes but the world size is {topo.world_size}; launch {total} "
            f"processes (NPROC_PER_NODE) or pick sizes that multiply to {topo.world_size}"
        )
    return init_device_mesh(topo.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def find_blocks(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The model's repeated blocks, (path, container): the ModuleList or Sequential whose children repeat one class
    (GPT-2's `transformer.h`, Llama's `model.layers`) holding the most parameters, the outermost on a tie."""
    containers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential) and len(m)]
    repeated = [(n, m) for n, m in containers if max(Counter(type(c) for c in m).values()) >= 2]
    if not repeated:
        return None
    return max(repeated, key=lambda item: (sum(p.numel() for p in item[1].parameters()), -item[0].count(".")))


def shard_blocks(cfg, model: nn.Module) -> list[nn.Module]:
    """The blocks to fully_shard one by one before the root, each gathered just before it runs and freed after: a
    rank holds 1/N of the model plus one block. None found: a warning, and the root is the one unit."""
    found = next(filter(None, (pick(cfg, model) for pick in BLOCKS)), None) or find_blocks(model)  # --blocks NAME
    if found is None:
        warnings.warn(
            f"fsdp: {type(model).__name__} has no repeated blocks (an nn.ModuleList of one class); sharding it as one "
            f"unit, which gathers the whole model for each forward; name them with --blocks (a standalone copy: made "
            f"`--with blocks`)",
            stacklevel=2,
        )
        return []
    return list(found[1])


def fsdp_policy(precision: str, *, offload: bool = False) -> dict:
    """fully_shard's keyword arguments: bf16 computes in bf16 and reduces gradients in fp32; offload keeps the
    shards and the optimizer step in CPU memory."""
    dtype = torch.bfloat16 if precision == "bf16" else None
    return {
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
    }


@contextmanager
def fsdp_sync(model: nn.Module, *, enabled: bool):
    """step_amp's `sync` for fully_shard: with enabled=False the backward keeps unsharded gradients and adds to
    them; the reduce-scatter waits for the micro-batch run with enabled=True."""
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def whole_model(model: nn.Module, build) -> nn.Module:
    """A plain twin of the sharded model, as the plug-ins after the job read one (RUN/hf, replicas_identical): its
    whole weights on every rank, gathered one tensor at a time into CPU memory, and each rank's own buffers; `build()`
    makes the plain model (on the meta device here: no memory until the weights are assigned). A collective."""
    with torch.device("meta"):
        twin = build()
    local = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731 - a DTensor's whole tensor
    twin.load_state_dict({key: local(t).cpu() for key, t in model.state_dict().items()}, assign=True)
    return twin


@torch.no_grad()
def evaluate_sharded(model: nn.Module, loader, *, loss_fn, device: torch.device, forward) -> dict[str, float]:
    """The kernel's evaluate for a model whose every forward is a collective: every rank runs as many forwards, one
    whose share ran out repeating its last batch uncounted (a rank with none: rank 0's first), so unequal shares end
    without a hang and each sample counts once. `forward`: exact_loss's forward_sums."""
    if loader is None:
        return {}
    was_training, tally, batches, last = model.training, Tally(device), iter(loader), None
    model.eval()
    while True:
        batch = next(batches, None)
        last = last if batch is None else batch
        flags = torch.tensor([batch is not None, last is None], device=device, dtype=torch.int32)
        if dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if not flags[0]:
            break
        if flags[1]:  # every rank sees the same flags: all take part in the broadcast
            filler = broadcast_object(last)
            last = filler if last is None else last
        metrics = forward(model, to_device(last, device), loss_fn)[1]
        if batch is not None:
            tally.add(metrics)
    model.train(was_training)
    if hasattr(model, "reshard"):  # fully_shard keeps the root gathered after a forward with no backward: free it
        model.reshard()
    return summarize(tally.reduce(), prefix="val_")

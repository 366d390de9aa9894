"""Wrappers that make a plain model parallel. Each is one small function; recipes apply them in order."""

from __future__ import annotations

import warnings
from collections import Counter
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from core.config import RecipeError

# --- model parallelism: device meshes, tensor parallel (DTensor), FSDP2 -------------------------


def check_mesh(world_size: int, dims: dict[str, int]) -> None:
    """Refuse, before any process group exists, a mesh whose sizes don't multiply to the world size."""
    shape = " x ".join(f"{name}={size}" for name, size in dims.items())
    total = 1
    for size in dims.values():
        total *= size
    if min(dims.values()) < 1 or total != world_size:
        raise RecipeError(
            f"a {shape} mesh needs {total} processes but the world size is {world_size}; "
            f"launch {total} processes (NPROC_PER_NODE) or pick sizes that multiply to {world_size}"
        )


def build_mesh(topo, dims: dict[str, int]):
    """A DeviceMesh over all ranks, e.g. {"dp": 2, "tp": 2}: rank = dp_index * tp + tp_index."""
    check_mesh(topo.world_size, dims)
    return init_device_mesh(topo.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def check_tp_model(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks tensor parallelism shards; a RecipeError naming the structure it needs.

    Reads only attributes and shapes, so it runs on a meta-device model before any process starts."""
    blocks = [b for b in getattr(model, "blocks", []) if hasattr(b, "attn") and hasattr(b, "mlp")]
    needs = (
        "model.blocks (an nn.Sequential, forward = model.blocks(x)) whose blocks have attn.q/k/v/proj and "
        "mlp.fc/proj nn.Linear layers, like core.gpt.GPT"
    )
    if not blocks:
        found = find_blocks(model)
        seen = f" (its repeated blocks are {found[0]})" if found else ""
        raise RecipeError(
            f"--model {type(model).__name__}: tensor parallelism needs {needs}{seen}; use fsdp for this model"
        )
    for block in blocks:
        names = [getattr(block.attn, n, None) for n in ("q", "k", "v", "proj")]
        names += [getattr(block.mlp, n, None) for n in ("fc", "proj")]  # GPT-2's are c_fc, c_proj: refuse, no traceback
        if not all(isinstance(m, nn.Linear) for m in names) or not hasattr(block.attn, "head_dim"):
            raise RecipeError(f"--model {type(model).__name__}: tensor parallelism needs {needs}; use fsdp for it")
    return blocks


def check_tp(model: nn.Module, tp: int, *, sequence_parallel: bool = False) -> None:
    """A RecipeError unless every transformer block splits into `tp` equal, whole-head shards."""
    for block in check_tp_model(model):
        heads = block.attn.q.out_features // block.attn.head_dim
        if heads % tp or block.mlp.fc.out_features % tp:
            raise RecipeError(
                f"tensor parallel size {tp} must divide the {heads} attention heads and the "
                f"{block.mlp.fc.out_features} MLP units; use a tp size that divides both"
            )
    if sequence_parallel and not (hasattr(model.blocks[-1], "ln") and hasattr(model.blocks[-1], "out")):
        raise RecipeError("--sequence-parallel needs the GPT layout: blocks = [Embed, Block..., Head(ln, out)]")


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict:
    """The Megatron plan: q, k, v and mlp.fc split by output column, attn.proj and mlp.proj by
    input row, so each block needs one all-reduce forward and one backward per sub-layer.

    sequence_parallel: the residual stream between sub-layers stays split along the sequence
    (LayerNorms run on a shard), the all-reduce becomes a reduce-scatter plus an all-gather."""
    row_out = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    for i, block in enumerate(model.blocks):
        if not (hasattr(block, "attn") and hasattr(block, "mlp")):
            continue
        for sub, first, last in (("attn", ("q", "k", "v"), "proj"), ("mlp", ("fc",), "proj")):
            plan.update({f"blocks.{i}.{sub}.{name}": ColwiseParallel() for name in first})
            plan[f"blocks.{i}.{sub}.{last}"] = RowwiseParallel(output_layouts=row_out)
            if sequence_parallel:  # gather the sequence before the column-split layers
                plan[f"blocks.{i}.{sub}"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                )
                plan[f"blocks.{i}.ln{1 if sub == 'attn' else 2}"] = SequenceParallel()
    if sequence_parallel:
        last = len(model.blocks) - 1
        plan["blocks.0"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan[f"blocks.{last}.ln"] = SequenceParallel()
        plan[f"blocks.{last}.out"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


def apply_tp(model: nn.Module, mesh, *, sequence_parallel: bool = False) -> nn.Module:
    """Shard the model's Linear layers over a 1-D `mesh` in place (parameters become DTensors)."""
    check_tp(model, mesh.size(), sequence_parallel=sequence_parallel)
    return parallelize_module(model, mesh, tp_plan(model, sequence_parallel=sequence_parallel))


def _containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential) and len(m)]


def find_blocks(model: nn.Module, *, name: str | None = None) -> tuple[str, nn.Module] | None:
    """The model's repeated blocks: (path, container), or None when it has none.

    With `name` (e.g. "transformer.h"), that nn.ModuleList / nn.Sequential, or a RecipeError listing the
    candidates. Without, the ModuleList / Sequential whose children repeat one class (GPT-2's and
    nanoGPT's `transformer.h`, Llama's `model.layers`, `blocks` here) holding the most parameters,
    the outermost on a tie."""
    containers = _containers(model)
    if name is not None:
        found = dict(containers).get(name)
        if found is None:
            listed = ", ".join(n or "(the model itself)" for n, _ in containers) or "none"
            raise RecipeError(
                f"--blocks {name}: {type(model).__name__} has no nn.ModuleList or nn.Sequential "
                f"there; candidates: {listed}"
            )
        return name, found
    repeated = [(n, m) for n, m in containers if max(Counter(type(c) for c in m).values()) >= 2]
    if not repeated:
        return None
    return max(repeated, key=lambda item: (sum(p.numel() for p in item[1].parameters()), -item[0].count(".")))


def apply_fsdp(
    model: nn.Module, *, mesh=None, precision: str = "fp32", offload: bool = False, blocks: str | None = None
) -> nn.Module:
    """FSDP2: fully_shard each repeated block (find_blocks; `blocks` names them), then the root. Each block's
    parameters are gathered just before it runs and freed after, so a rank holds 1/N of the model plus
    one block at a time. A model without repeated blocks is sharded as one unit, with a warning.

    precision="bf16": compute in bf16, reduce gradients in fp32; offload: shards live in CPU memory."""
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    options = dict(mesh=mesh, mp_policy=policy, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    found = find_blocks(model, name=blocks)
    if found is None:  # one unit: the whole model is gathered at once, so a rank's peak memory is the model's
        warnings.warn(
            f"fsdp: {type(model).__name__} has no repeated blocks (an nn.ModuleList of one class); "
            f"sharding it as one unit, which gathers the whole model for each forward; name them "
            f"with --blocks",
            stacklevel=2,
        )
    for block in found[1] if found else ():
        fully_shard(block, **options)
    return fully_shard(model, **options)


@contextmanager
def fsdp_sync(model: nn.Module, *, enabled: bool):
    """core.steps.grad_sync's shape for fully_shard: with enabled=False the backward inside keeps unsharded
    gradients and adds to them, the reduce-scatter waits for the micro-batch run with enabled=True.

        steps.step_amp(model, micro_batches, ..., sync=parallel.fsdp_sync)"""
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)

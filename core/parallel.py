"""Model parallelism's pieces for fsdp, tensor_parallel, fsdp_tp and pipeline: the device mesh, what fully_shard
and the built-in GPT's tensor-parallel plan need, the full weights gathered from shards, and evaluation where
every forward is a collective. The recipes call torch's fully_shard and parallelize_module themselves.

    dp_mesh = parallel.build_mesh(topo, {"dp": topo.world_size})
    policy = parallel.fsdp_policy(cfg.precision, offload=cfg.offload)
    for block in parallel.shard_units(model, parallel.find_blocks(model)):
        fully_shard(block, mesh=dp_mesh, **policy)
    fully_shard(model, mesh=dp_mesh, **policy)
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

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

from core.kernel.job import Options, RecipeError, option
from core.kernel.train import to_device
from core.meter import Tally, summarize
from core.stream import in_step


@dataclass(frozen=True)
class ShardedPrecision(Options):
    title = "mixed precision"
    # no fp16: its loss scaler would have to skip a step on every shard alike
    precision: str = option(
        "fp32", "compute precision (bf16: fully_shard's MixedPrecisionPolicy, or autocast)", choices=("fp32", "bf16")
    )


# --- the device mesh ---------------------------------------------------------------------------------------------


def build_mesh(topo, dims: dict[str, int]):
    """A DeviceMesh over all ranks, e.g. {"dp": 2, "tp": 2}: rank = dp_index * tp + tp_index. Sizes that do not
    multiply to the world size are one RecipeError line (each recipe's own check refuses them before launch)."""
    if (total := math.prod(dims.values())) != topo.world_size or min(dims.values()) < 1:
        shape = " x ".join(f"{name}={size}" for name, size in dims.items())
        raise RecipeError(
            f"a {shape} mesh needs {total} processes but the world size is {topo.world_size}; launch {total} "
            f"processes (NPROC_PER_NODE) or pick sizes that multiply to {topo.world_size}"
        )
    return init_device_mesh(topo.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))


# --- fully_shard -------------------------------------------------------------------------------------------------


def find_blocks(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The model's repeated blocks: (path, container), or None when it has none.

    The ModuleList / Sequential whose children repeat one class (GPT-2's and nanoGPT's `transformer.h`, Llama's
    `model.layers`, `blocks` here) holding the most parameters, the outermost on a tie."""
    containers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential) and len(m)]
    repeated = [(n, m) for n, m in containers if max(Counter(type(c) for c in m).values()) >= 2]
    if not repeated:
        return None
    return max(repeated, key=lambda item: (sum(p.numel() for p in item[1].parameters()), -item[0].count(".")))


def named_blocks(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """--blocks NAME: (NAME, that nn.ModuleList / nn.Sequential), e.g. "transformer.h", or a RecipeError listing the
    candidates."""
    containers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential) and len(m)]
    found = dict(containers).get(name)
    if found is None:
        listed = ", ".join(n or "(the model itself)" for n, _ in containers) or "none"
        raise RecipeError(
            f"--blocks {name}: {type(model).__name__} has no nn.ModuleList or nn.Sequential there; candidates: {listed}"
        )
    return name, found


def shard_units(model: nn.Module, found: tuple[str, nn.Module] | None) -> list[nn.Module]:
    """The blocks to fully_shard one by one before the root: `found`'s (find_blocks', or named_blocks' for --blocks).
    Each is gathered just before it runs and freed after, so a rank holds 1/N of the model plus one block. None: a
    warning, and the root alone is one unit (the whole model gathered for each forward)."""
    if found is None:
        warnings.warn(
            f"fsdp: {type(model).__name__} has no repeated blocks (an nn.ModuleList of one class); "
            f"sharding it as one unit, which gathers the whole model for each forward; name them with --blocks (a "
            f"standalone copy: made `--with blocks`)",
            stacklevel=2,
        )
        return []
    return list(found[1])


def fsdp_policy(precision: str, *, offload: bool = False) -> dict:
    """fully_shard's keyword arguments for the precision and the offload.

    bf16 computes in bf16 and reduces gradients in fp32; offload keeps the shards and the optimizer step in CPU
    memory."""
    dtype = torch.bfloat16 if precision == "bf16" else None
    return {
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
    }


def apply_fsdp(
    model: nn.Module, *, mesh=None, precision: str = "fp32", offload: bool = False, blocks: str = ""
) -> nn.Module:
    """fully_shard each block (shard_units), then the root: the recipes' lines, for tests and bench/."""
    policy = fsdp_policy(precision, offload=offload)
    for block in shard_units(model, named_blocks(model, blocks) if blocks else find_blocks(model)):
        fully_shard(block, mesh=mesh, **policy)
    return fully_shard(model, mesh=mesh, **policy)


@contextmanager
def fsdp_sync(model: nn.Module, *, enabled: bool):
    """core.amp.grad_sync's shape for fully_shard.

    With enabled=False the backward inside keeps unsharded gradients and adds to them, the reduce-scatter waits for
    the micro-batch run with enabled=True.

        accum.step_amp(model, micro_batches, ..., sync=parallel.fsdp_sync)"""
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# --- the built-in GPT's tensor-parallel plan (core.tp_plan: a transformers model's own) --------------------------


GPT_LAYOUT = (
    "model.blocks (an nn.Sequential, forward = model.blocks(x)) whose blocks have attn.q/k/v/proj and "
    "mlp.fc/proj nn.Linear layers, like the built-in GPT"
)


def check_tp_model(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks the GPT plan splits; a RecipeError naming the layout it needs.

    Reads only attributes and shapes, so it runs on a meta-device model before any process starts."""
    blocks = [b for b in getattr(model, "blocks", []) if hasattr(b, "attn") and hasattr(b, "mlp")]
    if not blocks:
        raise RecipeError(
            f"the model ({type(model).__name__}): tensor parallelism needs {GPT_LAYOUT}, or a transformers "
            f"model's own plan (which a standalone copy reads when made `--with model_plans`); use fsdp for this model"
        )
    for block in blocks:
        names = [getattr(block.attn, n, None) for n in ("q", "k", "v", "proj")]
        names += [getattr(block.mlp, n, None) for n in ("fc", "proj")]  # GPT-2's are c_fc, c_proj: refuse, no traceback
        if not all(isinstance(m, nn.Linear) for m in names) or not hasattr(block.attn, "head_dim"):
            raise RecipeError(f"--model {type(model).__name__}: tensor parallelism needs {GPT_LAYOUT}; use fsdp for it")
    return blocks


def check_tp(model: nn.Module, tp: int, *, sequence_parallel: bool = False) -> None:
    """A RecipeError unless every GPT block splits into `tp` equal, whole-head shards."""
    for block in check_tp_model(model):
        heads = block.attn.q.out_features // block.attn.head_dim
        if heads % tp or block.mlp.fc.out_features % tp:
            raise RecipeError(
                f"tensor parallel size {tp} must divide the {heads} attention heads and the "
                f"{block.mlp.fc.out_features} MLP units; use a tp size that divides both"
            )
    if sequence_parallel and not (hasattr(model.blocks[-1], "ln") and hasattr(model.blocks[-1], "out")):
        raise RecipeError("--sequence-parallel needs the GPT layout: blocks = [Embed, Block..., Head(ln, out)]")


def gpt_tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict:
    """The Megatron plan for the GPT layout: q, k, v, mlp.fc split by column, attn.proj, mlp.proj by row.

    So each block needs one all-reduce forward and one backward per sub-layer.

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
    """Split the GPT's Linear layers over a 1-D `mesh` in place (parameters become DTensors)."""
    check_tp(model, mesh.size(), sequence_parallel=sequence_parallel)
    return parallelize_module(model, mesh, gpt_tp_plan(model, sequence_parallel=sequence_parallel))


# --- the whole model again, and evaluation ----------------------------------------------------------------------


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict gathered whole from its DTensor shards, on rank 0 in CPU memory.

    {} on the others. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@torch.no_grad()
def evaluate_sharded(model: nn.Module, loader, *, loss_fn, device: torch.device, forward) -> dict[str, float]:
    """core.steps.evaluate for a model whose every forward is a collective (fully_shard, tensor parallel).

    Every rank runs as many forwards, a rank whose share ran out repeating its last batch uncounted
    (core.stream.in_step), so unequal shares end without a hang and each sample counts once. `forward`:
    core.exact_loss.forward_exact."""
    if loader is None:
        return {}
    was_training, tally = model.training, Tally(device)
    model.eval()
    for batch, counted in in_step(loader, device=device):
        metrics = forward(model, to_device(batch, device), loss_fn)[1]
        if counted:
            tally.add(metrics)
    model.train(was_training)
    if hasattr(model, "reshard"):  # fully_shard keeps the root gathered after a forward with no backward: free it
        model.reshard()
    return summarize(tally.reduce(), prefix="val_")

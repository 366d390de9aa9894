"""Sequence parallelism (tensor_parallel --sequence-parallel): the GPT's TP plan, its LayerNorms on sequence shards."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard, parallel

from core.kernel.job import RecipeError
from core.tp_plan import gpt_tp_plan


def sp_plan(model: nn.Module, plan: dict, *, enabled: bool) -> dict:
    """plan_of's GPT plan, extended in place: the residual stream split along the sequence between sub-layers."""
    if not enabled:
        return plan
    head = f"blocks.{len(getattr(model, 'blocks', [])) - 1}"  # the GPT's last block: its LayerNorm, then the logits
    if {f"{head}.ln", f"{head}.out"} - dict(model.named_modules()).keys() or plan.keys() != gpt_tp_plan(model).keys():
        why = "only the built-in GPT's plan splits the sequence (model.blocks = [Embed, Block..., head (ln, out)])"
        raise RecipeError(f"--sequence-parallel: {why}; drop --sequence-parallel")
    gather = parallel.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in dict.fromkeys(name.rsplit(".", 2)[0] for name in plan):  # blocks.I, each block the plan splits
        plan |= {f"{block}.{n}": parallel.RowwiseParallel(output_layouts=Shard(1)) for n in ("attn.proj", "mlp.proj")}
        plan |= {f"{block}.{name}": gather for name in ("attn", "mlp")}  # whole again for the column-split layers
        plan |= {f"{block}.{name}": parallel.SequenceParallel() for name in ("ln1", "ln2")}
    # the embedding's output split by sequence, the head's LayerNorm on it, the logits whole
    plan["blocks.0"] = parallel.PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    plan[f"{head}.ln"] = parallel.SequenceParallel()
    plan[f"{head}.out"] = parallel.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan

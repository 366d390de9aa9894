"""The TP split (tensor_parallel, fsdp_tp): which Linear layers split by output column and which by input row.

The built-in GPT's plan is Megatron's: attn.q/k/v and mlp.fc by column (each rank its own heads and hidden units),
attn.proj and mlp.proj by row (partial sums, all-reduced). A model's own plan (a transformers Llama's
config.base_model_tp_plan) comes from the model_plans plug-in, at the seams TP_PLANS and AROUND_TP.

    check_tp_plan(meta_model, tp=tp)                  # before any process starts: tp splits every layer whole
    plan = plan_of(model, tp=tp)
    with tp_kept(model, plan, tp=tp):
        parallelize_module(model, tp_mesh, plan)      # DTensor slices in place
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from core.kernel.options import RecipeError

GPT_LAYOUT = (
    "the built-in GPT's layout (model.blocks, an nn.Sequential run as model.blocks(x), whose blocks have "
    "attn.q/k/v/proj and mlp.fc/proj nn.Linear layers)"
)

TP_PLANS: list = []  # fn(model, *, tp) -> a model's own tensor-parallel plan or None; core/tp_plan.py asks each in turn
AROUND_TP: list = []  # fn(model, plan, *, tp) -> a context manager around core/tp_plan.py's parallelize_module


def check_tp(model: nn.Module, tp: int, *, sequence_parallel: bool = False) -> None:
    """One RecipeError line unless the model has the GPT's layout and every block splits into `tp` whole heads and
    equal MLP shards (attributes and shapes only: a meta-device model will do)."""
    blocks = [b for b in getattr(model, "blocks", []) if hasattr(b, "attn") and hasattr(b, "mlp")]
    linear = [getattr(b.attn, n, None) for b in blocks for n in ("q", "k", "v", "proj")]
    linear += [getattr(b.mlp, n, None) for b in blocks for n in ("fc", "proj")]  # GPT-2's are c_fc, c_proj
    heads_known = all(hasattr(b.attn, "head_dim") for b in blocks)
    if not blocks or not heads_known or not all(isinstance(m, nn.Linear) for m in linear):
        raise RecipeError(
            f"--model {type(model).__name__}: tensor parallelism needs a plan: a transformers model's "
            f"config.base_model_tp_plan (a copy reads it when made `--with model_plans`), or {GPT_LAYOUT}; this model "
            f"has neither; use fsdp for this model"
        )
    for block in blocks:
        heads = block.attn.q.out_features // block.attn.head_dim
        if heads % tp or block.mlp.fc.out_features % tp:
            raise RecipeError(
                f"tensor parallel size {tp} must divide the {heads} attention heads and the "
                f"{block.mlp.fc.out_features} MLP units; use a tp size that divides both"
            )
    if sequence_parallel and not (hasattr(model.blocks[-1], "ln") and hasattr(model.blocks[-1], "out")):
        raise RecipeError("--sequence-parallel needs the GPT layout: blocks = [Embed, Block..., Head(ln, out)]")


def gpt_tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict:
    """The GPT's plan, one all-reduce per sub-layer forward and one backward; sequence_parallel: the residual stream
    between sub-layers stays split along the sequence (a reduce-scatter and an all-gather instead)."""
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


def own_plan(model: nn.Module, *, tp: int) -> dict | None:
    """The plan the model declares itself (model_plans), refused in one line when tp does not split it; else None."""
    return next((plan for find in TP_PLANS if (plan := find(model, tp=tp)) is not None), None)


def check_tp_plan(model: nn.Module, *, tp: int, sequence_parallel: bool = False) -> None:
    """One RecipeError line unless the model's own plan, else the GPT's, splits it into `tp` whole shards."""
    if own_plan(model, tp=tp) is None:
        check_tp(model, tp, sequence_parallel=sequence_parallel)
    elif sequence_parallel:
        raise RecipeError(
            f"--sequence-parallel: only the built-in GPT's plan splits the sequence; {type(model).__name__} splits "
            f"by its own plan: drop --sequence-parallel"
        )


def plan_of(model: nn.Module, *, tp: int = 1, sequence_parallel: bool = False) -> dict:
    """{module name: ParallelStyle}: the model's own plan, else the GPT's."""
    return own_plan(model, tp=tp) or gpt_tp_plan(model, sequence_parallel=sequence_parallel)


@contextlib.contextmanager
def tp_kept(model: nn.Module, plan: dict, *, tp: int):
    """Around parallelize_module: what the plug-ins keep across it (model_plans: tied weights, head counts)."""
    with contextlib.ExitStack() as stack:
        for around in AROUND_TP:
            stack.enter_context(around(model, plan, tp=tp))
        yield

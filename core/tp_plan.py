"""The TP split (tensor_parallel, fsdp_tp): which Linear layers split by output column and which by input row."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import parallel

from core.kernel.job import RecipeError

# The model_plans plug-in's: fn(model, *, tp) -> a model's own tensor-parallel plan (its last entry, "", keeps the
# model's tied weights and stored head counts right once every layer is split), or None.
TP_PLANS: list = []


def plan_of(model: nn.Module, *, tp: int) -> dict:
    """{module name: ParallelStyle}: the model's own plan, else the GPT's, or one error line if tp cannot split it."""
    if own := next(filter(None, (find(model, tp=tp) for find in TP_PLANS)), None):  # model_plans: a model's own
        return own
    blocks = [b for b in getattr(model, "blocks", []) if hasattr(b, "attn") and hasattr(b, "mlp")]
    layers = dict(model.named_modules(remove_duplicate=False))  # by name, as the plan names them
    # every layer the GPT's plan splits is an nn.Linear there (GPT-2's are c_fc, c_proj: missing)
    gpt_like = bool(blocks) and all(isinstance(layers.get(name), nn.Linear) for name in gpt_tp_plan(model))
    if not gpt_like or not all(hasattr(b.attn, "head_dim") for b in blocks):
        own = "a transformers model's config.base_model_tp_plan (a copy made `--with model_plans`)"
        gpt = "the built-in GPT's layout (model.blocks with attn.q/k/v/proj and mlp.fc/proj nn.Linear layers)"
        needs = f"--model {type(model).__name__}: tensor parallelism needs a plan: {own}, or {gpt}"
        raise RecipeError(f"{needs}; this model has neither; use fsdp for this model")
    for heads, units in ((b.attn.q.out_features // b.attn.head_dim, b.mlp.fc.out_features) for b in blocks):
        if heads % tp or units % tp:
            why = f"must divide the {heads} attention heads and the {units} MLP units"
            raise RecipeError(f"tensor parallel size {tp} {why}; use a tp size that divides both")
    return gpt_tp_plan(model)


def gpt_tp_plan(model: nn.Module) -> dict:
    """Megatron's plan for the GPT: q/k/v and fc by column, proj by row (core/sp_plan.py adds sequence parallelism)."""
    plan = {}
    for i in [i for i, block in enumerate(model.blocks) if hasattr(block, "attn") and hasattr(block, "mlp")]:
        plan |= {f"blocks.{i}.{n}": parallel.ColwiseParallel() for n in ("attn.q", "attn.k", "attn.v", "mlp.fc")}
        plan |= {f"blocks.{i}.{n}": parallel.RowwiseParallel() for n in ("attn.proj", "mlp.proj")}  # then whole
    return plan

"""Plug-in `model_plans`: a transformers model's own tensor-parallel plan, checked, applied with its ties kept."""

from __future__ import annotations

import math
import re

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from core.kernel.job import RecipeError
from core.tp_plan import TP_PLANS

# transformers' style strings (transformers/distributed/tensor_parallel.py, ALL_PARALLEL_STYLES) as torch styles.
# None: every rank keeps the whole parameter, nothing to shard.
STYLES = {
    "colwise": lambda: ColwiseParallel(),  # output features split, each rank keeps its slice (its heads)
    "rowwise": lambda: RowwiseParallel(),  # input split, partial sums all-reduced to the whole output
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),  # the slices all-gathered
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),  # transformers' alias of the above
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),  # a whole input, sliced locally
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),  # transformers' alias of the above
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocab split; token ids are whole
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),  # embedding dim split, gathered
    "replicate": None,
}
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads")  # attention attributes some forwards use


def _declared(model: nn.Module) -> dict[str, str]:
    """The plan's rules as the model declares them, keys with `*` for a layer number, under the model's own names."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    base, under = (base, f"{prefix}.") if isinstance(base, nn.Module) else (model, "")  # LlamaModel: no prefix
    config_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    rules = {f"{under}{key}": style for key, style in config_plan.items()}
    rules.update(getattr(type(model), "_tp_plan", None) or {})  # the class's: lm_head (the instance's is merged)
    if rules and isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        # transformers' own rule (DistributedMixin.init_parallel_plans): the input embeddings split on the vocabulary
        rules.setdefault(f"{under}embed_tokens", "embedding_rowwise")
    return rules


def _generic(name: str) -> str:
    """A module name with its layer numbers as `*` (transformers' replace_layer_number_by_wildcard)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: f".*{m.group(1)}", name)


def model_tp_plan(model: nn.Module) -> dict[str, ParallelStyle] | None:
    """A transformers model's own plan as {module name: ParallelStyle}, or None; what torch cannot split: a line."""
    rules = _declared(model)
    if not rules:
        return None
    what = type(model).__name__
    params = {_generic(n) for n, _ in model.named_parameters()}
    for rule, style in rules.items():
        if style not in STYLES:
            supported = ", ".join(STYLES)
            raise RecipeError(
                f"--model {what}: its tensor-parallel plan splits {rule} as '{style}', which has no torch "
                f"ParallelStyle here (supported: {supported}); use fsdp for this model"
            )
        if rule in params:
            raise RecipeError(
                f"--model {what}: its tensor-parallel plan splits the parameter {rule} ('{style}'); torch's "
                f"ParallelStyles split whole nn.Linear / nn.Embedding modules; use fsdp for this model"
            )
    plan = {}
    for name, module in model.named_modules():
        style = rules.get(_generic(name))
        if style is None or STYLES[style] is None:
            continue
        if not isinstance(module, nn.Linear | nn.Embedding):
            raise RecipeError(
                f"--model {what}: its tensor-parallel plan splits {name} ('{style}'), a {type(module).__name__}; "
                f"torch's ColwiseParallel / RowwiseParallel split nn.Linear and nn.Embedding only; use fsdp for it"
            )
        plan[name] = STYLES[style]()
    return plan


def _split_dim(style: ParallelStyle, module: nn.Module) -> int:
    """The weight dimension the style splits: Linear weights are (out, in), Embedding weights (vocab, dim)."""
    colwise = isinstance(style, ColwiseParallel)
    return int(colwise) if isinstance(module, nn.Embedding) else int(not colwise)


def _head_dim(style: ParallelStyle, module: nn.Module, parent: nn.Module) -> int | None:
    """The head_dim of a Linear in an attention whose sharded side is local to each rank (whole heads), else None."""
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(style, ColwiseParallel | RowwiseParallel):  # the GPT's sequence-parallel styles split no heads
        return None
    local = style.output_layouts[0] if isinstance(style, ColwiseParallel) else style.input_layouts[0]
    if isinstance(module, nn.Linear) and isinstance(head_dim, int) and isinstance(local, Shard):
        return head_dim
    return None


def _shards(model: nn.Module, plan: dict[str, ParallelStyle]):
    """(name, what it counts, the count) that tp must divide, for each layer in the plan."""
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module, parent = modules[name], modules[name.rpartition(".")[0]]
        dim = _split_dim(style, module)
        size = module.weight.shape[dim]
        head_dim = _head_dim(style, module, parent)
        if head_dim and not size % head_dim:
            yield name, f"heads (head_dim {head_dim})", size // head_dim
        else:
            noun = ("output features", "input features") if isinstance(module, nn.Linear) else ("vocab rows", "dims")
            yield name, noun[dim], size


def _check_ties(model: nn.Module, plan: dict[str, ParallelStyle]) -> None:
    """A RecipeError unless the modules that share one weight (a tied lm_head and embedding) split it alike."""
    split = {name: _split_dim(style, m) for name, m in model.named_modules() if (style := plan.get(name))}
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "weight", None), nn.Parameter):
            owners.setdefault(id(module.weight), []).append(name)
    for names in owners.values():
        if len({split.get(n) for n in names}) > 1:
            how = ", ".join(f"{n} {'by dim ' + str(split[n]) if n in split else 'not at all'}" for n in names)
            raise RecipeError(
                f"--model {type(model).__name__}: {' and '.join(names)} share one weight, but its tensor-parallel "
                f"plan splits it differently ({how}); untie them (tie_word_embeddings=False) or use fsdp"
            )


def checked_plan(model: nn.Module, *, tp: int) -> dict[str, ParallelStyle] | None:
    """The model's own plan, once `tp` is known to split every layer in it into whole shards; None if it has none."""
    plan = model_tp_plan(model)
    if plan is None:
        return None
    shards = list(_shards(model, plan))
    common = math.gcd(*(count for *_, count in shards))
    fits = ", ".join(str(d) for d in range(1, common + 1) if not common % d)
    for name, noun, count in shards:
        if count % tp:
            raise RecipeError(
                f"--model {type(model).__name__}: tensor parallel size {tp} must divide the {count} {noun} of "
                f"{name}; use a tp size that splits every layer in its plan evenly: {fits}"
            )
    _check_ties(model, plan)
    return plan | {"": TiesAndHeadsKept(model, plan, tp=tp)}  # last: once every layer is split


def _localize_heads(model: nn.Module, plan: dict[str, ParallelStyle], tp: int) -> None:
    """Divide the head counts an attention stores by tp where its q/k/v outputs are local shards."""
    modules = dict(model.named_modules())
    parents = {name.rpartition(".")[0] for name, style in plan.items() if isinstance(style, ColwiseParallel)}
    for name in parents:  # q, k and v share one parent: each attention is divided once
        heads = [n for n, s in plan.items() if n.startswith(f"{name}.") and _head_dim(s, modules[n], modules[name])]
        if not heads:
            continue
        # transformers' Llama family reshapes with -1 heads (view(*shape, -1, head_dim)), which needs nothing;
        # an attention that views with self.num_heads (or num_key_value_heads) must see its rank's count
        for attr in HEAD_COUNTS:
            if isinstance(count := getattr(modules[name], attr, None), int) and not isinstance(count, bool):
                setattr(modules[name], attr, count // tp)


class TiesAndHeadsKept(ParallelStyle):
    """A plan's last entry, "" (the whole model, once parallelize_module split every layer): weights the model
    shares stay one parameter, and the head counts an attention stores become its rank's."""

    def __init__(self, model: nn.Module, plan: dict[str, ParallelStyle], *, tp: int):
        self.plan, self.tp, self.tied = plan, tp, {}  # each parameter's owners, seen before any is split
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                self.tied.setdefault(id(param), []).append((module, name))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # parallelize_module distributed each module's weight on its own: point every owner of a once-shared weight
        # at the first owner's sharded parameter again
        for (first, name), *others in self.tied.values():
            for owner, other in others:
                setattr(owner, other, getattr(first, name))
        _localize_heads(module, self.plan, self.tp)
        return module


TP_PLANS.append(checked_plan)

"""The loss contract: how a batch is passed to the model, what the model may return, which loss is taken.

What a sample means (the README's table): an `(input, target)` pair, or `(input, ..., target)`, carries a target
aligned with the model's output: the loss compares output[..., t] with target[..., t], called as `model(input, ...)`.
So a pair's target is never passed as `labels` (transformers would shift it once more): cross-entropy on the logits,
or the model's own loss when its forward takes `targets` and compares them unshifted (nanoGPT). A dict of tensors
follows transformers' convention: `model(**batch)`, the model shifts its `labels`, and its own loss is used.
Outputs: a tensor (logits); a tuple or list (logits first; `(logits, loss)`; `(loss, logits, ...)` as
transformers returns with return_dict=False); a dict or `ModelOutput` with `loss` and/or `logits`.
Targets equal to -100 count nowhere, as in cross_entropy and transformers. Each micro-batch's loss is its
mean; DDP averages the ranks' gradients (core.exact_loss weighs every target of the global batch alike).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from core.config import RecipeError
from core.factory import resolve_factory

IGNORE = -100  # the target value that counts nowhere, as in cross_entropy and transformers
LOSSES = ("auto", "ce", "mse", "model")
TARGETS = "targets"  # nanoGPT's forward(idx, targets=None): given a pair's target, unshifted; never `labels`


@dataclass(frozen=True)
class Loss:
    """`--loss`, resolved for one model: see make_loss."""

    spec: str = "auto"
    fn: Callable | None = None  # a module:function loss, called as fn(outputs, batch)
    targets_as: str | None = None  # the forward's parameter that takes a pair's target, when the model computes a loss
    labels_only: bool = False  # --loss model on a forward that takes `labels` alone: refused for pairs (call_model)


def make_loss(spec: str, *, model: nn.Module) -> Loss:
    """`--loss` for `model` (the plain one, not its wrapper).

    auto (the model's own loss when its forward takes the targets, else cross-entropy, or mse for float targets),
    ce, mse, model, or `module:function(outputs, batch)` returning the batch's mean loss. A choice that cannot work
    is one RecipeError line."""
    if spec not in LOSSES:
        return Loss(spec, resolve_factory(spec, dict.fromkeys(LOSSES), option="--loss"))
    params = [p for p in inspect.signature(model.forward).parameters.values() if p.kind != p.VAR_KEYWORD]
    named = TARGETS if any(p.name == TARGETS for p in params) else None
    if spec == "model" and not named and any(p.name == "labels" for p in params):  # transformers': it shifts
        return Loss(spec, labels_only=True)
    second = params[1].name if len(params) > 1 and params[1].kind != inspect.Parameter.VAR_POSITIONAL else None
    if spec == "model" and not (named or second):
        raise RecipeError(
            f"--loss model: {type(model).__name__}.forward{inspect.signature(model.forward)} takes no targets; "
            f"give it a `targets` parameter that makes it return a loss (as nanoGPT), or use --loss ce or mse"
        )
    return Loss(spec, targets_as=named or (second if spec == "model" else None))


def split_outputs(outputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits, loss) from what a model returned; either may be None."""
    if isinstance(outputs, torch.Tensor):
        return outputs, None
    if isinstance(outputs, Mapping):  # a dict, or a transformers ModelOutput (an OrderedDict)
        return outputs.get("logits"), outputs.get("loss")
    if isinstance(outputs, tuple | list) and outputs:
        first, second = outputs[0], outputs[1] if len(outputs) > 1 else None
        if second is not None and isinstance(first, torch.Tensor) and first.dim() == 0:
            return second, first  # (loss, logits, ...): transformers with return_dict=False
        return first, second if isinstance(second, torch.Tensor) and second.dim() == 0 else None
    raise RecipeError(
        f"the model returned {type(outputs).__name__}; return logits, (logits, loss), "
        f"or a dict/ModelOutput with loss and/or logits"
    )


def call_model(model: nn.Module, batch, loss: Loss, **extra):
    """(outputs, targets): model(**batch) for a dict; model(input, ...) for a tuple.

    A tuple's targets are passed where the model takes them for its own loss (`targets`, never `labels`). `extra`:
    more keyword arguments for the model (num_items_in_batch)."""
    if isinstance(batch, Mapping):
        return model(**batch, **extra), batch.get("labels")
    *inputs, targets = batch
    if loss.labels_only:
        raise RecipeError(
            f"--loss model: {type(model).__name__} takes its targets as `labels` and shifts them (transformers' "
            f"convention), while an (input, target) sample's target is aligned with the output; give dict samples "
            f"with `labels` (the model shifts them), or use --loss ce"
        )
    if loss.targets_as and loss.spec in ("auto", "model"):
        return model(*inputs, **{loss.targets_as: targets}, **extra), targets
    return model(*inputs), targets


def forward(model: nn.Module, batch, loss: Loss, *, shift: bool | None = None, **extra) -> tuple[torch.Tensor, dict]:
    """One micro-batch: (its mean loss, to backward; its metrics as sums: loss_sum, count, samples, correct).
    shift: the model's loss predicts target t+1 at position t (None: not known, so a dict batch's sequence
    logits get no accuracy); `extra` goes to the model."""
    outputs, targets = call_model(model, batch, loss, **extra)
    logits, own = split_outputs(outputs)
    if loss.fn is not None:
        mean = loss.fn(outputs, batch)
    elif own is not None and loss.spec in ("auto", "model"):
        mean = own
    elif loss.spec == "model":
        raise RecipeError(f"--loss model: the model returned {type(outputs).__name__} with no loss; use --loss ce")
    elif logits is None or targets is None:
        raise RecipeError(
            f"--loss {loss.spec}: the model returned {type(outputs).__name__} (no logits) or the batch has no "
            f"targets; return logits, or use --loss model or a module:function loss"
        )
    elif loss.spec == "mse" or (loss.spec == "auto" and targets.is_floating_point()):
        if logits.shape != targets.shape:
            kind = "float" if targets.is_floating_point() else str(targets.dtype).removeprefix("torch.")
            raise RecipeError(
                f"--loss {loss.spec}: {kind} targets {tuple(targets.shape)} and outputs {tuple(logits.shape)} differ "
                f"in shape: mse needs them equal; for class indices use int64 targets (--loss ce)"
            )
        mean = nn.functional.mse_loss(logits.float(), targets.float())
    else:
        check_aligned(logits, targets)
        mean = nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE)
    known = shift is not None or not isinstance(batch, Mapping) or (logits is not None and logits.dim() == 2)
    samples = len(next(t for t in (batch.values() if isinstance(batch, Mapping) else batch) if torch.is_tensor(t)))
    return mean, metrics(logits if known else None, targets, mean, samples=samples, shift=bool(shift))


def check_aligned(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """One RecipeError line when the logits (..., classes) do not give one prediction per target, as cross-entropy
    compares logits[..., t, :] with targets[..., t]: nanoGPT's inference path (logits[:, [-1], :] when it is given
    no targets) is named with its fix. The cause and the fix are one clause, as the pre-check quotes it."""
    if logits.shape[:-1].numel() == targets.numel():
        return
    if logits.dim() >= 3 and logits.shape[-2] == 1 and targets.dim() >= 2 and targets.shape[-1] > 1:
        raise RecipeError(
            f"the model returns logits for one position {tuple(logits.shape)} against targets of "
            f"{targets.shape[-1]} positions {tuple(targets.shape)} (nanoGPT's inference path, logits[:, [-1], :], "
            f"when it is given no targets): give the forward the targets (a `targets` parameter, as --loss auto "
            f"passes them) or return every position's logits"
        )
    raise RecipeError(
        f"the logits {tuple(logits.shape)} and the targets {tuple(targets.shape)} do not line up: cross-entropy "
        f"compares logits[..., t, :] with targets[..., t], so return logits of the targets' shape plus classes"
    )


def metrics(logits, targets, mean: torch.Tensor, *, samples: int, shift: bool = False) -> dict[str, torch.Tensor]:
    """Sums (not means) that add up over micro-batches and ranks: loss_sum, count, samples, correct.

    count: counted targets, or samples where there are none or they are floats; correct where the logits are class
    scores for the targets (after the causal-LM shift when `shift`)."""
    n = torch.tensor(float(samples), dtype=torch.float64, device=mean.device)
    count = n if targets is None or targets.is_floating_point() else targets.ne(IGNORE).sum().double()
    sums = {"loss_sum": mean.detach().double() * count, "count": count, "samples": n}
    if logits is not None and targets is not None and not targets.is_floating_point():
        logits, targets = (logits[..., :-1, :], targets[..., 1:]) if shift else (logits, targets)
        if logits.shape[:-1] == targets.shape:
            sums["correct"] = (logits.detach().argmax(-1).eq(targets) & targets.ne(IGNORE)).sum().double()
    return sums

"""`--loss` beyond core.loss's auto and ce, and the rarer models: an opt-in a recipe takes with one line after
core.loss.make_loss:

    loss_fn = make_loss(model=model)  # the base: the model's own loss, else cross-entropy
    loss_fn = loss_options.choose_loss(cfg.loss, loss_fn, model=model)  # --loss ce, mse, model, module:function

mse (and auto's float targets of the output's shape), model (the model's own loss, insisted on: a forward that
takes the targets by another name than `targets`, read from its signature), `module:function(outputs, batch)`
returning the mean loss, and the rarer output shape `(loss, logits, ...)` (transformers with return_dict=False).
What a sample means stays core.loss's: a pair's target is never handed to a forward as `labels`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from core.factory import resolve_factory
from core.kernel.job import RecipeError
from core.loss import TARGETS, Loss, cross_entropy, split_outputs

CHOICES = ("auto", "ce", "mse", "model")  # and module:function


def split_any(outputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """core.loss.split_outputs, and `(loss, logits, ...)`: a 0-dim loss first, as transformers returns it."""
    if isinstance(outputs, tuple | list) and len(outputs) > 1 and torch.is_tensor(outputs[0]) and outputs[0].dim() == 0:
        return outputs[1], outputs[0]
    return split_outputs(outputs)


@dataclass(frozen=True)
class ChosenLoss(Loss):
    """A --loss beyond core.loss's: `fn(outputs, targets, batch)` gives the micro-batch's mean loss; the logits are
    split_any's (a transformers `(loss, logits, ...)` tuple too)."""

    fn: Callable | None = None

    def logits_and_loss(self, outputs, targets, batch) -> tuple[torch.Tensor | None, torch.Tensor]:
        logits = split_any(outputs)[0]
        if self.fn is None:  # ce
            return logits, cross_entropy(logits, targets, spec=self.spec, labels=isinstance(batch, Mapping))
        return logits, self.fn(outputs, targets, batch)


def choose_loss(spec: str, loss: Loss, *, model: nn.Module) -> Loss:
    """`--loss spec` for `model` (the plain one), in place of core.loss.make_loss's `loss` (auto). A choice that cannot
    work is one RecipeError line."""
    if spec not in CHOICES:
        custom = resolve_factory(spec, dict.fromkeys(CHOICES), option="--loss")
        return ChosenLoss(spec, fn=functools.partial(_custom, custom))
    if spec == "ce":
        return ChosenLoss(spec)
    if spec == "auto":
        return ChosenLoss(spec, targets_as=loss.targets_as, shifts=loss.shifts, fn=_auto)
    if spec == "mse":
        return ChosenLoss(spec, fn=functools.partial(_mse, spec=spec))
    params = [p for p in inspect.signature(model.forward).parameters.values() if p.kind != p.VAR_KEYWORD]
    names = [p.name for p in params]
    if TARGETS not in names and "labels" in names:  # transformers': it shifts; a pair's target must not be shifted
        own = functools.partial(_own, name=type(model).__name__, labels_only=True)
        return ChosenLoss(spec, shifts=loss.shifts, fn=own)
    second = params[1].name if len(params) > 1 and params[1].kind != inspect.Parameter.VAR_POSITIONAL else None
    if TARGETS not in names and not second:
        raise RecipeError(
            f"--loss model: {type(model).__name__}.forward{inspect.signature(model.forward)} takes no targets; "
            f"give it a `targets` parameter that makes it return a loss (as nanoGPT), or use --loss ce or mse"
        )
    return ChosenLoss(spec, targets_as=TARGETS if TARGETS in names else second, shifts=loss.shifts, fn=_own)


def _custom(custom: Callable, outputs, targets, batch) -> torch.Tensor:
    return custom(outputs, batch)


def _auto(outputs, targets, batch) -> torch.Tensor:
    """auto: the model's own loss (a dict with labels, a `targets` forward), mse for float targets, else ce."""
    logits, own = split_any(outputs)
    if own is not None:
        return own
    if targets is not None and targets.is_floating_point() and logits is not None:
        return _mse(outputs, targets, batch, spec="auto")
    if logits is None or targets is None:
        raise RecipeError(
            f"--loss auto: the model returned {type(outputs).__name__} (no logits) or the batch has no "
            f"targets; return logits, or use --loss model or a module:function loss"
        )
    return cross_entropy(logits, targets, spec="auto", labels=isinstance(batch, Mapping))


def _mse(outputs, targets, batch, *, spec: str) -> torch.Tensor:
    logits, _ = split_any(outputs)
    if logits is None or targets is None or logits.shape != targets.shape:
        shape = lambda t: tuple(t.shape) if t is not None else ()  # noqa: E731
        kind = (
            "no"
            if targets is None
            else "float"
            if targets.is_floating_point()
            else str(targets.dtype).removeprefix("torch.")
        )
        raise RecipeError(
            f"--loss {spec}: {kind} targets {shape(targets)} and outputs {shape(logits)} differ in shape: mse needs "
            f"them equal; for class indices use int64 targets (--loss ce)"
        )
    return nn.functional.mse_loss(logits.float(), targets.float())


def _own(outputs, targets, batch, *, name: str = "", labels_only: bool = False) -> torch.Tensor:
    """--loss model: the model's own loss, refused in one line where there is none."""
    if labels_only and not isinstance(batch, Mapping):
        raise RecipeError(
            f"--loss model: {name} takes its targets as `labels` and shifts them (transformers' convention), while "
            f"an (input, target) sample's target is aligned with the output: give dict samples with `labels` (the "
            f"model shifts them), or use --loss ce"
        )
    _, own = split_any(outputs)
    if own is None:
        raise RecipeError(f"--loss model: the model returned {type(outputs).__name__} with no loss; use --loss ce")
    return own

"""Plug-in `loss`: --loss auto, ce, mse, model or module:function, and the rarer models: a forward that takes its
targets (`targets`, nanoGPT's, or another name read from its signature), a transformers `(loss, logits, ...)` tuple
(return_dict=False), and one line naming logits that do not line up with the targets.

What a sample means stays the kernel's: a pair's target is never handed to a forward as `labels`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from core.kernel.job import Options, RecipeError, option
from core.kernel.loss import Loss, split_outputs
from core.kernel.seams import SEAMS
from core.kernel.train import IGNORE

CHOICES = ("auto", "ce", "mse", "model")  # and module:function
TARGETS = "targets"  # nanoGPT's forward(idx, targets=None): given a pair's target, unshifted; never `labels`


@dataclass(frozen=True)
class LossOption(Options):
    """training"""

    loss: str = option("auto", "auto (the model's own loss, else ce or mse), ce, mse, model, or module:function")


@dataclass(frozen=True)
class ChosenLoss(Loss):
    """A --loss: `fn(outputs, targets, batch)` gives the micro-batch's mean loss (None: cross-entropy); a pair's target
    goes to the forward as `targets_as` where the model computes its own loss from it."""

    spec: str = "auto"
    targets_as: str | None = None
    fn: Callable | None = None

    def call(self, model: nn.Module, batch) -> tuple:
        if isinstance(batch, Mapping) or not self.targets_as:
            return super().call(model, batch)
        *inputs, targets = batch
        return model(*inputs, **{self.targets_as: targets}), targets

    def logits_and_loss(self, outputs, targets, batch) -> tuple[torch.Tensor | None, torch.Tensor]:
        logits = split_any(outputs)[0]
        if self.fn is None:  # ce
            return logits, cross_entropy(logits, targets, spec=self.spec, labels=isinstance(batch, Mapping))
        return logits, self.fn(outputs, targets, batch)


def choose(cfg, model: nn.Module, loss: Loss) -> Loss:
    """--loss for the plain `model`, in place of the kernel's (the model's own loss, else cross-entropy)."""
    targets_as = TARGETS if TARGETS in inspect.signature(model.forward).parameters else None
    return choose_loss(cfg.loss, ChosenLoss(shifts=loss.shifts, targets_as=targets_as), model=model)


def split_any(outputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The kernel's split_outputs, and `(loss, logits, ...)`: a 0-dim loss first, as transformers returns it."""
    if isinstance(outputs, tuple | list) and len(outputs) > 1 and torch.is_tensor(outputs[0]) and outputs[0].dim() == 0:
        return outputs[1], outputs[0]
    return split_outputs(outputs)


def choose_loss(spec: str, loss: ChosenLoss, *, model: nn.Module) -> Loss:
    """`--loss spec` for `model` (the plain one), in place of make_loss's `loss` (auto). A choice that cannot
    work is one RecipeError line."""
    if spec not in CHOICES:
        custom = resolve_loss(spec)
        return ChosenLoss(spec=spec, fn=functools.partial(_custom, custom))
    if spec == "ce":
        return ChosenLoss(spec=spec)
    if spec == "auto":
        return ChosenLoss(spec=spec, targets_as=loss.targets_as, shifts=loss.shifts, fn=_auto)
    if spec == "mse":
        return ChosenLoss(spec=spec, fn=functools.partial(_mse, spec=spec))
    params = [p for p in inspect.signature(model.forward).parameters.values() if p.kind != p.VAR_KEYWORD]
    names = [p.name for p in params]
    if TARGETS not in names and "labels" in names:  # transformers': it shifts; a pair's target must not be shifted
        own = functools.partial(_own, name=type(model).__name__, labels_only=True)
        return ChosenLoss(spec=spec, shifts=loss.shifts, fn=own)
    second = params[1].name if len(params) > 1 and params[1].kind != inspect.Parameter.VAR_POSITIONAL else None
    if TARGETS not in names and not second:
        raise RecipeError(
            f"--loss model: {type(model).__name__}.forward{inspect.signature(model.forward)} takes no targets; "
            f"give it a `targets` parameter that makes it return a loss (as nanoGPT), or use --loss ce or mse"
        )
    return ChosenLoss(spec=spec, targets_as=TARGETS if TARGETS in names else second, shifts=loss.shifts, fn=_own)


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


def cross_entropy(logits, targets, *, spec: str, labels: bool = False) -> torch.Tensor:
    """Mean cross-entropy of logits[..., t, :] against targets[..., t] over the counted targets (not -100).
    labels: the targets are a dict sample's `labels`, which only the model knows whether to shift."""
    if logits is None or targets is None or targets.is_floating_point():
        raise RecipeError(f"--loss {spec}: cross-entropy needs logits and int64 targets; use --loss model or mse ")
    if labels and logits.dim() > 2:  # a causal LM compares logits[t] with labels[t + 1]: this would not
        own = "return the loss the model computes from them" + (" (--loss auto)" if spec != "auto" else "")
        raise RecipeError(
            f"--loss {spec} on a dict's `labels`, which a causal LM shifts: {own}, or give (input, target) samples"
        )
    check_aligned(logits, targets)  # the lines a copy without `--with loss` leaves to torch's own shape error
    return nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE)


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


def resolve_loss(spec: str) -> Callable:
    """--loss module:function: that function, imported (one RecipeError line when it is not there)."""
    module_name, _, name = spec.partition(":")
    if not name:
        raise RecipeError(f"--loss {spec}: not a built-in ({', '.join(CHOICES)}) and not a module:function factory")
    try:
        found = getattr(importlib.import_module(module_name), name, None)
    except Exception as err:  # an ImportError, or any error raised while the module runs
        raise RecipeError(
            f"--loss {spec}: cannot import {module_name!r} ({type(err).__name__}: {err}); is it installed or on "
            f"PYTHONPATH?"
        ) from None
    if not callable(found):
        raise RecipeError(f"--loss {spec}: module {module_name!r} has no function {name!r}")
    return found


SEAMS["option_groups"].append(LossOption)
SEAMS["loss_choices"].append(choose)
SEAMS["loss_checks"].append(check_aligned)  # the pipeline's loss on its last stage (core/schedules.py) checks alike

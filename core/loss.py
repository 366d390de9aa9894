"""The loss contract: how a batch is passed to the model, what the model may return, which loss is taken.

What a sample means (the README's table): an `(input, target)` pair, or `(input, ..., target)`, carries a target
aligned with the model's output: the loss compares output[..., t] with target[..., t], called as `model(input, ...)`.
So a pair's target is never passed as `labels` (transformers would shift it once more): cross-entropy on the logits,
or the model's own loss when its forward takes `targets` and compares them unshifted (nanoGPT). A dict of tensors
follows transformers' convention: `model(**batch)`, the model shifts its `labels`, and its own loss is used.
Outputs: a tensor (logits); a tuple or list (logits first, or `(logits, loss)`); a dict or `ModelOutput` with
`loss` and/or `logits`. Targets equal to -100 count nowhere, as in cross_entropy and transformers. Each
micro-batch's loss is its mean; DDP averages the ranks' gradients (core.exact_loss weighs every target of the
global batch alike). `--loss` beyond auto and ce, the rarer forwards and outputs: core.loss_options (opt-in).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from core.kernel.job import RecipeError
from core.plugins import loss_counts  # noqa: F401 - the recipes not on the kernel yet: num_items_in_batch as before

IGNORE = -100  # the target value that counts nowhere, as in cross_entropy and transformers
TARGETS = "targets"  # nanoGPT's forward(idx, targets=None): given a pair's target, unshifted; never `labels`


def split_outputs(outputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits, loss) from what a model returned; either may be None."""
    if isinstance(outputs, torch.Tensor):
        return outputs, None
    if isinstance(outputs, Mapping):  # a dict, or a transformers ModelOutput (an OrderedDict)
        return outputs.get("logits"), outputs.get("loss")
    if isinstance(outputs, tuple | list) and outputs:  # (logits, ...), (logits, loss): a loss is 0-dim
        loss = outputs[1] if len(outputs) > 1 and torch.is_tensor(outputs[1]) and outputs[1].dim() == 0 else None
        return outputs[0], loss
    raise RecipeError(f"the model returned {type(outputs).__name__}; return logits, (logits, loss) or a dict of them")


@dataclass(frozen=True)
class Loss:
    """`--loss`, resolved for one model: make_loss's auto, Loss("ce"), or core.loss_options' other choices."""

    spec: str = "auto"
    targets_as: str | None = None  # the forward's parameter that takes a pair's target, when the model computes a loss
    shifts: bool = False  # its own loss on a dict's labels compares logits[t] with labels[t + 1] (a causal LM)

    def logits_and_loss(self, outputs, targets, batch) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the logits, the micro-batch's mean loss): auto takes the model's own loss where it computed one (a dict
        with labels, a `targets` forward), else cross-entropy on the logits; Loss("ce") always cross-entropy."""
        logits, mean = split_outputs(outputs)
        if mean is None or self.spec != "auto":
            mean = cross_entropy(logits, targets, spec=self.spec, labels=isinstance(batch, Mapping))
        return logits, mean

    def call(self, model: nn.Module, batch) -> tuple:
        """(outputs, targets) as call_model gives them: how core/exact_loss.py (on the kernel) calls the model for the
        recipes not on the kernel yet."""
        return call_model(model, batch, self)


def make_loss(*, model: nn.Module) -> Loss:
    """--loss auto: the model's own loss where it computes one (a dict with labels; a forward that takes `targets`,
    given a pair's target), else cross-entropy on the logits. `model`: the plain one, not its wrapper.
    Loss("ce") is cross-entropy on the logits of model(input, ...); the other --loss choices are core.loss_options'."""
    targets_as = TARGETS if TARGETS in inspect.signature(model.forward).parameters else None
    return Loss(targets_as=targets_as, shifts=shifts_labels(model))


def shifts_labels(model: nn.Module) -> bool:
    """Whether the model is a transformers causal LM (a decoder that generates), whose own loss compares logits[t]
    with labels[t + 1]: a dict's labels count and score after that shift. Read only where transformers is imported."""
    transformers = sys.modules.get("transformers")  # a torch-only run never imports it
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return False
    return model.can_generate() and not model.config.is_encoder_decoder


def call_model(model: nn.Module, batch, loss: Loss, **extra):
    """(outputs, targets): model(**batch) for a dict; model(input, ...) for a tuple, with its target where the forward
    takes it for its own loss (`targets`, never `labels`). `extra`: more keyword arguments (num_items_in_batch)."""
    if isinstance(batch, Mapping):
        return model(**batch, **extra), batch.get("labels")
    *inputs, targets = batch
    if loss.targets_as:
        return model(*inputs, **{loss.targets_as: targets}, **extra), targets
    return model(*inputs), targets


def forward(model: nn.Module, batch, loss: Loss, *, shift: bool | None = None, **extra) -> tuple[torch.Tensor, dict]:
    """One micro-batch: (its mean loss, to backward; its metrics as sums: loss_sum, count, samples, correct).
    shift: the model's loss predicts target t+1 at position t (None: not known, so a dict batch's sequence
    logits get no accuracy); `extra` goes to the model."""
    outputs, targets = call_model(model, batch, loss, **extra)
    logits, mean = loss.logits_and_loss(outputs, targets, batch)
    shift = True if loss.shifts and isinstance(batch, Mapping) else shift  # a causal LM's own loss on its labels
    known = shift is not None or not isinstance(batch, Mapping) or (logits is not None and logits.dim() == 2)
    samples = len(next(t for t in (batch.values() if isinstance(batch, Mapping) else batch) if torch.is_tensor(t)))
    return mean, metrics(logits if known else None, targets, mean, samples=samples, shift=bool(shift))


def cross_entropy(logits, targets, *, spec: str, labels: bool = False) -> torch.Tensor:
    """Mean cross-entropy of logits[..., t, :] against targets[..., t] over the counted targets (not -100).
    labels: the targets are a dict sample's `labels`, which only the model knows whether to shift."""
    if logits is None or targets is None or targets.is_floating_point():
        raise RecipeError(
            f"--loss {spec}: cross-entropy needs logits and int64 targets; use --loss model or mse (a standalone "
            f"copy: made `--with loss`)"
        )
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


def metrics(logits, targets, mean: torch.Tensor, *, samples: int, shift: bool = False) -> dict[str, torch.Tensor]:
    """Sums (not means) that add up over micro-batches and ranks: loss_sum, count, samples, correct.

    count: counted targets, or samples where there are none or they are floats; correct where the logits are class
    scores for the targets (after the causal-LM shift when `shift`)."""
    n = torch.tensor(float(samples), dtype=torch.float64, device=mean.device)
    if shift and targets is not None:  # the loss compared logits[t] with targets[t + 1]: so are they counted, scored
        logits, targets = logits if logits is None else logits[..., :-1, :], targets[..., 1:]
    count = n if targets is None or targets.is_floating_point() else targets.ne(IGNORE).sum().double()
    loss_sum = torch.where(count > 0, mean.detach().double() * count, 0.0)  # no target counted: nan * 0, so 0
    sums = {"loss_sum": loss_sum, "count": count, "samples": n}
    if logits is not None and targets is not None and not targets.is_floating_point():
        if logits.shape[:-1] == targets.shape:
            sums["correct"] = (logits.detach().argmax(-1).eq(targets) & targets.ne(IGNORE)).sum().double()
    return sums

"""The step: a batch through the model and its loss, one optimizer step, and the evaluation (docs/recipes.md#loss)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from core.kernel.loader import to_device
from core.kernel.numbers import Tally, summarize
from core.kernel.options import RecipeError
from core.kernel.seams import LOSS_CHOICES

IGNORE = -100  # the target value that counts nowhere, as in cross_entropy and transformers


def step_plain(model: nn.Module, batch, *, optimizer: torch.optim.Optimizer, loss_fn: Loss) -> tuple[dict, float]:
    """Forward, backward (DDP all-reduces the gradients there), and a step unless the gradient norm is not finite."""
    optimizer.zero_grad(set_to_none=True)
    loss, sums = forward(model, batch, loss_fn)
    loss.backward()
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = float(torch.nn.utils.get_total_norm(grads))  # the step's one host sync; every rank reads the same
    if math.isfinite(norm):
        optimizer.step()
    return sums, norm


def check_finite(grad_norm: float, *, step: int, on_nonfinite: str) -> int:
    """1 for a step skipped for its non-finite gradient norm (--on-nonfinite skip); with stop, one line."""
    if not math.isfinite(grad_norm) and on_nonfinite == "stop":  # every rank read the same all-reduced norm: all stop
        fix = "lower --lr, or pass --on-nonfinite skip"
        raise RecipeError(f"step {step}: the loss or the gradients are not finite (gradient norm {grad_norm}); {fix}")
    return int(not math.isfinite(grad_norm))


@torch.no_grad()
def evaluate(model: nn.Module, loader, *, loss_fn: Loss, device: torch.device) -> dict[str, float]:
    """val_loss and val_acc over every rank's share of the validation set ({} without one)."""
    if loader is None:
        return {}
    was_training, tally = model.training, Tally(device)
    model.eval()
    for batch in loader:
        tally.add(forward(model, to_device(batch, device), loss_fn)[1])
    model.train(was_training)
    return summarize(tally.reduce(), prefix="val_")


def split_outputs(outputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits, loss) of logits, a tuple (logits first, or `(logits, loss)`), a dict or a ModelOutput."""
    if isinstance(outputs, torch.Tensor):
        return outputs, None
    if isinstance(outputs, Mapping):  # a transformers ModelOutput is an OrderedDict
        return outputs.get("logits"), outputs.get("loss")
    if isinstance(outputs, tuple | list) and outputs:  # a loss is 0-dim
        loss = outputs[1] if len(outputs) > 1 and torch.is_tensor(outputs[1]) and outputs[1].dim() == 0 else None
        return outputs[0], loss
    raise RecipeError(f"the model returned {type(outputs).__name__}; return logits, (logits, loss) or a dict of them")


@dataclass(frozen=True)
class Loss:
    """The model's own loss where it computed one, else cross-entropy of its logits and the targets."""

    shifts: bool = False  # a causal LM: its own loss on a dict's labels compares logits[t] with labels[t + 1]

    def call(self, model: nn.Module, batch) -> tuple:
        """(outputs, targets): model(**batch) for a dict (its labels), model(*inputs) for a tuple (its last)."""
        if isinstance(batch, Mapping):
            return model(**batch), batch.get("labels")
        *inputs, targets = batch
        return model(*inputs), targets

    def logits_and_loss(self, outputs, targets, batch) -> tuple[torch.Tensor | None, torch.Tensor]:
        logits, mean = split_outputs(outputs)
        if mean is None:
            mean = nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE)
        return logits, mean


def make_loss(cfg, model: nn.Module) -> Loss:
    """The plain `model`'s loss (or --loss's); a transformers decoder that generates shifts its labels."""
    loss = Loss(shifts=getattr(model, "can_generate", bool)() and not model.config.is_encoder_decoder)
    for choose in LOSS_CHOICES:
        loss = choose(cfg, model, loss)
    return loss


def forward(model: nn.Module, batch, loss_fn: Loss) -> tuple[torch.Tensor, dict]:
    """One micro-batch: its mean loss (to backward) and its metrics as sums."""
    outputs, targets = loss_fn.call(model, batch)
    logits, mean = loss_fn.logits_and_loss(outputs, targets, batch)
    shift = loss_fn.shifts and isinstance(batch, Mapping)
    known = shift or not isinstance(batch, Mapping) or (logits is not None and logits.dim() == 2)  # else no accuracy
    samples = len(next(t for t in (batch.values() if isinstance(batch, Mapping) else batch) if torch.is_tensor(t)))
    return mean, metrics(logits if known else None, targets, mean, samples=samples, shift=shift)


def metrics(logits, targets, mean: torch.Tensor, *, samples: int, shift: bool) -> dict[str, torch.Tensor]:
    """loss_sum, count (counted targets, else samples), samples, and correct where the logits score the targets."""
    n = torch.tensor(float(samples), dtype=torch.float64, device=mean.device)
    if shift and targets is not None:  # scored as the loss compared them: logits[t] with targets[t + 1]
        logits, targets = logits if logits is None else logits[..., :-1, :], targets[..., 1:]
    count = n if targets is None or targets.is_floating_point() else targets.ne(IGNORE).sum().double()
    sums = {"loss_sum": torch.where(count > 0, mean.detach().double() * count, 0.0), "count": count, "samples": n}
    if logits is not None and targets is not None and not targets.is_floating_point():
        if logits.shape[:-1] == targets.shape:
            sums["correct"] = (logits.detach().argmax(-1).eq(targets) & targets.ne(IGNORE)).sum().double()
    return sums

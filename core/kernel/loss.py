"""The model's outputs and its loss (its own, else cross-entropy of its logits); one micro-batch's metric sums."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from core.kernel.job import RecipeError
from core.kernel.seams import SEAMS
from core.kernel.train import IGNORE, metrics


def split_outputs(outputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits, loss) of logits, a tuple (logits first, or `(logits, loss)`), a dict or a ModelOutput."""
    if isinstance(outputs, Mapping):  # a transformers ModelOutput is an OrderedDict
        return outputs.get("logits"), outputs.get("loss")
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs  # logits alone
    if isinstance(outputs, tuple | list) and outputs:  # a loss is 0-dim
        return outputs[0], next((o for o in outputs[1:2] if torch.is_tensor(o) and o.dim() == 0), None)
    raise RecipeError(f"the model returned {type(outputs).__name__}; return logits, (logits, loss) or a dict of them")


@dataclass(frozen=True)
class Loss:
    """The model's own loss where it computed one, else cross-entropy of its logits and the targets."""

    shifts: bool = False  # a causal LM: its own loss on a dict's labels compares logits[t] with labels[t + 1]

    def call(self, model: nn.Module, batch) -> tuple:
        """(outputs, targets): model(**batch) for a dict (its labels), model(*inputs) for a tuple (its last)."""
        if isinstance(batch, Mapping):
            return model(**batch), batch.get("labels")
        return model(*batch[:-1]), batch[-1]

    def logits_and_loss(self, outputs, targets, batch) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits, mean loss): the loss the model returned, else cross-entropy (the loss plug-in: --loss's)."""
        logits, mean = split_outputs(outputs)
        if mean is None:
            mean = nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE)
        return logits, mean


def make_loss(cfg, model: nn.Module) -> Loss:
    """The plain `model`'s loss (or --loss's); a transformers decoder that generates shifts its labels."""
    loss = Loss(shifts=getattr(model, "can_generate", bool)() and not model.config.is_encoder_decoder)
    for choose in SEAMS["loss_choices"]:
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

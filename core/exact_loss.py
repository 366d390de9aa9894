"""Token-exact loss weights: every counted target of the global batch weighs the same, on any rank or micro-batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import make_dataclass

import torch
from torch import nn

from core.kernel.loss import Loss, forward
from core.kernel.train import metrics

LOSS_COUNTS: list = []  # fn(model, loss) -> a `counted` forward for a model whose loss takes num_items_in_batch


# A Loss, and the forward that hands the model's own loss the global count (None: a mean, weighed here):
# counted(model, batch, loss, normalizer) -> (loss, metric sums), or None.
ExactLoss = make_dataclass("ExactLoss", ["loss", ("counted", Callable | None, None)], frozen=True)


def make_exact_loss(loss: Loss, *, model: nn.Module) -> ExactLoss:
    """`loss` (make_loss's) for `model` (the plain one), with the loss_counts plug-in's forward where it has one."""
    return ExactLoss(loss, next((found for check in LOSS_COUNTS if (found := check(model, loss))), None))


def count_targets(batch, exact: ExactLoss) -> torch.Tensor:
    """Counted targets of a batch, as its metrics count them (!= -100, after a causal LM's shift), or its samples."""
    targets, labeled = (batch.get("labels"), True) if isinstance(batch, Mapping) else (batch[-1], False)
    first = next(t for t in (batch.values() if labeled else batch) if torch.is_tensor(t))
    return metrics(None, targets, first.new_zeros(()), samples=len(first), shift=exact.loss.shifts and labeled)["count"]


def forward_exact(model: nn.Module, batch, loss_fn: ExactLoss, *, normalizer=1.0) -> tuple[torch.Tensor, dict]:
    """One micro-batch: (its summed loss / normalizer, its metric sums); 1.0: the plain sums evaluation reads."""
    if loss_fn.counted is not None and (found := loss_fn.counted(model, batch, loss_fn.loss, normalizer)):
        return found  # the model's own loss, which divides its sum by the count it is handed
    mean, metrics = forward(model, batch, loss_fn.loss)  # a mean over the counted targets, weighed by their count
    return torch.where(metrics["count"] > 0, mean * metrics["count"], 0.0) / normalizer, metrics  # none counted: 0

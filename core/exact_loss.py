"""Token-exact loss weights: every counted target of the global batch weighs the same, across ranks and
micro-batches, as in one process that sees the whole global batch.

With padded sequences of different lengths, a mean per micro-batch averaged over K micro-batches and W ranks
weighs a short sequence's tokens more than a long one's (the bug transformers fixed for accumulation in issue
#34191). Here each micro-batch's loss is its SUM over counted targets divided by one normalizer, the counted
targets of the whole global batch over W (one all-reduce a step; DDP then averages over W). A transformers model
that takes `num_items_in_batch` is handed that normalizer and divides its own sum by it (read from transformers'
own classes, here only); a causal LM's labels are counted after its shift (core.loss.shifts_labels).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from core.loss import IGNORE, Loss, forward


@dataclass(frozen=True)
class ExactLoss:
    """A core.loss.Loss, and whether the model's own loss takes the global count (see make_exact_loss)."""

    loss: Loss
    takes_count: bool = False  # forward takes num_items_in_batch and divides its summed loss by it


def make_exact_loss(loss: Loss, *, model: nn.Module) -> ExactLoss:
    """`loss` (core.loss.make_loss's, or core.loss_options') for `model` (the plain one), with whether the model's
    own loss is a sum it divides by num_items_in_batch rather than a mean (a copy's `loss_counts` feature)."""
    if loss.spec in ("auto", "model") and _takes_count(model):  # its own loss divides by the count it is handed
        return ExactLoss(loss, takes_count=True)
    return ExactLoss(loss)


@functools.cache
def _forward_traits(cls: type) -> tuple[bool, bool, bool]:
    """(forward names num_items_in_batch, takes **kwargs, hands its labels to transformers' self.loss_function).
    The last is read from the source: BertForSequenceClassification, say, takes **kwargs but calls
    CrossEntropyLoss itself, so it would silently ignore num_items_in_batch."""
    params = inspect.signature(cls.forward).parameters
    found = "num_items_in_batch" in params, any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    with contextlib.suppress(OSError, TypeError):  # no source: a compiled or generated class, not transformers'
        return *found, "self.loss_function(" in inspect.getsource(cls.forward)
    return *found, False


def _takes_count(model: nn.Module) -> bool:
    named, var_kw, uses = _forward_traits(type(model))
    if named:  # a user model that names it: trusted
        return True
    if "transformers" not in sys.modules or not uses or not hasattr(model, "loss_function"):
        return False  # never imported here: torch-only copies work
    return bool(getattr(model, "accepts_loss_kwargs", True) and var_kw)  # transformers Trainer's own test


def _own_counts(loss_fn: ExactLoss, batch) -> bool:
    """Whether this batch's loss is the model's own (it is then called with the targets: a dict with labels, or a
    forward that takes them) and is handed the count (takes_count)."""
    if not loss_fn.takes_count:
        return False
    if loss_fn.loss.spec == "model":
        return True
    labeled = batch.get("labels") is not None if isinstance(batch, Mapping) else loss_fn.loss.targets_as is not None
    return loss_fn.loss.spec == "auto" and labeled


def count_targets(batch, loss_fn: ExactLoss) -> torch.Tensor:
    """Counted targets of a batch as its loss counts them, or its samples where it has no integer targets.

    Counted: != -100, after a causal LM's shift. A float64 tensor on the batch's device."""
    targets = batch.get("labels") if isinstance(batch, Mapping) else batch[-1]
    tensors = [t for t in (batch.values() if isinstance(batch, Mapping) else batch) if isinstance(t, torch.Tensor)]
    if targets is None or targets.is_floating_point():
        return torch.tensor(float(len(tensors[0])), dtype=torch.float64, device=tensors[0].device)
    if loss_fn.loss.shifts and isinstance(batch, Mapping):  # a causal LM's own loss counts labels[..., 1:]
        targets = targets[..., 1:]
    return targets.ne(IGNORE).sum().double()


def global_count(micro_batches: list, loss_fn: ExactLoss, *, group=None) -> torch.Tensor:
    """Counted targets of the global batch: this rank's micro-batches, summed over `group` (one all-reduce).

    `group` None: this rank's alone (its gradients are averaged with no other's)."""
    total = torch.stack([count_targets(b, loss_fn) for b in micro_batches]).sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total


def forward_exact(model: nn.Module, batch, loss_fn: ExactLoss, *, normalizer) -> tuple[torch.Tensor, dict]:
    """One micro-batch: (its summed loss / normalizer, to backward; its metric sums, counted as the loss counts).
    normalizer = global_count(...) / W, W the data-parallel ranks whose gradients are averaged (1 alone)."""
    count = count_targets(batch, loss_fn)
    norm = torch.as_tensor(normalizer, dtype=torch.float64, device=count.device)
    if _own_counts(loss_fn, batch):  # the model's own loss, which divides its sum by the count it is handed
        loss, total, metrics = _forward_own(model, batch, loss_fn, norm=norm)
    else:  # a mean over the counted targets, weighed by their count (0/0 = nan where none counts: 0)
        mean, metrics = forward(model, batch, loss_fn.loss)  # a dict's labels: unless a causal LM's, no accuracy
        total = torch.where(count > 0, mean * count, torch.zeros_like(count))
        loss = total / norm
    metrics |= {"loss_sum": total.detach().double(), "count": count}
    return loss, metrics


def _forward_own(model: nn.Module, batch, loss_fn: ExactLoss, *, norm) -> tuple:
    """forward_exact for a forward that takes num_items_in_batch: handed `norm`, it divides its summed loss by it;
    (loss, summed loss, metric sums). Its labels are scored as they are, or after a causal LM's shift."""
    mean, metrics = forward(model, batch, loss_fn.loss, shift=False, num_items_in_batch=norm)
    return mean, mean * norm, metrics


def forward_sums(model: nn.Module, batch, loss_fn: ExactLoss) -> tuple[torch.Tensor, dict]:
    """forward_exact with no normalizer, for evaluation: core.steps.evaluate(..., forward=forward_sums)."""
    return forward_exact(model, batch, loss_fn, normalizer=1.0)

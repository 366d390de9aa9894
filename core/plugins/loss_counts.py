"""Plug-in `loss_counts`: a model whose own loss divides its sum by `num_items_in_batch` is handed the global count."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Mapping

import torch
from torch import nn

from core.exact_loss import LOSS_COUNTS
from core.kernel.train import metrics


@functools.cache
def forward_traits(cls: type) -> tuple[bool, bool, bool]:
    """(forward names num_items_in_batch, takes **kwargs, hands its labels to transformers' self.loss_function)."""
    params = inspect.signature(cls.forward).parameters
    found = "num_items_in_batch" in params, any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    with contextlib.suppress(OSError, TypeError):  # no source: a compiled or generated class, not transformers'
        return *found, "self.loss_function(" in inspect.getsource(cls.forward)  # Bert's takes **kwargs, ignores it
    return *found, False


def takes_count(model: nn.Module) -> bool:
    """Whether the model's own loss divides its sum by the num_items_in_batch it is handed."""
    named, var_kw, uses = forward_traits(type(model))
    if named:  # a user model that names it: trusted
        return True
    if "transformers" not in sys.modules or not uses or not hasattr(model, "loss_function"):
        return False  # never imported here: torch-only runs work
    return bool(getattr(model, "accepts_loss_kwargs", True) and var_kw)  # transformers Trainer's own test


def counts_of(model: nn.Module, loss):
    """The forward that hands `model` the count, where its own loss (--loss auto or model) takes one; else None."""
    return forward_counted if getattr(loss, "spec", "auto") in ("auto", "model") and takes_count(model) else None


def forward_counted(model: nn.Module, batch, loss, normalizer) -> tuple | None:
    """(loss, metric sums) of the model's own loss handed num_items_in_batch=normalizer; None if not its own."""
    spec, labeled = getattr(loss, "spec", "auto"), getattr(loss, "targets_as", None) is not None
    if isinstance(batch, Mapping):
        labeled = batch.get("labels") is not None
    if spec != "model" and not (spec == "auto" and labeled):
        return None
    first = next(t for t in (batch.values() if isinstance(batch, Mapping) else batch) if torch.is_tensor(t))
    norm = torch.as_tensor(normalizer, dtype=torch.float64, device=first.device)
    outputs, targets = loss.call(functools.partial(model, num_items_in_batch=norm), batch)
    logits, mean = loss.logits_and_loss(outputs, targets, batch)
    shift = loss.shifts and isinstance(batch, Mapping)  # a causal LM's own loss on its labels
    sums = metrics(logits, targets, mean, samples=len(first), shift=shift)
    return mean, sums | {"loss_sum": (mean * norm).detach().double()}  # its sum: the mean times the count it divided by


LOSS_COUNTS.append(counts_of)

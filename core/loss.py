"""The loss contract: what a model may return, what a batch may be, which loss is taken, and how it is normalised.

Model outputs: a tensor (logits); a tuple or list (logits first; `(logits, loss)`; `(loss, logits, ...)` as
transformers returns with return_dict=False); a dict or transformers `ModelOutput` with `loss` and/or `logits`.
Batches: `(input, target)` pairs, called as `model(input)` (`model(input, target)` for `--loss model`), or dicts
of tensors (input_ids, attention_mask, labels, ...) called as `model(**batch)`, whose targets are `labels`.
Targets equal to -100 count nowhere: not in the loss, the count, nor the accuracy (as cross_entropy and
transformers ignore them).

Exact normalisation: every micro-batch's loss is its SUM of per-target losses divided by one `normalizer`, the
counted targets of the whole global batch over the W data-parallel ranks (DDP then averages gradients over W).
So N ranks x K micro-batches of padded sequences give the gradient of the global batch's mean loss, not a mean
of per-micro-batch means (transformers issue #34191).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from core.config import RecipeError
from core.factory import resolve_factory

IGNORE = -100  # the target value that counts nowhere, as in cross_entropy and transformers
LOSS_SPECS = ("auto", "ce", "model")


@dataclass(frozen=True)
class Loss:
    """`--loss`, parsed: see make_loss. `fn` is a module:function loss, called as fn(outputs, batch)."""

    spec: str = "auto"
    fn: Callable | None = None


def make_loss(spec: str = "auto") -> Loss:
    """`--loss`: `auto` (the model's own loss when its output carries one, else cross-entropy on the logits),
    `ce`, `model` (the model is called with the targets too and must return a loss), or `module:function`,
    called as fn(outputs, batch) and returning the batch's MEAN loss over its counted targets (targets != -100;
    the batch's samples when it has no targets). A bad spec raises one RecipeError line."""
    if spec in LOSS_SPECS:
        return Loss(spec)
    return Loss(spec, resolve_factory(spec, dict.fromkeys(LOSS_SPECS), option="--loss"))


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over counted targets, for class logits (N, C) and per-token logits (N, T, C) alike."""
    return nn.functional.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE)


def as_loss(loss_fn) -> Loss:
    """A Loss, a spec string, or an old-style fn(logits, targets) -> mean loss (cross_entropy: `ce`)."""
    if isinstance(loss_fn, Loss):
        return loss_fn
    if isinstance(loss_fn, str):
        return make_loss(loss_fn)
    if loss_fn is cross_entropy:
        return Loss("ce")
    return Loss("custom", lambda outputs, batch: loss_fn(split_outputs(outputs)[0], batch_targets(batch)))


def split_outputs(outputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits, loss) from what a model returned; either may be None."""
    if isinstance(outputs, torch.Tensor):
        return outputs, None
    if isinstance(outputs, Mapping):  # a dict, or a transformers ModelOutput (an OrderedDict)
        return outputs.get("logits"), outputs.get("loss")
    if isinstance(outputs, (tuple, list)) and outputs:
        first = outputs[0]
        if len(outputs) > 1 and isinstance(first, torch.Tensor) and first.dim() == 0:
            return outputs[1], first  # (loss, logits, ...): transformers with return_dict=False
        second = outputs[1] if len(outputs) > 1 else None
        return first, second if isinstance(second, torch.Tensor) and second.dim() == 0 else None
    raise RecipeError(
        f"the model returned {type(outputs).__name__}; return logits, (logits, loss), "
        f"or a dict/ModelOutput with loss and/or logits"
    )


def batch_targets(batch) -> torch.Tensor | None:
    """The targets: a pair's second item, a dict's `labels`; None when the batch has none."""
    if isinstance(batch, Mapping):
        return batch.get("labels")
    return batch[1] if isinstance(batch, Sequence) and len(batch) > 1 else None


def batch_samples(batch) -> int:
    """Examples (sequences) in the batch: the first dimension of its first tensor."""
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, Sequence) else [batch]
    return next(t.shape[0] for t in items if isinstance(t, torch.Tensor) and t.dim() > 0)


def batch_device(batch) -> torch.device:
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, Sequence) else [batch]
    return next(t.device for t in items if isinstance(t, torch.Tensor))


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside torch.compile and DDP/DataParallel (fully_shard keeps the class)."""
    model = getattr(model, "_orig_mod", model)
    return (
        getattr(model, "module", model)
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel))
        else model
    )


@functools.cache
def _forward_traits(cls: type) -> tuple[bool, bool, bool]:
    """(forward names num_items_in_batch, takes **kwargs, hands its labels to transformers' self.loss_function).
    The last is read from the source: BertForSequenceClassification, say, takes **kwargs but calls
    CrossEntropyLoss itself, so it would silently ignore num_items_in_batch."""
    params = inspect.signature(cls.forward).parameters
    var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    try:
        uses = "self.loss_function(" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        uses = False
    return "num_items_in_batch" in params, var_kw, uses


def model_loss_traits(model: nn.Module) -> tuple[bool, bool]:
    """(forward takes num_items_in_batch and divides its summed loss by it, the model's loss shifts labels)."""
    inner = _unwrap(model)
    named, var_kw, uses = _forward_traits(type(inner))
    if named:  # a user model that names it: trusted, its labels taken as they are
        return True, False
    loss_utils = sys.modules.get("transformers.loss.loss_utils")  # never imported here: torch-only copies work
    if loss_utils is None or not uses or not hasattr(inner, "loss_function"):
        return False, False
    takes = getattr(inner, "accepts_loss_kwargs", True) and var_kw  # transformers Trainer's own test
    encoder_decoder = getattr(getattr(inner, "config", None), "is_encoder_decoder", False)
    return bool(takes), inner.loss_function is loss_utils.ForCausalLMLoss and not encoder_decoder


def _plan(model: nn.Module, loss: Loss, batch) -> tuple[bool, bool, bool]:
    """(the model's own loss is wanted, pass num_items_in_batch, count shifted labels) for this batch."""
    wanted = loss.spec == "model" or (
        loss.spec == "auto" and batch_targets(batch) is not None and isinstance(batch, Mapping)
    )  # a pair's model(input) gets no targets
    takes, shifts = model_loss_traits(model) if wanted else (False, False)
    return wanted, takes, shifts


def count_targets(batch, *, shift: bool = False) -> torch.Tensor:
    """Counted targets (!= -100; after the causal-LM shift when `shift`), or samples without targets (float64)."""
    targets = batch_targets(batch)
    if targets is None or targets.is_floating_point():
        return torch.tensor(float(batch_samples(batch)), dtype=torch.float64, device=batch_device(batch))
    return (targets[..., 1:] if shift else targets).ne(IGNORE).sum().double()


def local_count(micro_batches: list, *, model: nn.Module | None = None, loss_fn=None) -> torch.Tensor:
    """Counted targets over this rank's micro-batches, as the loss will count them."""
    loss = as_loss(loss_fn if loss_fn is not None else "auto")
    return torch.stack(
        [count_targets(b, shift=model is not None and _plan(model, loss, b)[2]) for b in micro_batches]
    ).sum()


def global_count(
    micro_batches: list, *, group: dist.ProcessGroup | None = None, model: nn.Module | None = None, loss_fn=None
) -> torch.Tensor:
    """Counted targets of the global batch: this rank's micro-batches, summed over `group` (None: the default
    group, when there is one): one all-reduce. Pass `model` and `loss_fn` so a causal LM's shift is counted."""
    total = local_count(micro_batches, model=model, loss_fn=loss_fn)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total


def _accuracy(logits, targets, *, shift: bool) -> torch.Tensor | None:
    """Correct counted predictions, or None where the outputs are not class logits for these targets."""
    if logits is None or targets is None or targets.is_floating_point() or logits.dim() < 2:
        return None
    if shift:
        logits, targets = logits[..., :-1, :], targets[..., 1:]
    if logits.shape[:-1] != targets.shape:
        return None
    return ((logits.detach().argmax(-1) == targets) & targets.ne(IGNORE)).sum().double()


def _call(model: nn.Module, batch, *, loss: Loss, extra: dict):
    """model(**batch) for a dict; model(input), or model(input, target) for --loss model, for a pair."""
    if isinstance(batch, Mapping):
        return model(**batch, **extra)
    if loss.spec != "model":
        return model(batch[0])
    try:
        inspect.signature(_unwrap(model).forward).bind(batch[0], batch[1], **extra)
    except TypeError:
        raise RecipeError(
            "--loss model: the model's forward does not take (input, target); "
            "use --loss auto or ce, or give forward a targets argument"
        ) from None
    return model(batch[0], batch[1], **extra)


def forward_loss(
    model: nn.Module, batch, *, loss_fn, normalizer: torch.Tensor | float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward one micro-batch: (this batch's summed loss / normalizer, to backward; its metrics, summed).

    normalizer = global_count(...) / W, W the data-parallel ranks whose gradients DDP averages (1: one
    process); normalizer=1 gives the plain sum (evaluation). Metrics: loss_sum, count, samples, and
    correct where logits and targets allow an accuracy (float64 device tensors, no host sync).
    """
    loss = as_loss(loss_fn)
    _, takes, shift = _plan(model, loss, batch)  # as global_count counted: the same targets
    norm = torch.as_tensor(normalizer, dtype=torch.float64, device=batch_device(batch))
    extra = {"num_items_in_batch": norm} if takes else {}  # transformers' own fix: it divides its sum by this
    outputs = _call(model, batch, loss=loss, extra=extra)
    logits, own = split_outputs(outputs)
    targets, count = batch_targets(batch), count_targets(batch, shift=shift)
    if loss.spec == "model" and own is None:
        raise RecipeError(
            f"--loss model: the model's output ({type(outputs).__name__}) carries no loss; "
            f"use --loss ce or have forward return (logits, loss)"
        )
    if own is not None and takes:
        total = own * norm  # the model already divided its sum by `norm`
    elif (own is not None and loss.spec in ("auto", "model")) or loss.fn is not None:
        mean = own if loss.fn is None else loss.fn(outputs, batch)  # a mean over the counted targets
        total = torch.where(count > 0, mean * count, torch.zeros_like(count))  # 0/0 = nan when none counts
    elif logits is None or targets is None:
        raise RecipeError(
            f"--loss {loss.spec}: cross-entropy needs logits and targets; the model returned "
            f"{type(outputs).__name__} for a {type(batch).__name__} batch; use --loss model or a function"
        )
    else:
        total = nn.functional.cross_entropy(
            logits.flatten(0, -2).float(), targets.flatten(), reduction="sum", ignore_index=IGNORE
        )
    samples = torch.tensor(float(batch_samples(batch)), dtype=torch.float64, device=count.device)
    metrics = {"loss_sum": total.detach().double(), "count": count, "samples": samples}
    correct = _accuracy(logits, targets, shift=shift)
    if correct is not None:
        metrics["correct"] = correct
    return (own if own is not None and takes else total / norm), metrics

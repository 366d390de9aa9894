"""The plain training step and evaluation. Metrics stay tensors on the device: no `.item()` (a host sync) per
batch; core.meter sums them and reduces over ranks only when a number is read."""

from __future__ import annotations

import math

import torch
from torch import nn

from core.kernel.job import RecipeError
from core.kernel.train import to_device
from core.loss import Loss, forward
from core.meter import Tally, summarize


def step_plain(model: nn.Module, batch, *, optimizer: torch.optim.Optimizer, loss_fn: Loss) -> tuple[dict, float]:
    """One optimizer step on one batch: forward, backward (where DDP all-reduces the gradients, averaged), step.
    Returns the batch's metric sums and the gradient norm; a step whose norm is not finite is not taken."""
    optimizer.zero_grad(set_to_none=True)
    loss, metrics = forward(model, batch, loss_fn)
    loss.backward()
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = float(torch.nn.utils.get_total_norm(grads))  # the step's one host sync; every rank reads the same
    if math.isfinite(norm):
        optimizer.step()
    return metrics, norm


def check_finite(grad_norm: float, *, step: int, on_nonfinite: str, clips: bool = False) -> int:
    """1 when the step was skipped for a non-finite gradient norm (--on-nonfinite skip), else 0.

    With --on-nonfinite stop, one RecipeError line, naming --clip where the recipe takes it (`clips`). Every rank
    reads the same all-reduced norm: all stop together."""
    if math.isfinite(grad_norm):
        return 0
    if on_nonfinite == "stop":
        fix = f"lower --lr{', set --clip' if clips else ''}, or pass --on-nonfinite skip"
        raise RecipeError(f"step {step}: the loss or the gradients are not finite (gradient norm {grad_norm}); {fix}")
    return 1


@torch.no_grad()
def evaluate(model: nn.Module, loader, *, loss_fn: Loss, device: torch.device, forward=forward) -> dict[str, float]:
    """val_loss and val_acc where one exists, over the whole validation set, each rank's share counted once.

    val_loss: summed over every counted target, divided by their count. Sums on each rank, one all-reduce at the
    end. `forward`: how a batch's metric sums are taken (core.exact_loss.forward_exact counts as training does)."""
    if loader is None:
        return {}
    was_training, tally = model.training, Tally(device)
    model.eval()
    for batch in loader:
        tally.add(forward(model, to_device(batch, device), loss_fn)[1])
    model.train(was_training)
    return summarize(tally.reduce(), prefix="val_")

"""The replica's step: forward, backward, the optimizer step and its check; evaluation."""

from __future__ import annotations

import math

import torch
from torch import nn

from core.kernel.job import RecipeError
from core.kernel.loss import Loss, forward
from core.kernel.train import Tally, summarize, to_device


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

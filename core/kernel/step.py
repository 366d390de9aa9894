"""The replica's step: forward, backward, the optimizer step and its check; how many steps the run takes."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader

from core.kernel.job import RecipeError
from core.kernel.loss import Loss, forward


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


def total_steps(loader: DataLoader, *, epochs: int, max_steps: int) -> int:
    """Optimizer steps the run takes (the LR schedule's length): --epochs over the loader, or --max-steps."""
    if (share := loader.sampler.num_samples) < (batch := loader.batch_size):
        raise RecipeError(f"--batch-size {batch}: a rank has {share} samples, not a batch; lower it or use fewer ranks")
    return min(epochs * len(loader), max_steps or epochs * len(loader))

"""One training step, evaluation, and metric sums that are reduced over ranks only when read.

Steps return their metrics as tensors on the device: no `.item()` (a host sync) per step.
A `Tally` adds them up and does one all-reduce when a number is actually logged.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from core.data import to_device
from core.dist import reduce_sum


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for class logits (N, C) and for per-token logits (N, T, C) alike."""
    return nn.functional.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten())


def batch_metrics(outputs: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums, not means, so that ranks with different batch sizes combine exactly."""
    count = torch.tensor(targets.numel(), device=targets.device, dtype=torch.float64)
    return {
        "loss_sum": loss.detach().double() * count,
        "correct": (outputs.detach().argmax(-1) == targets).sum().double(),
        "count": count,
    }


def step_plain(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """One optimizer step on one batch. Under DDP, backward() also averages the gradients."""
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=True)
    outputs = model(inputs)
    loss = loss_fn(outputs, targets)
    loss.backward()
    optimizer.step()
    return batch_metrics(outputs, targets, loss)


class Tally:
    """Running sums of step metrics, kept on the device until `reduce` is called.

    `keys` fixes what is reduced, so a rank that saw no batch still joins the all-reduce.
    """

    def __init__(self, device: torch.device, keys: Iterable[str] = ("loss_sum", "correct", "count")):
        self.device = device
        self.sums = {key: torch.zeros((), dtype=torch.float64, device=device) for key in keys}

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        for key, value in metrics.items():
            self.sums[key] = self.sums[key] + value if key in self.sums else value.double()

    def reduce(self) -> dict[str, float]:
        """Sums over all ranks (one all-reduce), as floats: the same numbers on every rank."""
        keys = sorted(self.sums)
        totals = reduce_sum(torch.stack([self.sums[k].double() for k in keys])).tolist()
        return dict(zip(keys, totals))


def summarize(sums: dict[str, float], *, prefix: str = "") -> dict[str, float]:
    """loss_sum / correct / count sums -> mean loss and accuracy."""
    count = max(sums.get("count", 0.0), 1.0)
    return {f"{prefix}loss": sums.get("loss_sum", 0.0) / count, f"{prefix}acc": sums.get("correct", 0.0) / count}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
) -> dict[str, float]:
    """Loss and accuracy over the whole validation set, every rank's share counted once."""
    was_training = model.training
    model.eval()
    tally = Tally(device)
    for batch in loader:
        inputs, targets = to_device(batch, device)
        outputs = model(inputs)
        tally.add(batch_metrics(outputs, targets, loss_fn(outputs, targets)))
    model.train(was_training)
    return summarize(tally.reduce(), prefix="val_")

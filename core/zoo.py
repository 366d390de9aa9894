"""The package's built-ins beyond the kernel's MLP and digits, factories of the same shape as a user's own:
the CNN (`--model cnn`), Gaussian blobs (`--data synthetic`), and the kernel's digits read without scikit-learn."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from core.kernel.builtin import digits


class CNN(nn.Module):
    """A small conv net for 8x8 single-channel images; takes the digits' flat 64 floats too."""

    def __init__(self, side: int = 8, channels: int = 32, classes: int = 10):
        super().__init__()
        self.side = side
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Flatten(), nn.Linear(2 * channels * (side // 2) ** 2, classes)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x.reshape(-1, 1, self.side, self.side))


def cnn() -> nn.Module:
    return CNN()


def synthetic(*, n: int = 8192, dim: int = 64, classes: int = 10, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Gaussian blobs, one per class, in digits' shape: learnable, any size, for benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=gen)
    targets = torch.randint(classes, (n,), generator=gen)
    inputs = centers[targets] + 0.8 * torch.randn(n, dim, generator=gen)
    n_val = n // 8
    return TensorDataset(inputs[n_val:], targets[n_val:]), TensorDataset(inputs[:n_val], targets[:n_val])


def quick_digits(*, val_fraction: float = 0.2, split_seed: int = 0) -> tuple[Dataset, Dataset]:
    """The kernel's digits(), the same tensors, from the table scikit-learn ships without importing it (~1.6 s a
    process); another layout, or no scikit-learn: the kernel's own, which says what is missing."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    table = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if table is None or not table.is_file():
        return digits(val_fraction=val_fraction, split_seed=split_seed)
    rows = np.loadtxt(table, delimiter=",")
    inputs = torch.tensor(rows[:, :-1], dtype=torch.float32) / 16.0
    targets = torch.tensor(rows[:, -1].astype(int), dtype=torch.int64)
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(split_seed))
    val, train = order[: int(len(targets) * val_fraction)], order[int(len(targets) * val_fraction) :]
    return TensorDataset(inputs[train], targets[train]), TensorDataset(inputs[val], targets[val])

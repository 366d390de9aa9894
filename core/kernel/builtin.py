"""The built-in model and data a recipe trains when it is given no other: an MLP on scikit-learn's digits."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from core.kernel.seams import FACTORIES


class MLP(nn.Module):
    """Flat input -> `depth` hidden blocks (Linear, ReLU) -> class logits."""

    def __init__(self, in_dim: int = 64, hidden: int = 1024, depth: int = 3, classes: int = 10):
        super().__init__()
        blocks = [nn.Sequential(nn.Linear(hidden if i else in_dim, hidden), nn.ReLU()) for i in range(depth)]
        self.blocks = nn.Sequential(*blocks, nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x.flatten(1))


def digits(*, val_fraction: float = 0.2, split_seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped in the package): 64 floats in [0, 1]."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    inputs = torch.tensor(images, dtype=torch.float32) / 16.0
    targets = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(split_seed))
    val, train = order.tensor_split([int(len(targets) * val_fraction)])
    return TensorDataset(inputs[train], targets[train]), TensorDataset(inputs[val], targets[val])


def build_model(cfg) -> nn.Module:
    """The model to train: yours in place of MLP() (or --model, with the factories plug-in)."""
    return FACTORIES["model"](cfg) if "model" in FACTORIES else MLP()  # your model


def build_data(cfg) -> tuple:
    """(train, val or None, collate_fn or None): yours in place of digits() (or --data, with the factories plug-in)."""
    found = FACTORIES["data"](cfg) if "data" in FACTORIES else digits()  # your data: map-style data sets
    return (*found, None)[:3]

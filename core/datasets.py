"""The embedded data sets (no download): factories of the same shape as a user's own `--data module:function`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset


def digits(*, val_fraction: float = 0.2, split_seed: int = 0) -> tuple[Dataset, Dataset]:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped in the package): 64 floats in [0, 1]."""
    images, labels = _digits_table()
    inputs = torch.tensor(images, dtype=torch.float32) / 16.0
    targets = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(len(targets) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(inputs[train], targets[train]), TensorDataset(inputs[val], targets[val])


def _digits_table():
    """sklearn_digits() read from the file sklearn ships, without importing sklearn (~1 s a process)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    table = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if table is None or not table.is_file():  # another layout (or no sklearn): its own loader says what is wrong
        return sklearn_digits()
    rows = np.loadtxt(table, delimiter=",")
    return rows[:, :-1], rows[:, -1].astype(int)


def sklearn_digits():
    """(images, labels): scikit-learn's own loader of its digits table."""
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)


def synthetic(*, n: int = 8192, dim: int = 64, classes: int = 10, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Gaussian blobs, one per class, in digits' shape: learnable, any size, for benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=gen)
    targets = torch.randint(classes, (n,), generator=gen)
    inputs = centers[targets] + 0.8 * torch.randn(n, dim, generator=gen)
    n_val = n // 8
    return TensorDataset(inputs[n_val:], targets[n_val:]), TensorDataset(inputs[:n_val], targets[:n_val])

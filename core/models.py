"""Small reference models. Each is a factory with no required arguments, like a user's own.

Models are built as a sequence of blocks (`model.blocks`), so pipeline, tensor and
fully-sharded parallelism can cut or wrap them block by block.
"""

from __future__ import annotations

import torch
from torch import nn

from core.factory import resolve_factory
from core.kernel.builtin import MLP
from core.kernel.job import RecipeError


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


def mlp() -> nn.Module:
    return MLP()


def cnn() -> nn.Module:
    return CNN()


MODELS = {"mlp": "core.models:mlp", "cnn": "core.models:cnn", "gpt": "core.gpt:gpt"}  # each imported when named


def build_model(spec: str) -> nn.Module:
    """`--model`: a built-in name or a user's `module:function`; either way a factory called with no arguments."""
    model = resolve_factory(spec, MODELS, option="--model")()  # called with no arguments
    if not isinstance(model, nn.Module):
        raise RecipeError(f"--model {spec}: the factory returned {type(model).__name__}, not an nn.Module")
    return model

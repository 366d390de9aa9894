"""Small factories for end-to-end tests (`--model tiny:mlp`), so checkpoints are quick to write."""
from torch import nn

from core.models import MLP


def mlp() -> nn.Module:
    return MLP(hidden=32, depth=2)


class TiedMLP(nn.Module):
    """Input and output layers share one weight: safetensors refuses shared storage as it is."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(64, 64, bias=False)
        self.hidden = nn.Linear(64, 64)
        self.decode = nn.Linear(64, 64, bias=False)
        self.decode.weight = self.encode.weight

    def forward(self, x):
        return self.decode(self.hidden(self.encode(x)).relu())[:, :10]


def tied() -> nn.Module:
    return TiedMLP()

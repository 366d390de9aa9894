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


class Exploding(nn.Module):
    """Trains normally for two steps, then its output turns to inf: a loss that is not finite."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)
        self.calls = 0

    def forward(self, x):
        self.calls += self.training
        return self.linear(x) * (float("inf") if self.calls > 2 else 1.0)


def exploding() -> nn.Module:
    return Exploding()

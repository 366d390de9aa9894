"""Small factories for end-to-end tests (`--model tiny:mlp`), so checkpoints are quick to write."""

from collections import namedtuple

from torch import nn
from torch.utils.data import Dataset

from core.kernel.builtin import MLP


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


class Wrapper(nn.Module):
    """A user's wrapper with a child named `module` and layers of its own: the old unwrap saved only the child."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(64, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.module(x).relu())


def wrapper() -> nn.Module:
    return Wrapper()


Sample = namedtuple("Sample", ["image", "label"])


class Named(Dataset):
    """The digits as namedtuple samples: the old evaluation rebuilt them with type(batch)(generator) and died."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return Sample(*self.pairs[i])


def named():
    from core.zoo import quick_digits as digits

    train, val = digits()
    return Named(train), Named(val)

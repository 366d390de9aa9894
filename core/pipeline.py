"""The pipeline cut: a model's blocks (every parameter in `model.blocks`) into stages of about equal weight."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from torch import nn

from core.kernel.job import RecipeError

STAGE_WEIGHTS: list = []  # fn(cfg, model, train_set) -> each block's weight for the pipeline's cut, or None (--balance)


def plan_split(weights: Sequence[float], num_stages: int) -> list[int]:
    """Blocks per stage of the contiguous split whose heaviest stage is lightest (exact: dynamic programming)."""
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise RecipeError(f"cannot cut the model's {n} blocks into {num_stages} pipeline stages; use 1 to {n} stages")
    prefix = [0.0, *itertools.accumulate(weights)]
    # best[s][i]: lightest possible heaviest stage when the first i blocks form s stages
    best = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):  # the last stage holds blocks j..i-1
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    sizes, i = [], n
    for s in range(num_stages, 0, -1):
        sizes.append(i - cut[s][i])
        i = cut[s][i]
    return sizes[::-1]


def check_pipeline_model(model: nn.Module) -> int:
    """The number of blocks; one line naming the structure pipelining needs when the model lacks it (meta is fine)."""
    name = type(model).__name__
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Sequential):
        raise RecipeError(
            f"--model {name}: pipelining needs every parameter in `model.blocks`, an nn.Sequential that forward() "
            f"runs in order (forward = model.blocks(x), like core.gpt.GPT); use ddp or fsdp for this model"
        )
    names = [n for n, _ in itertools.chain(model.named_parameters(), model.named_buffers())]
    outside = [n for n in names if not n.startswith("blocks.")]
    if outside:
        raise RecipeError(
            f"--model {name}: {outside[0]} is outside model.blocks; "
            f"a pipeline stage must hold every parameter, so move it into a block"
        )
    return len(blocks)

"""The pipeline cut: a model's blocks (every parameter in `model.blocks`) into stages of about equal weight."""

from __future__ import annotations

import functools
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

    @functools.cache
    def best(s: int, i: int) -> tuple[float, int]:
        """(lightest heaviest stage, start of the last stage) of the first i blocks in s stages; ties: earliest cut."""
        if s == 0:
            return (0.0 if i == 0 else float("inf"), 0)
        return min((max(best(s - 1, j)[0], prefix[i] - prefix[j]), j) for j in range(s - 1, i))

    sizes, i = [], n
    for s in range(num_stages, 0, -1):
        sizes.append(i - (i := best(s, i)[1]))
    return sizes[::-1]


def check_pipeline_model(model: nn.Module) -> int:
    """The number of blocks; one line naming the structure pipelining needs when the model lacks it (meta is fine)."""
    name, blocks = type(model).__name__, getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Sequential):
        raise RecipeError(
            f"--model {name}: pipelining needs every parameter in `model.blocks`, an nn.Sequential that forward() "
            f"runs in order (forward = model.blocks(x), like core.gpt.GPT); use ddp or fsdp for this model"
        )
    names = itertools.chain(model.named_parameters(), model.named_buffers())
    if outside := [n for n, _ in names if not n.startswith("blocks.")]:
        fix = "a pipeline stage must hold every parameter, so move it into a block"
        raise RecipeError(f"--model {name}: {outside[0]} is outside model.blocks; {fix}")
    return len(blocks)

"""The pipeline cut: a model's blocks (every parameter in `model.blocks`) into stages of about equal weight."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from torch import nn

from core.kernel.job import RecipeError

STAGE_WEIGHTS: list = []  # fn(cfg, model, train_set) -> each block's weight for the pipeline's cut, or None (--balance)


def plan_split(weights: Sequence[float], num_stages: int) -> list[int]:
    """Blocks per stage of the contiguous split whose heaviest stage is lightest (exact: dynamic programming)."""
    if not 1 <= num_stages <= (n := len(weights)):
        raise RecipeError(f"cannot cut the model's {n} blocks into {num_stages} pipeline stages; use 1 to {n} stages")
    prefix = [0.0, *itertools.accumulate(weights)]
    # best[s, i]: (lightest heaviest stage, start of the last stage) of the first i blocks in s stages;
    # ties: the earliest cut
    best = {(0, i): (0.0 if i == 0 else math.inf, 0) for i in range(n + 1)}
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            best[s, i] = min((max(best[s - 1, j][0], prefix[i] - prefix[j]), j) for j in range(s - 1, i))
    sizes, i = [], n
    for s in range(num_stages, 0, -1):
        sizes.append(i - (i := best[s, i][1]))
    return sizes[::-1]


def check_pipeline_model(model: nn.Module) -> int:
    """The number of blocks; one line naming the structure pipelining needs when the model lacks it (meta is fine)."""
    name, blocks = type(model).__name__, getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Sequential):
        shape = "an nn.Sequential that forward() runs in order (forward = model.blocks(x), like core.gpt.GPT)"
        fix = "use ddp or fsdp for this model"
        raise RecipeError(f"--model {name}: pipelining needs every parameter in `model.blocks`, {shape}; {fix}")
    if outside := [n for n, _ in [*model.named_parameters(), *model.named_buffers()] if not n.startswith("blocks.")]:
        fix = "a pipeline stage must hold every parameter, so move it into a block"
        raise RecipeError(f"--model {name}: {outside[0]} is outside model.blocks; {fix}")
    return len(blocks)

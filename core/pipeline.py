"""Pipeline parallelism, the cut: a block-sequence model into stages, balanced by parameter count (or as the balance
plug-in weighs the blocks). Both pipeline
recipes take it (pipeline_naive puts the stages on devices; pipeline runs torch's schedules on them, core/schedules.py).

A "block-sequence model" keeps every parameter in `model.blocks` (an nn.Sequential) and its forward is
`model.blocks(x)`, like core.gpt.GPT and the models in core.models. Stages keep the blocks' original names
(`blocks.3.attn.q.weight`), so the stages' state dicts merged are the whole model's state dict.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from core.kernel.job import RecipeError

STAGE_WEIGHTS: list = []  # fn(cfg, model, train_set) -> each block's weight for the pipeline's cut, or None (--balance)


class Stage(nn.Module):
    """Blocks lo..hi-1 of a model, under their original names: forward = those blocks in order."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        self.blocks = nn.Sequential(OrderedDict((str(i), block) for i, block in blocks.items()))
        self.indices = list(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def plan_split(weights: Sequence[float], num_stages: int) -> list[int]:
    """Stage sizes (blocks per stage) of the contiguous split whose heaviest stage is lightest.

    Exact, by dynamic programming over (blocks used, stages used); ties go to the earliest cut.
    """
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
    """The number of blocks; a RecipeError naming the structure pipelining needs when the model lacks it.

    Reads only attributes, so it runs on a meta-device model in the pre-check. Too few blocks for the stages:
    plan_split's line (core.schedules.check_pipeline names the recipe's options before launch)."""
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


def split_pipeline(
    model: nn.Module,
    *,
    num_stages: int,
    stage_index: int,
    weights: Sequence[float] | None = None,
    sizes: Sequence[int] | None = None,
) -> Stage:
    """Cut `model.blocks` into `num_stages` contiguous stages and return stage `stage_index`.

    The cut is plan_split's of `weights`, one a block: their parameter counts by default, or block_times' seconds;
    or `sizes`, the blocks of each stage given, e.g. [2, 4].
    """
    count = check_pipeline_model(model)
    weights = weights or [float(sum(p.numel() for p in block.parameters())) for block in model.blocks]
    sizes = list(sizes or plan_split(weights, num_stages))
    if len(sizes) != num_stages or sum(sizes) != count or min(sizes) < 1:
        raise RecipeError(f"stage sizes {sizes}: give {num_stages} positive sizes adding up to {count} blocks")
    lo = sum(sizes[:stage_index])
    return Stage({i: model.blocks[i] for i in range(lo, lo + sizes[stage_index])})


def root_module(stages: list[nn.Module]) -> nn.Module:
    """One module for a pipeline rank's stages, their blocks under their own names: what its checkpoints take."""
    root, blocks = nn.Module(), nn.Module()
    for stage in stages:
        for name, block in stage.blocks.named_children():
            blocks.add_module(name, block)
    root.add_module("blocks", blocks)
    return root

"""Plug-in `blocks`: --blocks NAME, the nn.ModuleList (or nn.Sequential) of blocks fully_shard wraps one by one, for a
model whose repeated blocks the copy does not find itself (or finds others)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from core.kernel.job import Options, RecipeError, option
from core.kernel.seams import SEAMS
from core.shard import BLOCKS


@dataclass(frozen=True)
class BlocksOption(Options):
    """fully sharded data parallel"""

    blocks: str = option("", "the nn.ModuleList of blocks to shard one by one, e.g. transformer.h (default: found)")


def named_blocks(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """--blocks NAME: (NAME, that nn.ModuleList / nn.Sequential), or a RecipeError listing the candidates."""
    containers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential) and len(m)]
    found = dict(containers).get(name)
    if found is None:
        listed = ", ".join(n or "(the model itself)" for n, _ in containers) or "none"
        raise RecipeError(
            f"--blocks {name}: {type(model).__name__} has no nn.ModuleList or nn.Sequential there; candidates: {listed}"
        )
    return name, found


def pick(cfg, model: nn.Module) -> tuple[str, nn.Module] | None:
    return named_blocks(model, cfg.blocks) if getattr(cfg, "blocks", "") else None  # "": the ones found


SEAMS["option_groups"].append(BlocksOption)
BLOCKS.append(pick)

"""The recipes. Importing this package fills `RECIPES` (core.registry) with the built-in ones
and with those that other packages add through the `torch_dist_recipes` entry-point group.

Recipes import `core`, never each other: each file is a whole training story on its own.
"""
from core.registry import RECIPES, load_entry_points
from recipes import (  # noqa: F401  (each module registers itself on import)
    ddp,
    ddp_amp,
    dp,
    fsdp,
    fsdp_tp,
    pipeline,
    pipeline_naive,
    tensor_parallel,
)

PLUGIN_PROBLEMS = load_entry_points()

__all__ = ["RECIPES", "PLUGIN_PROBLEMS"]

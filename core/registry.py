"""The recipe registry: plain data, filled by `@register`, read by the CLI.

Third-party packages add recipes through the entry-point group `torch_dist_recipes`:

    [options.entry_points]
    torch_dist_recipes =
        my_recipe = mypkg.my_recipe   # a module whose import calls @register
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "torch_dist_recipes"


@dataclass(frozen=True)
class Option:
    """A recipe's own CLI option, beyond the shared ones in TrainConfig."""

    default: Any
    help: str
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Recipe:
    name: str
    main: Callable[..., dict]
    summary: str
    multi_node: bool = True
    builds_on: str | None = None
    options: dict[str, Option] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)  # this recipe's defaults for shared options

    @property
    def source_file(self) -> str:
        return inspect.getsourcefile(self.main)


RECIPES: dict[str, Recipe] = {}


def register(name: str, *, summary: str, multi_node: bool = True, builds_on: str | None = None,
             options: dict[str, Option] | None = None, defaults: dict[str, Any] | None = None):
    """Decorator: add the recipe's `main(cfg, **options)` to RECIPES under `name`."""

    def add(main):
        RECIPES[name] = Recipe(name, main, summary, multi_node, builds_on, dict(options or {}), dict(defaults or {}))
        return main

    return add


def load_entry_points() -> list[str]:
    """Import third-party recipe modules; returns one line per plugin that failed to load."""
    problems = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as err:  # a broken plugin must not take the built-in recipes down with it
            problems.append(f"recipe plugin {ep.name!r} ({ep.value}) failed to load: {err}")
    return problems

"""The recipe registry: plain data, read by the CLI. Importing it imports no recipe.

Each entry names the module that holds the recipe's `main(cfg)` and its `Config`; the module is
imported only when the recipe is run, copied or asked for its --help. Third-party packages add
recipes through the entry-point group `torch_dist_recipes`, whose entries are `Recipe` values:

    [options.entry_points]
    torch_dist_recipes =
        my_recipe = mypkg.recipes:MY_RECIPE     # MY_RECIPE = Recipe("my_recipe", "mypkg.my_recipe", "...")
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType

ENTRY_POINT_GROUP = "torch_dist_recipes"


@dataclass(frozen=True)
class Recipe:
    name: str
    module: str  # holds main(cfg) -> dict and Config (a dataclass of exactly the options it takes)
    summary: str  # what it shows: `ls` and the README's table, in markdown
    builds_on: str | None = None
    multi_node: bool = True  # False: one process drives every local device (the launcher starts one)
    opt_ins: tuple[str, ...] = ()  # the core modules it takes beyond ddp's (the base): `ls` shows them
    mean_per_replica: bool = False  # each replica's loss is its own batch's mean, and the replicas are averaged

    @property
    def streams(self) -> bool:
        """It reads streams (IterableDatasets) through core.stream; the others refuse them before launch."""
        return "stream" in self.opt_ins

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    @property
    def source_file(self) -> str:
        return importlib.util.find_spec(self.module).origin


_BUILT_IN = [
    Recipe(
        "ddp", "recipes.ddp", "`DistributedDataParallel`: the base every other recipe builds on", mean_per_replica=True
    ),
    Recipe(
        "ddp_amp",
        "recipes.ddp_amp",
        "autocast (bf16/fp16), GradScaler, accumulation with `no_sync`, clipping, streams",
        builds_on="ddp",
        opt_ins=("amp", "exact_loss", "stream", "trackers"),
    ),
    Recipe(
        "ddp_monitored",
        "recipes.ddp_monitored",
        "step-time breakdown, MFU, hang watchdog, profiler, comm hooks, compile, async checkpoints",
        builds_on="ddp",
        opt_ins=("monitor", "metrics", "watchdog", "comm", "tuning", "ckpt_async", "trackers"),
        mean_per_replica=True,
    ),
    Recipe(
        "dp",
        "recipes.dp",
        "`nn.DataParallel` in one process (plain training with fewer than 2 GPUs)",
        builds_on="ddp",
        multi_node=False,
        mean_per_replica=True,  # where the model computes its loss: each GPU's replica returns its mean
    ),
    Recipe(
        "fsdp",
        "recipes.fsdp",
        "FSDP2 `fully_shard` per block, sharded checkpoints, bf16, CPU offload",
        builds_on="ddp_amp",
        opt_ins=("parallel", "amp", "exact_loss", "stream", "dcp", "trackers"),
    ),
    Recipe(
        "tensor_parallel",
        "recipes.tensor_parallel",
        "column/row splits of each block's Linear layers (DTensor), from the model's own plan",
        builds_on="fsdp",
        opt_ins=("parallel", "tp_plan", "amp", "exact_loss", "stream", "dcp", "trackers"),
    ),
    Recipe(
        "fsdp_tp",
        "recipes.fsdp_tp",
        "2-D mesh: tensor parallel within groups of `--tp` ranks, FSDP2 across them",
        builds_on="fsdp",
        opt_ins=("parallel", "tp_plan", "amp", "exact_loss", "stream", "dcp", "trackers"),
    ),
    Recipe(
        "pipeline",
        "recipes.pipeline",
        "`torch.distributed.pipelining`: GPipe, 1F1B, interleaved; pipeline x data parallel",
        builds_on="ddp_amp",
        opt_ins=("parallel", "pipeline", "schedules", "amp", "dcp", "trackers"),
    ),
    Recipe(
        "pipeline_naive",
        "recipes.pipeline_naive",
        "model parallel by hand: stages on devices, one process, one device busy at a time",
        builds_on="dp",
        multi_node=False,
        opt_ins=("pipeline",),
    ),
]


def _load_plugins() -> tuple[dict[str, Recipe], list[str]]:
    found, problems = {}, []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            recipe = ep.load()
            if not isinstance(recipe, Recipe):
                raise TypeError(f"it is a {type(recipe).__name__}, not a tools.registry.Recipe")
            found[recipe.name] = recipe
        except Exception as err:  # a broken plugin must not take the built-in recipes down with it
            problems.append(f"recipe plugin {ep.name!r} ({ep.value}) failed to load: {err}")
    return found, problems


_PLUGINS, PLUGIN_PROBLEMS = _load_plugins()
RECIPES: dict[str, Recipe] = {r.name: r for r in _BUILT_IN} | _PLUGINS


def takers(option: str) -> list[str]:
    """The recipes whose Config has `option` (`--accum` -> ['ddp_amp', 'fsdp', ...]): imports them all."""
    import dataclasses

    name = option.lstrip("-").replace("-", "_").removeprefix("no_")
    found = []
    for recipe in RECIPES.values():
        try:
            fields = dataclasses.fields(recipe.load().Config)
        except Exception:  # a plugin that does not import is not a recipe to recommend
            continue
        found += [recipe.name] if any(f.name == name for f in fields) else []
    return found

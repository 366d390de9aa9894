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
PLUGIN_GROUP = "torch_dist_recipes.plugins"  # Plugin values: a feature attached at the kernel's seams


@dataclass(frozen=True)
class Recipe:
    name: str
    module: str  # holds main(cfg) -> dict and Config (a dataclass of exactly the options it takes)
    summary: str  # what it shows: `ls` and the README's table, in markdown
    builds_on: str | None = None
    multi_node: bool = True  # False: one process drives every local device (the launcher starts one)
    opt_ins: tuple[str, ...] = ()  # the core modules it takes beyond ddp's (the base): `ls` shows them
    mean_per_replica: bool = False  # each replica's loss is its own batch's mean, and the replicas are averaged
    plugins: tuple[str, ...] = ()  # written on the kernel: the plug-ins (PLUGINS) it runs with; `cp --with` picks

    @property
    def streams(self) -> bool:
        """It reads streams (IterableDatasets) through the stream plug-in; the others refuse them before launch."""
        return "stream" in self.plugins

    def load(self) -> ModuleType:
        """The recipe's module, its Config built with its own plug-ins' option groups only (imported before by another
        path, after other recipes' plug-ins attached: built again)."""
        from core.kernel.seams import SEAMS

        attach_plugins(self)
        mine = {PLUGINS[name].module for name in plugins_of(self)}
        attached = list(SEAMS["option_groups"])  # every plug-in's, in the order they attached: other recipes' too
        SEAMS["option_groups"][:] = [group for group in attached if group.__module__ in mine]
        try:
            module = importlib.import_module(self.module)
            if any(group in attached and group not in SEAMS["option_groups"] for group in module.Config.__mro__):
                module = importlib.reload(module)
            return module
        finally:
            SEAMS["option_groups"][:] = attached + [group for group in SEAMS["option_groups"] if group not in attached]

    @property
    def source_file(self) -> str:
        return importlib.util.find_spec(self.module).origin


@dataclass(frozen=True)
class Plugin:
    name: str
    module: str  # attaches at the kernel's seams (core/kernel/seams.py) when imported
    summary: str  # what a copy without it leaves out: its header's `# Left out:` line, and the README's

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


_BUILT_IN_PLUGINS = [
    Plugin("init_from", "core.plugins.init_from", "--init-from (a new run from earlier weights)"),
    Plugin("hf", "core.plugins.hf", "the Hugging Face folder RUN/hf (--hf-attr, --hf-shard-mb)"),
    Plugin(
        "loss",
        "core.plugins.loss",
        "--loss ce, mse, model or module:function (the copy takes the model's own loss, else cross-entropy), a "
        "forward that takes its targets (nanoGPT's `targets`), a transformers `(loss, logits, ...)` tuple, and the "
        "line naming logits that do not line up with the targets",
    ),
    Plugin(
        "factories",
        "core.plugins.factories",
        "--model and --data (built-in names or module:function factories; the copy builds the lines marked "
        "`# your model` and `# your data`: edit those for your own)",
    ),
    Plugin(
        "meter",
        "core.plugins.meter",
        "the training clock: samples_per_s, tokens_per_s, startup_s and elapsed_s (the loss and accuracy stay)",
    ),
    Plugin(
        "lock",
        "core.plugins.lock",
        "the run folder's lock (RUN/.lock: two jobs that write one folder are refused) and the removal of the "
        "temporary files of a write a kill interrupted",
    ),
    Plugin("records", "core.plugins.records", "RUN/config.json and the repair of a torn last line of metrics.jsonl"),
    Plugin(
        "checks",
        "core.plugins.checks",
        "the resume checks beyond the global batch, the options and the checksums: a checkpoint of a sharded recipe, "
        "of a model of other shapes, with fp16's loss scaler on one side only, or holding NaN, inf or a negative "
        "average of squares, refused in one line",
    ),
    Plugin(
        "fast_writer",
        "core.plugins.fast_writer",
        "the hand-written safetensors writer (checkpoints go through safetensors' own, one more copy in memory)",
    ),
    Plugin(
        "old_checksums",
        "core.plugins.old_checksums",
        "the reader of the old blocksum64-crc32 checksums (checkpoints written before XXH3)",
    ),
    Plugin(
        "take_back",
        "core.plugins.take_back",
        "taking back the folder of a run refused at its start (it stays, holding train.log)",
    ),
    Plugin("replicas", "core.plugins.replicas", "the summary's replicas_identical (every rank's tensors compared)"),
    Plugin(
        "longer",
        "core.plugins.longer",
        "training on from a finished run given a larger --epochs or --max-steps (its cosine stretched over the new "
        "total); without it a finished run stays finished",
    ),
]
KERNEL_PLUGINS = tuple(p.name for p in _BUILT_IN_PLUGINS)  # what every recipe on the kernel runs with (core/attach.py)
_BUILT_IN_PLUGINS += [  # what some recipes run with: each recipe's module imports those it lists
    Plugin("trackers", "core.plugins.trackers", "--log-to tensorboard, wandb (and --wandb-project)"),
    Plugin("stream", "core.plugins.stream", "streams (an IterableDataset), read in order and dealt out by position"),
    Plugin(
        "loss_counts",
        "core.plugins.loss_counts",
        "num_items_in_batch handed to a model whose own loss divides its sum by it (transformers'): without it, that "
        "loss is weighed as a mean per micro-batch",
    ),
    Plugin(
        "comm_hook",
        "core.plugins.comm_hook",
        "--comm-hook (fp16, bf16, PowerSGD), --bucket-mb and --grad-as-bucket-view (the copy keeps DDP's own reducer)",
    ),
    Plugin("tuning", "core.plugins.tuning", "--compile, --activation-checkpointing and --channels-last"),
    Plugin("profile", "core.plugins.profile", "--profile (a torch.profiler trace of a few steps per rank)"),
    Plugin("blocks", "core.plugins.blocks", "--blocks NAME (the copy shards the repeated blocks it finds)"),
    Plugin(
        "watchdog",
        "core.plugins.watchdog",
        "the hang watchdog (--hang-factor, --hang-min-s: every rank's stack, the rank the others wait for) and --debug",
    ),
    Plugin(
        "balance",
        "core.plugins.balance",
        "--balance time (pipeline stages of equal measured time; the copy's stages hold about equal parameters)",
    ),
    Plugin(
        "model_plans",
        "core.plugins.model_plans",
        "a model's own tensor-parallel plan (a transformers Llama, Qwen, Mistral: config.base_model_tp_plan; the "
        "copy splits the built-in GPT's layout alone)",
    ),
]

_BUILT_IN = [
    Recipe(
        "ddp",
        "recipes.ddp",
        "`DistributedDataParallel`: the base every other recipe builds on",
        mean_per_replica=True,
        plugins=KERNEL_PLUGINS,
    ),
    Recipe(
        "ddp_amp",
        "recipes.ddp_amp",
        "autocast (bf16/fp16), GradScaler, accumulation with `no_sync`, clipping, streams",
        builds_on="ddp",
        opt_ins=("accum", "amp", "exact_loss"),
        plugins=(*KERNEL_PLUGINS, "trackers", "stream", "loss_counts"),
    ),
    Recipe(
        "ddp_monitored",
        "recipes.ddp_monitored",
        "step-time breakdown, MFU, hang watchdog, profiler, comm hooks, compile, async checkpoints",
        builds_on="ddp",
        opt_ins=("ckpt_async", "monitor"),
        mean_per_replica=True,
        plugins=(*KERNEL_PLUGINS, "trackers", "comm_hook", "tuning", "profile", "watchdog"),
    ),
    Recipe(
        "dp",
        "recipes.dp",
        "`nn.DataParallel` in one process (plain training with fewer than 2 GPUs)",
        builds_on="ddp",
        multi_node=False,
        mean_per_replica=True,  # where the model computes its loss: each GPU's replica returns its mean
        plugins=KERNEL_PLUGINS,
    ),
    Recipe(
        "fsdp",
        "recipes.fsdp",
        "FSDP2 `fully_shard` per block, sharded checkpoints, bf16, CPU offload",
        builds_on="ddp_amp",
        opt_ins=("shard", "mesh", "shard_ckpt", "accum", "exact_loss", "gpt_builtin"),
        plugins=(*KERNEL_PLUGINS, "trackers", "stream", "loss_counts", "blocks"),
    ),
    Recipe(
        "tensor_parallel",
        "recipes.tensor_parallel",
        "column/row splits of each block's Linear layers (DTensor), from the model's own plan",
        builds_on="fsdp",
        opt_ins=("mesh", "shard_ckpt", "tp_plan", "sp_plan", "accum", "exact_loss", "gpt_builtin"),
        plugins=(*KERNEL_PLUGINS, "trackers", "stream", "loss_counts", "model_plans"),
    ),
    Recipe(
        "fsdp_tp",
        "recipes.fsdp_tp",
        "2-D mesh: tensor parallel within groups of `--tp` ranks, FSDP2 across them",
        builds_on="fsdp",
        opt_ins=("shard", "mesh", "shard_ckpt", "tp_plan", "accum", "exact_loss", "gpt_builtin"),
        plugins=(*KERNEL_PLUGINS, "trackers", "stream", "loss_counts", "blocks", "model_plans"),
    ),
    Recipe(
        "pipeline",
        "recipes.pipeline",
        "`torch.distributed.pipelining`: GPipe, 1F1B, interleaved; pipeline x data parallel",
        builds_on="ddp_amp",
        opt_ins=("gpt_builtin", "pipeline", "schedules", "shard_ckpt"),
        plugins=(*KERNEL_PLUGINS, "trackers", "balance"),
    ),
    Recipe(
        "pipeline_naive",
        "recipes.pipeline_naive",
        "model parallel by hand: stages on devices, one process, one device busy at a time",
        builds_on="dp",
        multi_node=False,
        opt_ins=("gpt_builtin", "pipeline"),
        plugins=KERNEL_PLUGINS,
    ),
]


def _load_entries(group: str, kind: type) -> tuple[dict, list[str]]:
    found, problems = {}, []
    for ep in entry_points(group=group):
        try:
            entry = ep.load()
            if not isinstance(entry, kind):
                raise TypeError(f"it is a {type(entry).__name__}, not a tools.registry.{kind.__name__}")
            found[entry.name] = entry
        except Exception as err:  # a broken plugin must not take the built-in recipes down with it
            problems.append(f"{kind.__name__.lower()} plugin {ep.name!r} ({ep.value}) failed to load: {err}")
    return found, problems


_RECIPE_ENTRIES, _RECIPE_PROBLEMS = _load_entries(ENTRY_POINT_GROUP, Recipe)
_PLUGIN_ENTRIES, _PLUGIN_PROBLEMS = _load_entries(PLUGIN_GROUP, Plugin)
PLUGIN_PROBLEMS = _RECIPE_PROBLEMS + _PLUGIN_PROBLEMS
RECIPES: dict[str, Recipe] = {r.name: r for r in _BUILT_IN} | _RECIPE_ENTRIES
# The plug-ins, built in and a third party's (PLUGIN_GROUP): `run` attaches them before it loads a recipe; `cp --with`.
PLUGINS: dict[str, Plugin] = {p.name: p for p in _BUILT_IN_PLUGINS} | _PLUGIN_ENTRIES


def plugins_of(recipe: Recipe) -> list[str]:
    """The plug-ins the package runs `recipe` with, a third party's too: none for a recipe not on the kernel."""
    return [*recipe.plugins, *(name for name in _PLUGIN_ENTRIES if recipe.plugins)]


def attach_plugins(recipe: Recipe) -> None:
    """Import them (the built-in ones also attach when the recipe's module imports core.plugins)."""
    for name in plugins_of(recipe):
        PLUGINS[name].load()


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

"""Features a standalone copy carries on request: `python -m recipes cp ddp train.py --standalone --with hf`.

A feature is the options that steer it (Config fields, or whole option groups) and the core code only it calls.
Left out, the generator takes out of the recipe and of every core function it inlines:
  - each statement that touches the feature alone (reads one of its options, calls its code, reads or sets an
    attribute only it has, such as `meter.clock`, or uses a name such a statement bound), with the `if`/`for`
    whose condition is the feature's;
  - the `with` whose context is the feature's, keeping its body;
  - its option group among the Config's bases, and its fields where a Config declares them again;
  - a build call the feature steers (`models.build_model(cfg.model)`) becomes the recipe's default, called
    directly (`mlp()`): the line the owner edits for their own model.
A statement that touches two features, or a feature and the function's result, is refused (StandaloneError
naming the line): the split is the code's to make, never the generator's to guess.
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys
import types
from dataclasses import dataclass

from tools.inline_refs import RECIPE, StandaloneError, line_offsets


@dataclass(frozen=True)
class Feature:
    name: str
    says: str  # what a copy without it lacks, for its header
    groups: tuple[str, ...] = ()  # option groups (module.Class) that are the feature's alone
    fields: tuple[str, ...] = ()  # more options of the feature, declared in a shared group
    calls: tuple[str, ...] = ()  # core code only the feature calls: module.name, or `module.` for all of it
    # (call, option, what replaces it ({}: the default's function), the comment its line gets)
    builds: tuple[tuple[str, str, str, str], ...] = ()
    swaps: tuple[tuple[str, str], ...] = ()  # (module.name, module.name): what a copy without it calls instead
    attrs: tuple[str, ...] = ()  # attributes only the feature reads or sets (`meter.clock`), wherever they are
    uses: str = ""  # a feature without options: the core module (core.tp_plan) whose recipes alone have it; "": all

    def options(self) -> set[str]:
        found = set(self.fields)
        for group in self.groups:
            module, _, name = group.rpartition(".")
            found |= set(getattr(importlib.import_module(module), name).__dict__.get("__annotations__", {}))
        return found


FEATURES = {
    f.name: f
    for f in (
        Feature(
            "init_from",
            "--init-from (a new run from earlier weights)",
            groups=("core.plugins.init_from.InitFrom",),
            calls=("core.plugins.init_from.load_weights",),
        ),
        Feature(
            "hf",
            "the Hugging Face folder RUN/hf (--hf-attr, --hf-shard-mb)",
            ("core.plugins.hf.HFExport",),
            (),
            ("core.plugins.hf.",),
        ),
        Feature(
            "trackers",
            "--log-to tensorboard or wandb",
            ("core.trackers.Tracking",),
            (),
            ("core.trackers.",),
            attrs=("sinks",),  # the run's record sinks (core.records.RunFolder): only trackers adds any
        ),
        Feature(
            "loss",
            "--loss ce, mse, model or module:function (the copy takes auto: the model's own loss, else cross-entropy), "
            "a transformers `(loss, logits, ...)` tuple (return_dict=False), and the line naming logits that do not "
            "line up with the targets (torch's shape error instead)",
            fields=("loss",),
            calls=("core.loss_options.", "core.loss.check_aligned"),
        ),
        Feature(
            "fast_writer",
            "the hand-written safetensors writer (checkpoints go through safetensors' own, one more copy of the "
            "tensors in memory)",
            swaps=(("core.plugins.fast_writer.write_fast", "core.kernel.ckpt.write_plain"),),
        ),
        Feature(
            "old_checksums",
            "the reader of the old blocksum64-crc32 checksums (checkpoints written before XXH3)",
            calls=("core.plugins.old_checksums.OLD_PREFIX", "core.plugins.old_checksums.blocksum64_crc32"),
        ),
        Feature(
            "lock",
            "the run folder's lock (RUN/.lock): two jobs that write one run folder are not refused, and the temporary "
            "files of a write a kill interrupted are left in it",
            calls=("core.plugins.lock.take_lock", "core.plugins.lock.remove_stale_temporaries"),
        ),
        Feature(
            "records",
            "RUN/config.json and the repair of a torn last line of metrics.jsonl (a kill mid-write)",
            calls=("core.plugins.records.write_config", "core.plugins.records.repair_records"),
        ),
        Feature(
            "checks",
            "the resume checks beyond those every copy makes (the global batch, the options that shape training, "
            "the checksums): a checkpoint of a sharded recipe, of a model of other shapes, with fp16's loss scaler on "
            "one side only, or holding NaN, inf or a negative average of squares, is not refused in one line (torch's "
            "own error, or none); a torch.save file is said to be unreadable",
            calls=(
                "core.folder.check_layout",
                "core.ckpt.check_shapes",
                "core.dcp.check_shapes",
                "core.dcp._check_saved",
                "core.dcp_folder.non_finite",
                "core.ckpt_io.check_values",
                "core.ckpt.refuse_pickle",
            ),
        ),
        Feature(
            "meter",
            "the training clock: samples_per_s, tokens_per_s, startup_s and elapsed_s (the loss and accuracy stay)",
            calls=("core.meter.Clock", "core.meter.paused"),
            attrs=("clock",),
        ),
        Feature(
            "factories",
            "--model and --data (built-in names or module:function factories; the copy builds its default model and "
            "data where the lines marked `# your model` and `# your data` are: edit those for your own)",
            fields=("model", "data"),
            builds=(
                ("core.models.build_model", "model", "{}()", "your model: any nn.Module"),
                ("core.data.build_data", "data", "(*{}(), None)[:3]", "your data: (train, val[, collate_fn])"),
            ),
        ),
        Feature(
            "tuning",
            "--activation-checkpointing and --channels-last",
            fields=("activation_checkpointing", "channels_last"),
            calls=("core.tuning.to_channels_last", "core.tuning.checkpoint_blocks", "__recipe__.meta_model"),
        ),
        Feature(
            "comm_hook",
            "--comm-hook (fp16, bf16 or PowerSGD gradient compression; DDP's own all-reduce stays)",
            fields=("comm_hook",),
            calls=("core.comm.register", "core.comm.check_hook"),
        ),
        Feature(
            "stream",
            "streaming data (an IterableDataset, read in order and dealt out by position: core/stream.py); the copy "
            "takes map-style data sets",
            # what reads a stream; core.stream.in_step stays: the sharded recipes evaluate map-style data through it
            calls=tuple(f"core.stream.{n}" for n in ("is_stream", "make_loader", "total_steps", "StreamLoader")),
            uses="core.stream",
        ),
        Feature(
            "model_plans",
            "a transformers model's own tensor-parallel plan (Llama, Qwen, Mistral: core/tp_plan.py); the copy splits "
            "the built-in GPT's layout and refuses another model in one line",
            calls=("core.tp_plan.",),
            swaps=(
                ("core.tp_plan.plan_of", "core.parallel.gpt_tp_plan"),
                ("core.tp_plan.check_tp_plan", "core.parallel.check_tp"),
            ),
            uses="core.tp_plan",
        ),
        Feature(
            "profile",
            "--profile (a torch.profiler trace per rank)",
            fields=("profile",),
            calls=("core.monitor.profiler",),
        ),
        Feature(
            "take_back",
            "taking back the folder of a run refused at its start (a damaged checkpoint, a non-finite first loss): it "
            "stays, holding train.log, and --resume auto takes it as the newest run (and says it starts a new one)",
            calls=("core.plugins.take_back.take_back",),
        ),
        Feature(
            "loss_counts",
            "handing a forward that takes num_items_in_batch the global batch's count (transformers' way): the copy "
            "weighs the model's own mean loss by its micro-batch's counted targets, the same sum up to rounding where "
            "that mean is over those targets",
            calls=tuple(
                f"core.exact_loss.{n}" for n in ("_takes_count", "_forward_traits", "_own_counts", "_forward_own")
            ),
            uses="core.exact_loss",
        ),
        Feature(
            "balance",
            "--balance time (pipeline stages of equal measured time; the copy's stages hold about equal parameters)",
            fields=("balance",),
            calls=("core.pipeline.block_times",),
        ),
        Feature(
            "digits_file",
            "reading the built-in digits straight from scikit-learn's file, without importing sklearn (a copy that "
            "trains on them calls sklearn's load_digits: about a second more at each start)",
            swaps=(("core.datasets._digits_table", "core.datasets.sklearn_digits"),),
            uses="core.steps",  # the recipes whose default data is digits import it (and pipeline_naive)
        ),
        Feature(
            "blocks",
            "--blocks (the nn.ModuleList to shard block by block, named; the copy shards the repeated blocks it finds)",
            fields=("blocks",),
            calls=("core.parallel.named_blocks",),
        ),
    )
}


def features_of(config: type) -> list[str]:
    """The features a recipe's Config has: those whose options it takes, and those with none (every recipe's)."""
    fields, imported = set(config.__dataclass_fields__), vars(sys.modules[config.__module__]).values()
    modules = {value.__name__ for value in imported if isinstance(value, types.ModuleType)}
    return [
        name
        for name, f in FEATURES.items()
        if f.options() & fields or not (f.options() or f.builds) and (f.uses in modules or not f.uses)
    ]


def parse_with(spec: str, *, config: type) -> set[str]:
    """`--with a,b` (or `all`) -> the features kept; a name this recipe has no feature of is one line."""
    have = features_of(config)
    asked = {w.strip() for w in spec.split(",") if w.strip()}
    if "all" in asked:
        return set(have)
    unknown = sorted(asked - set(have))
    if unknown:
        raise StandaloneError(f"--with {','.join(unknown)}: choose from all, {', '.join(have)}")
    return asked


# --- taking features out of a module's source -----------------------------------------------------------------


def drop_features(source: bytes, *, module: str, off: set[str], defaults: dict[str, tuple[str, str]]) -> bytes:
    """`source` (module `module`) without the features in `off`; `defaults`: option -> (module, function) of the
    built-in a replaced build call names. A statement mixing features is a StandaloneError."""
    off = {f for f in off if any(token.encode() in source for token in _tokens(f))}  # the others cannot touch it
    if not off:
        return source
    return _drop(source, module, frozenset(off), tuple(sorted(defaults.items())))


@functools.cache  # FEATURES is a constant: one set per feature, not one per module of every copy
def _tokens(name: str) -> frozenset[str]:
    """Every name through which feature `name` can touch a module's source (a conservative test: a feature none of
    whose names occurs in a source leaves it as it is)."""
    f = FEATURES[name]
    dotted = [*f.calls, *f.groups, *(old for old, _ in f.swaps), *(call for call, *_ in f.builds)]
    return frozenset({*f.options(), *f.attrs, *(d.rstrip(".").rpartition(".")[2] for d in dotted)})


@functools.lru_cache(maxsize=512)  # the copies of one run of the tests share most modules' results
def _drop(source: bytes, module: str, off: frozenset[str], defaults: tuple) -> bytes:
    tree = ast.parse(source)
    defaults = dict(defaults)
    pass_ = _Drop(source, module=module, tree=tree, off=set(off), defaults=defaults)
    for node in tree.body:
        own = any(_matches(f"{module}.{getattr(node, 'name', '')}", FEATURES[f].calls) for f in off)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not own:
            pass_.function(node)
        elif own and module == RECIPE:  # a recipe's helper for the feature alone; core's own code is not inlined
            pass_.cut(node)
        elif isinstance(node, ast.ClassDef):
            pass_.klass(node)
    if pass_.imports:  # the defaults a build call now names, imported after the module's last top-level import
        last = max((n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))), default=0)
        added = "".join(f"from {m} import {f}\n" for m, f in sorted(pass_.imports))
        pass_.edits.append((pass_.starts[last], pass_.starts[last], added))
    return _apply(source, pass_.edits)


def _apply(source: bytes, edits: list[tuple[int, int, str]]) -> bytes:
    """`edits` (begin, end, new text) applied; one inside a statement taken out whole goes with it."""
    kept: list[tuple[int, int, str]] = []
    for begin, end, new in sorted(set(edits), key=lambda e: (e[0], -e[1])):
        if kept and end <= kept[-1][1] and begin < kept[-1][1]:
            continue
        if kept and begin < kept[-1][1]:
            raise StandaloneError("overlapping feature edits (a bug in tools/features.py)")
        kept.append((begin, end, new))
    for begin, end, new in reversed(kept):
        source = source[:begin] + new.encode() + source[end:]
    return source


class _Drop:
    def __init__(self, source: bytes, *, module: str, tree: ast.Module, off: set[str], defaults: dict):
        self.source, self.module, self.off, self.defaults = source, module, off, defaults
        self.starts = line_offsets(source)
        self.edits: list[tuple[int, int, str]] = []
        self.imports: set[tuple[str, str]] = set()
        self.names = _qualified_names(tree, module)
        self.options = {f: FEATURES[f].options() for f in FEATURES}
        self.replaced: set[int] = set()  # ids of build calls replaced by their default
        self.dropped: list[ast.stmt] = []

    def at(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def where(self, node) -> str:
        return f"{self.module.replace('__recipe__', 'the recipe')} line {node.lineno}"

    # what a node touches

    def qualname(self, node) -> str | None:
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def touches(self, nodes, tainted: dict[str, str]) -> set[str]:
        found, todo = set(), list(nodes)
        while todo:
            node = todo.pop()
            if id(node) in self.replaced:
                continue
            if isinstance(node, ast.Call) and self._build(node) or self._swap(node):
                continue
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in tainted:
                found.add(tainted[node.id])
            if isinstance(node, (ast.Name, ast.Attribute)) and (q := self.qualname(node)):
                found |= {
                    f.name
                    for f in FEATURES.values()
                    if any(q == c or c.endswith(".") and q.startswith(c) for c in f.calls)
                }
                found |= {f.name for f in FEATURES.values() if q in f.groups}
            if isinstance(node, ast.Attribute):
                found |= {f.name for f in FEATURES.values() if node.attr in f.attrs}
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cfg":
                found |= {f for f, options in self.options.items() if node.attr in options}
            todo.extend(ast.iter_child_nodes(node))
        return found

    def _build(self, call: ast.Call) -> bool:
        """A build call a left-out feature steers becomes its default: `mlp()` for `models.build_model(cfg.model)`."""
        q = self.qualname(call.func)
        for feature in (FEATURES[f] for f in self.off):
            for target, option, form, note in feature.builds:
                if q == target and option in self.defaults:
                    module, function = self.defaults[option]
                    self.imports.add((module, function))
                    begin, end = self.at(call.lineno, call.col_offset), self.at(call.end_lineno, call.end_col_offset)
                    self.edits.append((begin, end, form.format(function)))
                    line_end = self.starts[call.end_lineno] - 1  # its newline
                    if b"#" not in self.source[end:line_end]:  # the line the owner edits says so
                        self.edits.append((line_end, line_end, f"  # {note}"))
                    self.replaced.add(id(call))
                    return True
        return False

    def _swap(self, node) -> bool:
        """A reference a left-out feature swaps for another name (write_safetensors -> write_plain)."""
        if not isinstance(node, (ast.Name, ast.Attribute)) or not isinstance(node.ctx, ast.Load):
            return False
        q = self.qualname(node)
        for feature in (FEATURES[f] for f in self.off):
            for old, new in feature.swaps:
                if q == old:
                    module, _, name = new.rpartition(".")
                    if module != self.module:
                        self.imports.add((module, name))
                    begin = self.at(node.lineno, node.col_offset)
                    self.edits.append((begin, self.at(node.end_lineno, node.end_col_offset), name))
                    self.replaced.add(id(node))
                    return True
        return False

    # statements

    def block(self, body: list[ast.stmt], tainted: dict[str, str]) -> None:
        dropped = 0
        for stmt in body:
            dropped += self.statement(stmt, tainted)
        if dropped == len(body):
            raise StandaloneError(
                f"{self.where(body[0])}: every statement of this block is a feature's; move the block"
            )

    def statement(self, stmt: ast.stmt, tainted: dict[str, str]) -> bool:
        """Take `stmt` out (True), unwrap it, or go into its blocks."""
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.function(stmt)
            return False
        if isinstance(stmt, ast.ClassDef):
            self.klass(stmt)
            return False
        blocks = [b for b in _blocks(stmt) if b]
        header = _header(stmt) if blocks else [stmt]
        mine = self.touches(header, tainted)
        if len(mine) > 1 and mine & self.off:
            raise StandaloneError(f"{self.where(stmt)}: one statement mixes the features {', '.join(sorted(mine))}")
        feature = next(iter(mine), None)
        if feature is None or feature not in self.off:
            for block in blocks:
                self.block(block, tainted)
            return False
        if isinstance(stmt, (ast.With, ast.AsyncWith)):  # its body stays, one level out (a yield in it too)
            self._unwrap(stmt, stmt.body)
            self.block(stmt.body, tainted)
            return False
        if isinstance(stmt, (ast.Return, ast.Raise)) or any(
            isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(stmt)
        ):
            raise StandaloneError(f"{self.where(stmt)}: the feature {feature} is part of what the function returns")
        if isinstance(stmt, ast.If) and _plain_else(stmt, self.source, self.starts):  # the other branch stays
            if self.touches(stmt.body, tainted) - {feature} - self.off:
                raise StandaloneError(f"{self.where(stmt)}: the branch of feature {feature} holds another one's code")
            self._unwrap(stmt, stmt.orelse)
            self.block(stmt.orelse, tainted)
            return False
        if getattr(stmt, "orelse", None) or getattr(stmt, "handlers", None):
            raise StandaloneError(f"{self.where(stmt)}: the feature {feature} steers a statement with another branch")
        others = self.touches([stmt], tainted) - {feature}
        if others:
            raise StandaloneError(
                f"{self.where(stmt)}: one statement mixes the features {', '.join(sorted(others | {feature}))}"
            )
        read = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        for node in ast.walk(stmt):  # names it bound are the feature's from here (`run = attach(run)`: still run)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in read:
                tainted[node.id] = feature
        self.cut(stmt)
        return True

    def cut(self, stmt: ast.stmt) -> None:
        self.dropped.append(stmt)
        self.edits.append((self.starts[stmt.lineno - 1], self.starts[stmt.end_lineno], ""))

    def function(self, node) -> None:
        """Its blocks; then an assignment whose name only taken-out statements read goes too (the model a
        Hugging Face folder borrows its config from), with the `with` it alone makes up."""
        before = len(self.dropped)
        self.block(node.body, {})
        gone = {id(n) for s in self.dropped[before:] for n in ast.walk(s)}
        if not gone:
            return
        loads = {}
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                loads.setdefault(n.id, []).append(id(n) in gone)
        parents = {id(s): outer for outer in ast.walk(node) for b in _blocks(outer) for s in b}
        for stmt in [s for s in ast.walk(node) if isinstance(s, ast.Assign) and id(s) not in gone]:
            names = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
            if len(names) == len(stmt.targets) and all(loads.get(n) and all(loads[n]) for n in names):
                outer = parents.get(id(stmt))
                whole = isinstance(outer, (ast.With, ast.AsyncWith)) and len(outer.body) == 1
                self.cut(outer if whole else stmt)

    def _unwrap(self, stmt: ast.stmt, body: list[ast.stmt]) -> None:
        """`stmt` -> its `body` alone, one level out: a feature's `with` keeps its body, a feature's `if` its `else`
        branch (everything from the `if` line to that branch's first statement goes)."""
        first = body[0]
        self.edits.append((self.starts[stmt.lineno - 1], self.starts[first.lineno - 1], ""))
        indent = first.col_offset - stmt.col_offset
        for line in range(first.lineno, stmt.end_lineno + 1):
            text = self.source[self.starts[line - 1] : self.starts[line]]
            if text[:indent] == b" " * indent:
                self.edits.append((self.starts[line - 1], self.starts[line - 1] + indent, ""))

    def klass(self, node: ast.ClassDef) -> None:
        """A left-out group among the bases goes, and the fields of a left-out feature a class declares: its options,
        and a field with a default that only the feature reads (its `attrs`)."""
        kept = [b for b in node.bases if not any(self.qualname(b) in FEATURES[f].groups for f in self.off)]
        if len(kept) < len(node.bases):  # the bases written again without those
            first, last = node.bases[0], node.bases[-1]
            text = ", ".join(ast.get_source_segment(self.source.decode(), b) for b in kept)
            begin, end = self.at(first.lineno, first.col_offset), self.at(last.end_lineno, last.end_col_offset)
            self.edits.append((begin, end, text))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                name, value = stmt.target.id, stmt.value
                option = isinstance(value, ast.Call) and self.qualname(value.func) in _DECLARE
                owners = [self.options[f] if option else FEATURES[f].attrs for f in self.off]
                if any(name in names for names in owners):  # an option of a left-out group, or `sinks`
                    self.edits.append((self.starts[stmt.lineno - 1], self.starts[stmt.end_lineno], ""))
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.function(stmt)


_DECLARE = ("core.kernel.options.option", "core.config.with_default")  # how an option is declared: only those fields go


def _matches(name: str, calls: tuple[str, ...]) -> bool:
    """`name` is one of `calls`, or in a module `calls` names whole (`core.hf.`)."""
    return any(name == c or c.endswith(".") and name.startswith(c) for c in calls)


def _plain_else(stmt: ast.If, source: bytes, starts: list[int]) -> bool:
    """An `if` with an `else:` branch (not an `elif`)."""
    if not stmt.orelse:
        return False
    line = stmt.orelse[0].lineno
    return not source[starts[line - 1] : starts[line]].lstrip().startswith(b"elif")


def _blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    blocks = [getattr(stmt, name, None) for name in ("body", "orelse", "finalbody")]
    blocks += [h.body for h in getattr(stmt, "handlers", [])]
    blocks += [c.body for c in getattr(stmt, "cases", [])]
    return [b for b in blocks if isinstance(b, list)]


def _header(stmt: ast.stmt) -> list[ast.AST]:
    """The expressions of a compound statement that are not its blocks."""
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return list(stmt.items)
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        return [stmt.target, stmt.iter]
    if isinstance(stmt, (ast.If, ast.While)):
        return [stmt.test]
    if isinstance(stmt, ast.Match):
        return [stmt.subject]
    if isinstance(stmt, ast.Try):
        return [h.type for h in stmt.handlers if h.type]
    return []


def _qualified_names(tree: ast.Module, module: str) -> dict[str, str]:
    """Top-level name -> what it is (`hf` -> core.hf, `say` -> core.records.say, a def -> module.def)."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {
                a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0] for a in node.names
            }
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = f"{module}.{node.name}"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):  # module constants (_OLD_PREFIX)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id: f"{module}.{t.id}" for t in targets if isinstance(t, ast.Name)}
    return names


def builtin_defaults(cfg) -> dict[str, tuple[str, str]]:
    """The recipe's default model and data as (module, function): what a copy without factories builds."""
    from core.data import DATASETS
    from core.models import MODELS

    found = {}
    for option, table in (("model", MODELS), ("data", DATASETS)):
        spec = table.get(getattr(cfg, option, None), "")
        if ":" in spec:
            found[option] = tuple(spec.split(":"))
    return found

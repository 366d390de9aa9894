"""The standalone inliner, part 2: load modules, follow references from the recipe, name and order
the definitions it needs (see tools/standalone.py for the whole story)."""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tools.inline_refs import (
    _RESERVED,
    RECIPE,
    Chunk,
    Module,
    Ref,
    StandaloneError,
    _inlined,
    _is_main_guard,
    _RefCollector,
    _scope_bindings,
)


def _key(target: tuple) -> tuple:
    return target[:3] if target[0] == "def" else ("ext", *target[1])


class _Inliner:
    """Loads modules, follows references from the recipe, names and orders what it found."""

    def __init__(
        self,
        packages: tuple[str, ...],
        *,
        keep_builtins: dict[str, str] | None = None,
        drop=lambda name, source: source,
    ):
        self.packages, self.keep_builtins, self.drop = packages, keep_builtins or {}, drop
        self.modules: dict[str, Module] = {}
        self.package_of: dict[str, bool] = {}
        self.included: dict[tuple[str, int], Chunk] = {}
        self.discovered: dict[tuple, str] = {}  # key -> the name it had where it was first seen (ordered)
        self.refs_by_key: dict[tuple, list[Ref]] = {}
        self.contributing: list[str] = []  # inlined modules, in the order they were first needed
        self.submodules: dict[tuple, set[str]] = {}  # ("ext", "import", "a") -> {"a.b.c"}: `import a.b.c`
        self.analyses: dict[str, _Analysis] = {}  # module -> what its source says (shared by every copy)

    # --- reading modules -------------------------------------------------------------------

    def load(self, name: str, source: bytes | None = None) -> Module:
        if name in self.modules:
            return self.modules[name]
        is_package = False
        if source is None:
            spec = importlib.util.find_spec(name)
            if spec is None or not (spec.origin or "").endswith(".py"):
                raise StandaloneError(f"cannot find the Python source of {name} to inline it")
            source, is_package = Path(spec.origin).read_bytes(), spec.origin.endswith("__init__.py")
            source = self.drop(name, _keep_builtins(name, source, self.keep_builtins))  # features left out
        analysis = _analyse(name, source, self.packages, is_package)
        module = Module(
            name,
            source,
            analysis.tree,
            globals=dict(analysis.globals),
            chunks=[Chunk(name, i, node, set(binds), gap=gap) for i, (node, binds, gap) in enumerate(analysis.chunks)],
            defines={bound: list(at) for bound, at in analysis.defines.items()},
            imports=set(analysis.imports),
            future=analysis.future,
            header_end=analysis.header_end,
        )
        self.modules[name], self.package_of[name], self.analyses[name] = module, is_package, analysis
        for key, submodule in analysis.submodules:
            self.submodules.setdefault(key, set()).add(submodule)
        return module

    def resolve(self, target: tuple) -> tuple:
        """Follow `from core.x import y` (and re-exports) to a definition, an outside import or a module."""
        while target[0] == "ref":
            _, source, name = target
            module = self.load(source)
            if name in module.globals:
                target = module.globals[name]
            elif self.package_of[source] and importlib.util.find_spec(f"{source}.{name}"):
                target = ("mod", f"{source}.{name}")
            else:
                raise StandaloneError(f"{source} has no {name!r} (is the recipe up to date with core?)")
        return target

    # --- following references --------------------------------------------------------------

    def include_recipe(self, recipe: Module) -> None:
        queue = [key for chunk in recipe.chunks for key in self._include(chunk)]
        while queue:
            _, source, name = queue.pop(0)
            if source == RECIPE:  # the recipe's own statements are all in already
                continue
            module = self.load(source)
            fresh = [] if source in self.contributing else [c for c in module.chunks if not c.binds]
            if source not in self.contributing:  # what a module does when imported happens here too
                self.contributing.append(source)
            for chunk in fresh + [module.chunks[i] for i in module.defines[name]]:
                queue += self._include(chunk)

    def _include(self, chunk: Chunk) -> list[tuple]:
        if (chunk.module, chunk.index) in self.included:
            return []
        self.included[(chunk.module, chunk.index)] = chunk
        chunk.refs, chunk.removals = self._collect(chunk)
        new = []
        for ref in chunk.refs:
            key = _key(ref.target)
            self.refs_by_key.setdefault(key, []).append(ref)
            if key not in self.discovered:
                self.discovered[key] = ref.target[2]
                if key[0] == "def":
                    new.append(key)
        return new

    def _collect(self, chunk: Chunk) -> tuple[list[Ref], list[ast.stmt]]:
        """The statement's references and its lazy core imports. The walk is most of a copy's time, and copies walk
        the same statements of the same sources again and again: a walk is kept with its module's analysis, with
        every answer of `resolve` it was found under, and taken again where `resolve` gives each of those answers
        (asked in the walk's order, so that modules load in the same order): what a new walk would find."""
        collected = self.analyses[chunk.module].collected
        walk = collected.get(chunk.index)
        if walk is None or any(self.resolve(target) != answer for target, answer in walk[0].items()):
            asked = {}

            def resolve(target: tuple) -> tuple:
                asked[target] = answer = self.resolve(target)
                return answer

            collector = _RefCollector(self.modules[chunk.module], resolve, self.packages)
            collector.visit(chunk.node)
            walk = collected[chunk.index] = (
                asked,
                collector.refs,
                list({id(s): s for s in collector.removals}.values()),
            )
        _, refs, removals = walk
        return [Ref(r.node, r.target, r.shadow, r.at_import) for r in refs], list(removals)

    # --- naming and ordering -----------------------------------------------------------------

    def names(self, recipe: Module) -> dict[tuple, str]:
        """key -> its name in the file: the recipe's own names stay, the rest avoid every clash."""
        taken, names = {}, {}
        for name, target in recipe.globals.items():
            if target[0] in ("def", "ext"):
                taken[name] = names[_key(target)] = name
        for key, preferred in self.discovered.items():
            if key in names:
                continue
            fixed = key[:2] == ("ext", "import") and key in self.submodules
            for candidate in [preferred] if fixed else self._candidates(key, preferred):
                refs = self.refs_by_key[key]
                if (
                    candidate not in taken
                    and candidate not in _RESERVED
                    and all(candidate not in r.shadow for r in refs)
                ):
                    break
            else:
                raise StandaloneError(f"cannot give {'.'.join(key[1:])} a name that clashes with nothing")
            taken[candidate] = names[key] = candidate
        for chunk in self.included.values():  # names a statement binds that nothing uses still take a name
            for bound in sorted(chunk.binds):
                key = ("def", chunk.module, bound)
                if key not in names:
                    names[key] = next(c for c in self._candidates(key, bound) if c not in taken and c not in _RESERVED)
                    taken[names[key]] = key
        return names

    @staticmethod
    def _candidates(key: tuple, preferred: str) -> Iterator[str]:
        yield preferred
        short = key[1].rsplit(".", 1)[-1] if key[0] == "def" else key[2].split(".")[-1]
        base = f"_{short}{preferred}" if preferred.startswith("_") else f"{short}_{preferred}"
        yield base
        for i in range(2, 100):
            yield f"{base}_{i}"

    def ordered_chunks(self, *, first: tuple[str, ...] = ()) -> list[Chunk]:
        """Inlined statements: the modules `first` names, then module by module (a module after those it imports),
        each in source order; a statement that needs another one when it runs (decorators, bases, defaults) waits
        for it, and a module, once begun, goes on while it has statements ready."""
        order = self._module_order()
        rank = {m: i for i, m in enumerate([m for m in first if m in order] + [m for m in order if m not in first])}
        chunks = sorted(
            (c for c in self.included.values() if c.module != RECIPE), key=lambda c: (rank[c.module], c.index)
        )
        position = {(c.module, c.index): i for i, c in enumerate(chunks)}
        needs = {i: set() for i in range(len(chunks))}
        for i, chunk in enumerate(chunks):
            for ref in chunk.refs:
                if ref.at_import and ref.target[0] == "def":
                    _, source, name = ref.target
                    needs[i] |= {position[(source, j)] for j in self.modules[source].defines[name]} - {i}
        ready, done, out = [i for i in needs if not needs[i]], set(), []
        while ready:
            current = out[-1].module if out else None
            i = min(ready, key=lambda j: (chunks[j].module != current, j))  # the module begun, else the first
            ready.remove(i)
            out.append(chunks[i])
            done.add(i)
            for j, need in needs.items():
                if i in need:
                    need.discard(i)
                    if not need and j not in done:
                        ready.append(j)
        if len(out) != len(chunks):
            raise StandaloneError("the inlined definitions need each other at import time (a cycle)")
        return out

    def _module_order(self) -> list[str]:
        order, seen = [], set()

        def visit(name: str) -> None:
            if name in seen:
                return
            seen.add(name)
            for dep in sorted(self.modules[name].imports):
                if dep in self.modules:
                    visit(dep)
            if name in self.contributing:
                order.append(name)

        for name in self.contributing:
            visit(name)
        return order


# --- what a module's source says, kept for every copy that inlines the same source ------------------------------


@dataclass
class _Analysis:
    """A module's tree and top-level statements, as its source alone gives them (no other module is read), and the
    per-statement walks of _Inliner._collect, each with the answers of `resolve` it was found under."""

    tree: ast.Module
    globals: dict[str, tuple]
    chunks: list[tuple[ast.stmt, frozenset[str], int]]  # (node, the names it binds, gap) of each Chunk
    defines: dict[str, list[int]]
    imports: frozenset[str]
    future: bool
    header_end: int
    submodules: list[tuple[tuple, str]]  # (("ext", "import", "a"), "a.b.c") for each `import a.b.c`
    collected: dict[int, tuple[dict, list[Ref], list[ast.stmt]]] = field(default_factory=dict)


# (name, source, packages, is_package) -> its analysis. The copies a run of the tests makes (130 and more) inline
# the same few dozen sources again and again; keyed on the source, an entry is right for every copy that has it.
_ANALYSES: dict[tuple, _Analysis] = {}


def _analyse(name: str, source: bytes, packages: tuple[str, ...], is_package: bool) -> _Analysis:
    key = (name, source, packages, is_package)
    if key in _ANALYSES:
        return _ANALYSES[key]
    module, submodules = Module(name, source, ast.parse(source)), []
    previous_end = 0
    for index, node in enumerate(module.tree.body):
        gap, previous_end = previous_end + 1, node.end_lineno
        if index == 0 and isinstance(node, ast.Expr) and isinstance(getattr(node.value, "value", None), str):
            module.header_end = node.end_lineno
        elif isinstance(node, ast.ImportFrom) and node.module == "__future__":
            module.future |= any(a.name == "annotations" for a in node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            _index_import(module, node, packages, is_package, submodules)
        elif name.startswith("core.plugins.") and _attaches_elsewhere(node):
            continue  # a plug-in's hook for a seam only the kernel's recipes call: not what an inlined name needs
        elif not (_is_main_guard(node) and name != RECIPE):
            chunk = Chunk(name, len(module.chunks), node, _scope_bindings([node], packages)[0], gap=gap)
            module.chunks.append(chunk)
            for bound in chunk.binds:
                module.globals[bound] = ("def", name, bound)
                module.defines.setdefault(bound, []).append(chunk.index)
    _ANALYSES[key] = _Analysis(
        module.tree,
        module.globals,
        [(c.node, frozenset(c.binds), c.gap) for c in module.chunks],
        module.defines,
        frozenset(module.imports),
        module.future,
        module.header_end,
        submodules,
    )
    return _ANALYSES[key]


def _attaches_elsewhere(node: ast.stmt) -> bool:
    """A plug-in's `SEAM.append(hook)`, `SEAM.update(...)` or `SEAM[key] = hook`: how it attaches to the recipes on
    the kernel; a recipe not on it registers what it takes itself (core/records.py: take_back)."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute):
        table = node.value.func.value
    elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
        table = node.targets[0].value
    else:
        return False
    return isinstance(table, ast.Name) and table.id.isupper()


def _absolute(module: Module, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module
    if module.name == RECIPE:
        raise StandaloneError(f"line {node.lineno}: a relative import; a copied recipe cannot use one")
    parts = module.name.split(".")[: len(module.name.split(".")) - node.level + is_package]
    return ".".join(parts + ([node.module] if node.module else []))


def _index_import(
    module: Module,
    node: ast.Import | ast.ImportFrom,
    packages: tuple[str, ...],
    is_package: bool,
    submodules: list[tuple[tuple, str]],
) -> None:
    """What an import binds in `module`'s globals; `import a.b.c` adds (("ext", "import", "a"), "a.b.c") to
    `submodules`."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            top = alias.name.split(".")[0]
            if _inlined(alias.name, packages):
                module.globals[alias.asname or top] = ("mod", alias.name if alias.asname else top)
                module.imports.add(alias.name)
            elif alias.asname:
                module.globals[alias.asname] = ("ext", ("import", alias.name), alias.asname)
            else:  # `import a.b.c` binds `a` and makes sure a.b.c is loaded
                module.globals[top] = ("ext", ("import", top), top)
                if alias.name != top:
                    submodules.append((("ext", "import", top), alias.name))
        return
    source = _absolute(module, node, is_package)
    for alias in node.names:
        if alias.name == "*":
            raise StandaloneError(f"{module.name} line {node.lineno}: `from {source} import *` cannot be inlined")
        bound = alias.asname or alias.name
        if _inlined(source, packages):
            module.globals[bound] = ("ref", source, alias.name)
            module.imports |= {source, f"{source}.{alias.name}"}  # the second when it names a module
        else:
            module.globals[bound] = ("ext", ("from", source, alias.name), bound)


# --- emitting the file ----------------------------------------------------------------------------


def _keep_builtins(module: str, source: bytes, keep: dict[str, str]) -> bytes:
    """A table of built-ins (`MODELS = {"mlp": "core.models:mlp", ...}`) cut to the recipe's default entry,
    imported directly, so that a copy carries the one model and data set it runs by default, not all of them."""
    return _kept_builtins(module, source, tuple(sorted(keep.items())))


@functools.lru_cache(maxsize=256)  # a parse of every module for every copy, where most copies ask the same
def _kept_builtins(module: str, source: bytes, keep_items: tuple[tuple[str, str], ...]) -> bytes:
    keep = dict(keep_items)
    lines = source.decode().splitlines(keepends=True)
    for node in reversed(ast.parse(source).body):
        target = node.targets[0].id if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) else None
        if target not in keep or not isinstance(node.value, ast.Dict):
            continue
        table = {k.value: v.value for k, v in zip(node.value.keys, node.value.values)}
        where, _, function = table[keep[target]].partition(":")
        text = "" if where == module else f"from {where} import {function}\n"
        text += f'{target} = {{"{keep[target]}": {function}}}  # the default; the others need the package\n'
        lines[node.lineno - 1 : node.end_lineno] = [text]
    return "".join(lines).encode()

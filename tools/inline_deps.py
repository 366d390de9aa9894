"""The standalone inliner, part 2: load modules, follow references from the recipe, name and order
the definitions it needs (see tools/standalone.py for the whole story)."""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
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
        module = Module(name, source, ast.parse(source))
        self.modules[name], self.package_of[name] = module, is_package
        previous_end = 0
        for index, node in enumerate(module.tree.body):
            gap, previous_end = previous_end + 1, node.end_lineno
            if index == 0 and isinstance(node, ast.Expr) and isinstance(getattr(node.value, "value", None), str):
                module.header_end = node.end_lineno
            elif isinstance(node, ast.ImportFrom) and node.module == "__future__":
                module.future |= any(a.name == "annotations" for a in node.names)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self._index_import(module, node)
            elif not (_is_main_guard(node) and name != RECIPE):
                chunk = Chunk(name, len(module.chunks), node, _scope_bindings([node], self.packages)[0], gap=gap)
                module.chunks.append(chunk)
                for bound in chunk.binds:
                    module.globals[bound] = ("def", name, bound)
                    module.defines.setdefault(bound, []).append(chunk.index)
        return module

    def _absolute(self, module: Module, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module
        if module.name == RECIPE:
            raise StandaloneError(f"line {node.lineno}: a relative import; a copied recipe cannot use one")
        parts = module.name.split(".")[: len(module.name.split(".")) - node.level + self.package_of[module.name]]
        return ".".join(parts + ([node.module] if node.module else []))

    def _index_import(self, module: Module, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if _inlined(alias.name, self.packages):
                    module.globals[alias.asname or top] = ("mod", alias.name if alias.asname else top)
                    module.imports.add(alias.name)
                elif alias.asname:
                    module.globals[alias.asname] = ("ext", ("import", alias.name), alias.asname)
                else:  # `import a.b.c` binds `a` and makes sure a.b.c is loaded
                    module.globals[top] = ("ext", ("import", top), top)
                    if alias.name != top:
                        self.submodules.setdefault(("ext", "import", top), set()).add(alias.name)
            return
        source = self._absolute(module, node)
        for alias in node.names:
            if alias.name == "*":
                raise StandaloneError(f"{module.name} line {node.lineno}: `from {source} import *` cannot be inlined")
            bound = alias.asname or alias.name
            if _inlined(source, self.packages):
                module.globals[bound] = ("ref", source, alias.name)
                module.imports |= {source, f"{source}.{alias.name}"}  # the second when it names a module
            else:
                module.globals[bound] = ("ext", ("from", source, alias.name), bound)

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
        collector = _RefCollector(self.modules[chunk.module], self.resolve, self.packages)
        collector.visit(chunk.node)
        chunk.refs, chunk.removals = collector.refs, list({id(s): s for s in collector.removals}.values())
        new = []
        for ref in chunk.refs:
            key = _key(ref.target)
            self.refs_by_key.setdefault(key, []).append(ref)
            if key not in self.discovered:
                self.discovered[key] = ref.target[2]
                if key[0] == "def":
                    new.append(key)
        return new

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


# --- emitting the file ----------------------------------------------------------------------------


def _keep_builtins(module: str, source: bytes, keep: dict[str, str]) -> bytes:
    """A table of built-ins (`MODELS = {"mlp": "core.models:mlp", ...}`) cut to the recipe's default entry,
    imported directly, so that a copy carries the one model and data set it runs by default, not all of them."""
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

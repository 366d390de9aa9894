"""Eject a recipe as one file that needs only torch and its few third-party imports, never `core`.

    python -m recipes cp ddp train.py --standalone

Driven by ast, not by a list: parse the recipe, resolve every name it takes from `core`
(`from core import data` then `data.make_loader(...)`, or `from core.x import Y`), collect those
definitions from core's source files as they are at copy time, and what they use in turn
(functions, classes, module constants, the imports they need). Then emit one file: the recipe's
docstring, the imports merged, the definitions module by module in dependency order, and the
recipe's own code with its `core.` references rewritten to the inlined names. The text of every
statement is spliced from its source rather than regenerated, so comments and layout survive.
Two definitions with one name (core.models.MLP and core.gpt.MLP) get distinct names; a name is
never given where a local variable of that name would hide it.
"""
from __future__ import annotations

import ast
import builtins
import importlib.util
import re
import sys
import textwrap
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from heapq import heappop, heappush
from pathlib import Path

from core.config import RecipeError

RECIPE = "__recipe__"  # the module name the recipe itself gets here
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp,
           ast.DictComp, ast.GeneratorExp)
_RESERVED = set(dir(builtins)) | {"__file__", "__builtins__"}  # a global named so would hijack them


class StandaloneError(RecipeError):
    """The recipe uses `core` in a way this inliner cannot flatten (said in one line, with the place)."""


@dataclass
class Ref:
    """One use of a module-level name: `node` spans the text to replace, `target` what it means."""

    node: ast.expr
    target: tuple  # ("def", module, name) | ("ext", import key) | ("mod", module)
    shadow: frozenset[str]  # names local to the scopes around the use: the new name must not be one
    at_import: bool  # evaluated when the module runs (decorators, defaults, class bodies), not when called


@dataclass
class Chunk:
    """One top-level statement with the comment lines above it."""

    module: str
    index: int
    node: ast.stmt
    binds: set[str]
    refs: list[Ref] = field(default_factory=list)
    removals: list[ast.stmt] = field(default_factory=list)  # lazy `from core... import` inside functions
    gap: int = 1  # first line after the previous top-level statement: comments above this one start there


@dataclass
class Module:
    name: str
    source: bytes
    tree: ast.Module
    globals: dict[str, tuple] = field(default_factory=dict)  # top-level name -> target, as in Ref
    chunks: list[Chunk] = field(default_factory=list)
    defines: dict[str, list[int]] = field(default_factory=dict)  # name -> the chunks binding it
    imports: set[str] = field(default_factory=set)  # inlined modules it imports at the top
    future: bool = False
    header_end: int = 0  # last line of the docstring (0: none)


def _inlined(module: str | None, packages: tuple[str, ...]) -> bool:
    return bool(module) and any(module == p or module.startswith(p + ".") for p in packages)


def _scope_bindings(body: Iterable[ast.AST], packages: tuple[str, ...]) -> tuple[set[str], dict[str, tuple]]:
    """Names a scope binds (not its nested scopes'), and its `from core... import` names -> targets."""
    bound, aliases, declared = set(), {}, set()
    todo = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            declared.update(node.names)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            for alias in node.names:
                if isinstance(node, ast.ImportFrom) and _inlined(module, packages) and not node.level:
                    aliases[alias.asname or alias.name] = ("ref", module, alias.name)
                elif isinstance(node, ast.Import) and _inlined(alias.name, packages):
                    aliases[alias.asname or alias.name.split(".")[0]] = ("mod", alias.name if alias.asname
                                                                         else alias.name.split(".")[0])
                else:
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        todo.extend(ast.iter_child_nodes(node))
    return bound - declared, aliases


def _params(args: ast.arguments) -> set[str]:
    every = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    return {a.arg for a in every}


class _RefCollector(ast.NodeVisitor):
    """Walks one top-level statement and records every use of a module-level name, scope-aware."""

    def __init__(self, module: Module, resolve, packages: tuple[str, ...]):
        self.module, self.resolve, self.packages = module, resolve, packages
        self.scopes: list[tuple[str, set[str], dict[str, tuple]]] = []  # (kind, bound, core aliases)
        self.deferred = 0
        self.refs: list[Ref] = []
        self.removals: list[ast.stmt] = []

    def _visible(self):
        for i, (kind, bound, aliases) in enumerate(reversed(self.scopes)):
            if kind != "class" or i == 0:  # a class body's names are seen by that body only
                yield bound, aliases

    def lookup(self, name: str) -> tuple | None:
        for bound, aliases in self._visible():
            if name in aliases:
                return self.resolve(aliases[name])
            if name in bound:
                return None
        target = self.module.globals.get(name)
        return self.resolve(target) if target else None

    def record(self, node: ast.expr, target: tuple) -> None:
        if target[0] == "mod":
            raise StandaloneError(f"{self.module.name} line {node.lineno}: the module {target[1]} is used as a "
                                  f"value; use its functions by name (module.function) so they can be inlined")
        shadow = frozenset(n for bound, _ in self._visible() for n in bound)  # aliases go: their imports do
        self.refs.append(Ref(node, target, shadow, at_import=self.deferred == 0))

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and (target := self.lookup(node.id)):
            self.record(node, target)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        target = self._attribute(node)
        if target is None:
            self.generic_visit(node)
        else:
            self.record(node, target)  # the whole `data.make_loader` becomes one name

    def _attribute(self, node: ast.expr) -> tuple | None:
        """`data.make_loader` or `core.data.make_loader` -> what it names, when the base is a core module."""
        if isinstance(node, ast.Name):
            target = self.lookup(node.id) if isinstance(node.ctx, ast.Load) else None
            return target if target and target[0] == "mod" else None
        if isinstance(node, ast.Attribute):
            base = self._attribute(node.value)
            return self.resolve(("ref", base[1], node.attr)) if base and base[0] == "mod" else None
        return None

    def _function(self, node, params: set[str], body: list) -> None:
        bound, aliases = _scope_bindings(body, self.packages)
        self.removals += [s for s in ast.walk(ast.Module(body=body, type_ignores=[]))
                          if isinstance(s, (ast.Import, ast.ImportFrom)) and self._is_core_import(s)]
        self.scopes.append(("function", bound | params, aliases))
        self.deferred += 1
        for child in body if isinstance(body, list) else [body]:
            self.visit(child)
        self.deferred -= 1
        self.scopes.pop()

    def _is_core_import(self, node) -> bool:
        if isinstance(node, ast.ImportFrom):
            return not node.level and _inlined(node.module, self.packages)
        return any(_inlined(a.name, self.packages) for a in node.names)

    def _signature(self, node) -> None:
        for expr in [*getattr(node, "decorator_list", []), *node.args.defaults,
                     *[d for d in node.args.kw_defaults if d is not None]]:
            self.visit(expr)
        annotations = [a.annotation for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                                              node.args.vararg, node.args.kwarg) if a and a.annotation]
        self.deferred += self.module.future  # `from __future__ import annotations`: never evaluated
        for expr in [*annotations, *([node.returns] if node.returns else [])]:
            self.visit(expr)
        self.deferred -= self.module.future

    def visit_FunctionDef(self, node) -> None:
        self._signature(node)
        self._function(node, _params(node.args), node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for expr in [*node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]:
            self.visit(expr)
        self._function(node, _params(node.args), [node.body])

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(expr)
        bound, aliases = _scope_bindings(node.body, self.packages)
        self.scopes.append(("class", bound, aliases))
        for child in node.body:
            self.visit(child)
        self.scopes.pop()

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.deferred += self.module.future  # never evaluated under `from __future__ import annotations`
        self.visit(node.annotation)
        self.deferred -= self.module.future
        for expr in (node.target, node.value):
            if expr is not None:
                self.visit(expr)

    def _comprehension(self, node, parts: list) -> None:
        self.visit(node.generators[0].iter)  # the first iterable runs in the enclosing scope
        bound = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        self.scopes.append(("function", bound, {}))
        for i, gen in enumerate(node.generators):
            for expr in ([gen.iter] if i else []) + gen.ifs:
                self.visit(expr)
        for expr in parts:
            self.visit(expr)
        self.scopes.pop()

    def visit_ListComp(self, node) -> None:
        self._comprehension(node, [node.elt])

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node: ast.DictComp) -> None:
        self._comprehension(node, [node.key, node.value])

    def visit_Import(self, node) -> None:  # imports inside functions: core ones are removed, others stay
        pass

    visit_ImportFrom = visit_Import


def _is_main_guard(node: ast.stmt) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) \
        and test.left.id == "__name__"


def _key(target: tuple) -> tuple:
    return target[:3] if target[0] == "def" else ("ext", *target[1])


class _Inliner:
    """Loads modules, follows references from the recipe, names and orders what it found."""

    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages
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
                if candidate not in taken and candidate not in _RESERVED and all(candidate not in r.shadow
                                                                                 for r in refs):
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

    def ordered_chunks(self) -> list[Chunk]:
        """Inlined statements: module by module (a module after those it imports), each in source
        order, moved only where a statement needs another one when it runs (decorators, bases...)."""
        rank = {m: i for i, m in enumerate(self._module_order())}
        chunks = sorted((c for c in self.included.values() if c.module != RECIPE),
                        key=lambda c: (rank[c.module], c.index))
        position = {(c.module, c.index): i for i, c in enumerate(chunks)}
        needs = {i: set() for i in range(len(chunks))}
        for i, chunk in enumerate(chunks):
            for ref in chunk.refs:
                if ref.at_import and ref.target[0] == "def":
                    _, source, name = ref.target
                    needs[i] |= {position[(source, j)] for j in self.modules[source].defines[name]} - {i}
        heap, done, out = [i for i in needs if not needs[i]], set(), []
        waiting = {i: set(n) for i, n in needs.items()}
        while heap:
            i = heappop(heap)
            out.append(chunks[i])
            done.add(i)
            for j, need in waiting.items():
                if i in need:
                    need.discard(i)
                    if not need and j not in done:
                        heappush(heap, j)
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


def _offsets(source: bytes) -> list[int]:
    """Byte offset where each line starts (ast's col_offset is in UTF-8 bytes, so splice bytes)."""
    starts, pos = [0], 0
    for line in source.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


def _parents(node: ast.AST) -> dict[int, list]:
    """id(statement) -> the statement list it sits in."""
    parents = {}
    for inner in ast.walk(node):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(inner, name, None)
            if isinstance(block, list):
                parents.update({id(s): block for s in block})
    return parents


def _binding_edits(module: Module, chunk: Chunk, names: dict[tuple, str], at) -> list[tuple[int, int, str]]:
    """Where a renamed definition binds its name: `def NAME`, `class NAME`, `NAME = ...` at the top level."""
    renamed = {n: names[("def", chunk.module, n)] for n in chunk.binds if names[("def", chunk.module, n)] != n}
    edits, todo = [], [chunk.node]
    while renamed and todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in renamed:
                line = module.source.splitlines()[node.lineno - 1]
                found = re.compile(rb"(?:def|class)\s+(" + re.escape(node.name.encode()) + rb")\b").search(
                    line, node.col_offset)
                edits.append((at(node.lineno, found.start(1)), at(node.lineno, found.end(1)), renamed[node.name]))
            continue  # what is inside is another scope
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load) and node.id in renamed:
            edits.append((at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset),
                          renamed[node.id]))
        todo.extend(ast.iter_child_nodes(node))
    return edits


def _realign(node: ast.stmt, source: bytes, starts: list[int], edits: list) -> list[tuple[int, int, str]]:
    """Continuation lines aligned under an opening bracket move with it when a rename on the bracket's
    line makes that line shorter or longer (`data.make_loader(a,` -> `make_loader(a,`)."""
    deltas: dict[int, list[tuple[int, int]]] = {}  # line -> (column, change in length) of its edits
    for begin, end, new in edits:
        line = bisect_right(starts, begin)
        if bisect_right(starts, max(begin, end - 1)) == line:
            deltas.setdefault(line, []).append((begin - starts[line - 1], len(new.encode()) - (end - begin)))
    anchors, in_strings = [], set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.Constant, ast.JoinedStr)) and inner.end_lineno > inner.lineno:
            in_strings |= set(range(inner.lineno + 1, inner.end_lineno + 1))  # never re-indent inside a string
        items = {ast.Call: lambda n: [*n.args, *n.keywords], ast.List: lambda n: n.elts, ast.Tuple: lambda n: n.elts,
                 ast.Set: lambda n: n.elts, ast.Dict: lambda n: [*filter(None, n.keys)],
                 ast.FunctionDef: lambda n: [*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs],
                 }.get(type(inner), lambda n: [])(inner)
        if items:
            first = min(items, key=lambda i: (i.lineno, i.col_offset))
            anchors.append((first.lineno, first.col_offset, inner.end_lineno))
    shift: dict[int, int] = {}
    for line, column, last in sorted(anchors):
        moved = shift.get(line, 0) + sum(d for c, d in deltas.get(line, []) if c < column)
        for later in range(line + 1, last + 1) if moved else ():
            text = source[starts[later - 1]:starts[later]]
            if later not in shift and later not in in_strings and len(text) - len(text.lstrip(b" ")) == column:
                shift[later] = moved
    return [(starts[line - 1], starts[line - 1], " " * moved) if moved > 0 else
            (starts[line - 1], starts[line - 1] - moved, "") for line, moved in shift.items() if moved]


def _chunk_text(module: Module, chunk: Chunk, names: dict[tuple, str]) -> str:
    starts, source = _offsets(module.source), module.source

    def at(line: int, col: int) -> int:
        return starts[line - 1] + col

    edits = []
    for ref in chunk.refs:
        new = names[_key(ref.target)]
        if not (isinstance(ref.node, ast.Name) and ref.node.id == new):
            edits.append((at(ref.node.lineno, ref.node.col_offset), at(ref.node.end_lineno, ref.node.end_col_offset),
                          new))
    edits += _binding_edits(module, chunk, names, at)
    parents, removed = _parents(chunk.node), {id(s) for s in chunk.removals}
    for stmt in chunk.removals:
        before = source[starts[stmt.lineno - 1]:at(stmt.lineno, stmt.col_offset)]
        after = source[at(stmt.end_lineno, stmt.end_col_offset):starts[stmt.end_lineno]].strip()
        alone = not before.strip() and (not after or after.startswith(b"#"))
        if alone and any(id(s) not in removed for s in parents[id(stmt)]):
            edits.append((starts[stmt.lineno - 1], starts[stmt.end_lineno], ""))  # the whole line(s)
        else:
            edits.append((at(stmt.lineno, stmt.col_offset), at(stmt.end_lineno, stmt.end_col_offset), "pass"))
    edits += _realign(chunk.node, source, starts, edits)
    lo, hi = starts[chunk.gap - 1], starts[chunk.node.end_lineno]
    text = source[lo:hi]
    for begin, end, new in sorted(edits, reverse=True):
        text = text[:begin - lo] + new.encode() + text[end - lo:]
    return text.decode().strip("\n") + "\n"


def _import_lines(keys: dict[tuple, str], submodules: dict[tuple, set[str]]) -> list[str]:
    """`import` / `from ... import` lines, standard library first, merged per module."""
    plain, froms = set(), {}
    for key, name in keys.items():
        if key[1] == "import":
            module = key[2]
            if key in submodules:
                plain |= {(m, m) for m in submodules[key]}
            else:
                plain.add((module, name))
        else:
            froms.setdefault(key[2], set()).add(key[3] if key[3] == name else f"{key[3]} as {name}")
    lines = []
    for stdlib in (True, False):
        def here(module: str, stdlib=stdlib) -> bool:
            return (module.split(".")[0] in sys.stdlib_module_names) == stdlib

        group = [f"import {m}" if m == n or n == m.split(".")[0] else f"import {m} as {n}"
                 for m, n in sorted(plain) if here(m)]
        for module in sorted(m for m in froms if here(m)):
            names = ", ".join(sorted(froms[module]))
            line = f"from {module} import {names}"
            group.append(line if len(line) <= 120 else
                         f"from {module} import (\n" + "".join(f"    {n},\n" for n in sorted(froms[module])) + ")")
        if group:
            lines += group + [""]
    return lines


def _launch_lines(docstring: str, dest: str, nproc: int) -> str:
    """`./launch_single_node.sh DEST ...` needs that script; a copy elsewhere is started with torchrun."""
    pattern = re.compile(rf"^(\s*)(?:NPROC_PER_NODE=(\d+)\s+)?\./launch_single_node\.sh\s+{re.escape(dest)}(?=\s|$)",
                         re.M)
    lines = docstring.splitlines(keepends=True)
    converted = [pattern.sub(lambda m: f"{m[1]}torchrun --standalone --nproc-per-node {m[2] or nproc} {dest}", line)
                 for line in lines]
    # a launcher line that became the same command as another line of the docstring goes
    return "".join(new for new, old in zip(converted, lines)
                   if new == old or new.strip() not in {other.strip() for other in lines})


def _requirements(inliner: _Inliner, keys: Iterable[tuple]) -> tuple[list[str], list[str]]:
    """Third-party packages the file imports at the top, and those imported only inside a function."""
    top = {k[2].split(".")[0] for k in keys}
    lazy = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
            for chunk in inliner.included.values() for n in ast.walk(chunk.node)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and not getattr(n, "level", 0)
            for a in n.names if not _inlined(n.module if isinstance(n, ast.ImportFrom) else a.name,
                                             inliner.packages)}
    third_party = {m for m in top | lazy if m not in sys.stdlib_module_names}
    return sorted(third_party & top), sorted(third_party - top)


def standalone_source(source: str, *, name: str, dest: str, nproc: int = 2,
                      packages: tuple[str, ...] = ("core",)) -> str:
    """The text of one Python file that runs recipe `name` (its `source`) with nothing from `packages`.

    `dest` is the file's name as the user runs it (the docstring's launch lines use it); `nproc`
    the process count a `./launch_single_node.sh` line started, now written out for torchrun.
    """
    inliner = _Inliner(packages)
    recipe = inliner.load(RECIPE, source.encode())
    inliner.include_recipe(recipe)
    names = inliner.names(recipe)
    own_imports = {_key(t): n for n, t in recipe.globals.items() if t[0] == "ext"}
    used = {k: names[k] for k in inliner.discovered if k[0] == "ext"} | own_imports
    chunks = inliner.ordered_chunks()
    needs, lazy = _requirements(inliner, used)
    files = ", ".join(f"{m.replace('.', '/')}.py" for m in inliner._module_order())
    docstring = b"".join(recipe.source.splitlines(keepends=True)[:recipe.header_end]).decode()
    header = textwrap.fill(
        f"A standalone copy of the `{name}` recipe of torch-dist-recipes, made by `python -m recipes cp {name} "
        f"{dest} --standalone`. It needs {', '.join(needs) or 'only the standard library'}"
        + (f" (and {', '.join(lazy)}, imported only inside the functions that use it)" if lazy else "")
        + f". Nothing is imported from torch-dist-recipes: the code the recipe uses of {', '.join(packages)} is "
        f"inlined below, section by section, as it was in {files} when copied. The recipe itself comes last.",
        width=100, initial_indent="# ", subsequent_indent="# ")
    top = [_launch_lines(docstring, dest, nproc).rstrip("\n"), header] if docstring else [header]
    future = recipe.future or any(inliner.modules[m].future for m in inliner.contributing)
    imports = ["from __future__ import annotations", ""] * future + _import_lines(used, inliner.submodules)
    parts = ["\n\n".join(top), "\n".join(imports).rstrip("\n")]
    section = None
    for chunk in chunks:
        if chunk.module != section:
            section = chunk.module
            parts.append(f"# {'-' * 30} inlined from {section.replace('.', '/')}.py {'-' * 30}")
        parts.append(_chunk_text(inliner.modules[chunk.module], chunk, names).rstrip("\n"))
    parts.append(f"# {'-' * 30} the {name} recipe {'-' * 30}")
    parts += [_chunk_text(recipe, chunk, names).rstrip("\n") for chunk in recipe.chunks]
    return "\n\n\n".join(parts) + "\n"

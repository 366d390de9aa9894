"""The standalone inliner, part 1: what a module binds and which module-level names each statement uses.

Each top-level statement of a module becomes a Chunk; a Ref is one use of a name that another
module defines (core.data.make_loader) or imports (torch); scopes are followed so that a local
variable never counts as a use of a global of the same name.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable
from dataclasses import dataclass, field

from core.kernel.options import RecipeError

RECIPE = "__recipe__"  # the module name the recipe itself gets here
_SCOPES = (
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Lambda,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
)
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
                    aliases[alias.asname or alias.name.split(".")[0]] = (
                        "mod",
                        alias.name if alias.asname else alias.name.split(".")[0],
                    )
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
            raise StandaloneError(
                f"{self.module.name} line {node.lineno}: the module {target[1]} is used as a "
                f"value; use its functions by name (module.function) so they can be inlined"
            )
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
        self.removals += [
            s
            for s in ast.walk(ast.Module(body=body, type_ignores=[]))
            if isinstance(s, (ast.Import, ast.ImportFrom)) and self._is_core_import(s)
        ]
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
        for expr in [
            *getattr(node, "decorator_list", []),
            *node.args.defaults,
            *[d for d in node.args.kw_defaults if d is not None],
        ]:
            self.visit(expr)
        annotations = [
            a.annotation
            for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg)
            if a and a.annotation
        ]
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
    return (
        isinstance(node, ast.If)
        and isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
    )


def line_offsets(source: bytes) -> list[int]:
    """Byte offset where each line starts (ast's col_offset is in UTF-8 bytes, so splice bytes)."""
    starts, pos = [0], 0
    for line in source.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts

"""Eject a recipe as one file that needs only torch and its few third-party imports, never `core`.

    python -m recipes cp ddp train.py --standalone

Driven by ast, not by a list: parse the recipe, resolve every name it takes from `core`
(`from core import data` then `data.make_loader(...)`, or `from core.x import Y`), collect those
definitions from core's source files as they are at copy time, and what they use in turn
(functions, classes, module constants, the imports they need). Then emit one file: the recipe's
docstring, the imports merged, the recipe's functions, the definitions module by module in
dependency order, and the rest of the recipe (its Config, the `__main__` lines), with its `core.`
references rewritten to the inlined names. The text of every
statement is spliced from its source rather than regenerated, so comments and layout survive.
Two definitions with one name (core.models.MLP and core.gpt.MLP) get distinct names; a name is
never given where a local variable of that name would hide it.
"""

import ast
import io
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
from bisect import bisect_right
from collections.abc import Iterable

from tools.copy_out import launch_lines
from tools.features import FEATURES, drop_features
from tools.inline_deps import _Inliner, _key
from tools.inline_refs import RECIPE, Chunk, Module, StandaloneError, _inlined, line_offsets  # noqa: F401 (StandaloneError: API)


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
                    line, node.col_offset
                )
                edits.append((at(node.lineno, found.start(1)), at(node.lineno, found.end(1)), renamed[node.name]))
            continue  # what is inside is another scope
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load) and node.id in renamed:
            edits.append((at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset), renamed[node.id]))
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
        items = {
            ast.Call: lambda n: [*n.args, *n.keywords],
            ast.List: lambda n: n.elts,
            ast.Tuple: lambda n: n.elts,
            ast.Set: lambda n: n.elts,
            ast.Dict: lambda n: [*filter(None, n.keys)],
            ast.FunctionDef: lambda n: [*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs],
        }.get(type(inner), lambda n: [])(inner)
        if items:
            first = min(items, key=lambda i: (i.lineno, i.col_offset))
            # a def's arguments end where its body begins: body lines that happen to start at the column of
            # its first argument are not continuation lines
            last = inner.body[0].lineno - 1 if isinstance(inner, ast.FunctionDef) else inner.end_lineno
            anchors.append((first.lineno, first.col_offset, last))
    shift: dict[int, int] = {}
    for line, column, last in sorted(anchors):
        moved = shift.get(line, 0) + sum(d for c, d in deltas.get(line, []) if c < column)
        for later in range(line + 1, last + 1) if moved else ():
            text = source[starts[later - 1] : starts[later]]
            if later not in shift and later not in in_strings and len(text) - len(text.lstrip(b" ")) == column:
                shift[later] = moved
    return [
        (starts[line - 1], starts[line - 1], " " * moved)
        if moved > 0
        else (starts[line - 1], starts[line - 1] - moved, "")
        for line, moved in shift.items()
        if moved
    ]


# (module, its source, statement, what is renamed or removed in it) -> the statement's text: the same statement
# with the same renames is the same text in every copy that has it (most of them do)
_TEXTS: dict[tuple, str] = {}


def _chunk_text(module: Module, chunk: Chunk, names: dict[tuple, str]) -> str:
    starts, source = line_offsets(module.source), module.source

    def at(line: int, col: int) -> int:
        return starts[line - 1] + col

    edits = []
    for ref in chunk.refs:
        new = names[_key(ref.target)]
        if not (isinstance(ref.node, ast.Name) and ref.node.id == new):
            edits.append(
                (at(ref.node.lineno, ref.node.col_offset), at(ref.node.end_lineno, ref.node.end_col_offset), new)
            )
    renamed = tuple(sorted((n, names[("def", chunk.module, n)]) for n in chunk.binds))
    removals = tuple((s.lineno, s.col_offset, s.end_lineno, s.end_col_offset) for s in chunk.removals)
    key = (module.name, source, chunk.index, tuple(edits), renamed, removals)
    if key not in _TEXTS:
        if len(_TEXTS) > 50_000:  # a bound on memory, far above what one run of the tests asks
            _TEXTS.clear()
        _TEXTS[key] = _new_chunk_text(module, chunk, names, starts, edits)
    return _TEXTS[key]


def _new_chunk_text(module: Module, chunk: Chunk, names: dict[tuple, str], starts: list[int], edits: list) -> str:
    source = module.source

    def at(line: int, col: int) -> int:
        return starts[line - 1] + col

    edits = edits + _binding_edits(module, chunk, names, at)
    parents, removed = _parents(chunk.node), {id(s) for s in chunk.removals}
    for stmt in chunk.removals:
        before = source[starts[stmt.lineno - 1] : at(stmt.lineno, stmt.col_offset)]
        after = source[at(stmt.end_lineno, stmt.end_col_offset) : starts[stmt.end_lineno]].strip()
        alone = not before.strip() and (not after or after.startswith(b"#"))
        if alone and any(id(s) not in removed for s in parents[id(stmt)]):
            edits.append((starts[stmt.lineno - 1], starts[stmt.end_lineno], ""))  # the whole line(s)
        else:
            edits.append((at(stmt.lineno, stmt.col_offset), at(stmt.end_lineno, stmt.end_col_offset), "pass"))
    if module.name != RECIPE:  # the copy keeps each helper's one-line summary; the whole story is in core
        edits += _docstring_edits(chunk.node, source, at)
    edits += _realign(chunk.node, source, starts, edits)
    lo, hi = starts[chunk.gap - 1], starts[chunk.node.end_lineno]
    text = source[lo:hi]
    for begin, end, new in sorted(edits, reverse=True):
        text = text[: begin - lo] + new.encode() + text[end - lo :]
    return _SECTION_RULE.sub("", text.decode()).strip("\n") + "\n"


# A module's own section rule (`# --- fully_shard ----`): in a copy, the `# inlined from` marks divide the file.
_SECTION_RULE = re.compile(r"^# --- .*-\n(?:[ \t]*\n)*", re.M)


def _definable_first(node: ast.stmt) -> bool:
    """A function whose definition runs nothing of the helpers (no decorator, only literal defaults): it can stand
    before them in the file, since its body looks the helpers up only when it is called."""
    defaults = [*node.args.defaults, *filter(None, node.args.kw_defaults)] if isinstance(node, ast.FunctionDef) else []
    return (
        isinstance(node, ast.FunctionDef)
        and not node.decorator_list
        and all(isinstance(d, ast.Constant) for d in defaults)
    )


def _docstring_edits(node: ast.stmt, source: bytes, at) -> list[tuple[int, int, str]]:
    """Each multi-line docstring of a function or class in `node` cut to its first sentence, as written."""
    edits = []
    for inner in ast.walk(node):
        body = getattr(inner, "body", None) if isinstance(inner, (ast.FunctionDef, ast.ClassDef)) else None
        doc = body[0] if body and isinstance(body[0], ast.Expr) else None
        if doc is None or not isinstance(doc.value, ast.Constant) or doc.end_lineno == doc.lineno:
            continue
        begin, end = at(doc.lineno, doc.col_offset), at(doc.end_lineno, doc.end_col_offset)
        written = source[begin:end].decode()
        opening = written[: len(written) - len(written.lstrip("rRuU")) + 3]  # prefix and quotes as written
        summary = _first_sentence(written[len(opening) : -3])
        if opening[-3:] in ('"""', "'''") and summary:  # not a `"""` alone on its first line
            edits.append((begin, end, opening + summary + opening[-3:]))
    return edits


_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!vs)[.!?](?=\s|$)")


def _first_sentence(text: str) -> str:
    """The docstring's first sentence with its line breaks (the whole first paragraph if no sentence ends in it)."""
    kept = []
    for line in text.split("\n"):
        if not line.strip():
            break
        end = _SENTENCE_END.search(line)
        kept.append(line[: end.end()] if end else line)
        if end:
            break
    return "\n".join(kept).rstrip()


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

        group = [
            f"import {m}" if m == n or n == m.split(".")[0] else f"import {m} as {n}"
            for m, n in sorted(plain)
            if here(m)
        ]
        for module in sorted(m for m in froms if here(m)):
            names = ", ".join(sorted(froms[module]))
            line = f"from {module} import {names}"
            group.append(
                line
                if len(line) <= 120
                else f"from {module} import (\n" + "".join(f"    {n},\n" for n in sorted(froms[module])) + ")"
            )
        if group:
            lines += group + [""]
    return lines


def _requirements(inliner: _Inliner, keys: Iterable[tuple]) -> tuple[list[str], list[str]]:
    """Third-party packages the file imports at the top, and those imported only inside a function."""
    top = {k[2].split(".")[0] for k in keys}
    lazy = set().union(*(_lazy_imports(inliner, chunk) for chunk in inliner.included.values()))
    third_party = {m for m in top | lazy if m not in sys.stdlib_module_names}
    return sorted(third_party & top), sorted(third_party - top)


_LAZY: dict[tuple, frozenset[str]] = {}  # (module, its source, statement, packages) -> its lazy imports


def _lazy_imports(inliner: _Inliner, chunk: Chunk) -> frozenset[str]:
    """The top-level packages a statement imports inside a function (or anywhere below the top), not inlined."""
    key = (chunk.module, inliner.modules[chunk.module].source, chunk.index, inliner.packages)
    if key not in _LAZY:
        _LAZY[key] = frozenset(
            (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
            for n in ast.walk(chunk.node)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and not getattr(n, "level", 0)
            for a in n.names
            if not _inlined(n.module if isinstance(n, ast.ImportFrom) else a.name, inliner.packages)
        )
    return _LAZY[key]


# The modules that hold the step (and the loss it takes): right after the recipe's functions, so that the step a
# reader came for is a few lines below the loop that calls it. A definition that needs another one when the file
# runs (a default value, a base class) waits for it, and takes its module's name again where it lands.
STEP_MODULES = ("core.amp", "core.steps", "core.exact_loss", "core.loss")


def standalone_source(
    source: str,
    *,
    name: str,
    dest: str,
    nproc: int = 2,
    packages: tuple[str, ...] = ("core",),
    keep_builtins: dict[str, str] | None = None,
    first: tuple[str, ...] = STEP_MODULES,
    left_out: str = "",
    without: tuple[str, ...] = (),
    absent: tuple[str, ...] = (),
    defaults: dict[str, tuple[str, str]] | None = None,
    formatted: bool = True,
) -> str:
    """The text of one Python file that runs recipe `name` (its `source`) with nothing from `packages`.

    `dest` is the file's name as the user runs it (the docstring's launch lines use it); `nproc`
    the process count a `./launch_single_node.sh` line started, now written out for torchrun; `first`: the
    modules placed right after the recipe's functions; `left_out`: what the package's runner has that the copy
    does not, for the header; `without`: the features (tools.features) the copy leaves out, `defaults` the
    built-ins (option -> (module, function)) that replace the factories; `absent`: the features the recipe has none
    of, whose code (`run.sinks` without trackers) no path of the copy reaches: it goes too, unnamed in the header.
    The text is `ruff format`ted where ruff is installed (`formatted=False`: left for one `ruff format` over many
    copies).
    """

    def drop(module: str, text: bytes) -> bytes:
        return drop_features(text, module=module, off={*without, *absent}, defaults=defaults or {})

    inliner = _Inliner(packages, keep_builtins=keep_builtins, drop=drop)
    recipe = inliner.load(RECIPE, drop(RECIPE, source.encode()))
    inliner.include_recipe(recipe)
    names = inliner.names(recipe)
    own_imports = {_key(t): n for n, t in recipe.globals.items() if t[0] == "ext" and _key(t) in inliner.discovered}
    used = {k: names[k] for k in inliner.discovered if k[0] == "ext"} | own_imports
    chunks = inliner.ordered_chunks(first=first)
    needs, lazy = _requirements(inliner, used)
    docstring = b"".join(recipe.source.splitlines(keepends=True)[: recipe.header_end]).decode()
    header = [
        f"# A standalone copy of torch-dist-recipes' {name} recipe, made by "
        f"`python -m recipes cp {name} FILE --standalone`.",
        f"# It needs {', '.join(needs) or 'only the standard library'}"
        + (f" ({', '.join(lazy)}: imported only where used)" if lazy else "")
        + f"; the {', '.join(packages)} code it uses is inlined below the recipe's functions, marked with its file.",
    ]
    if left_out:
        header.append(f"# Left out: {left_out} (`python -m recipes run {name}` has them).")
    for feature in without:  # one line each, with the option that brings it back
        header.append(f"# Left out: {FEATURES[feature].says}; `--with {feature}` adds it.")
    header = "\n".join(textwrap.fill(line, width=118, subsequent_indent="# ") for line in header)
    top = [launch_lines(docstring, dest, nproc).rstrip("\n"), header] if docstring else [header]
    # the recipe's functions come before the helpers their annotations name: annotations must not be evaluated
    imports = ["from __future__ import annotations", "", *_import_lines(used, inliner.submodules)]
    early = [chunk for chunk in recipe.chunks if _definable_first(chunk.node)]
    late = [chunk for chunk in recipe.chunks if chunk not in early]
    blocks = [(recipe, chunk, f"the {name} recipe" if i == 0 else None) for i, chunk in enumerate(early)]
    section = None
    for chunk in chunks:
        mark = f"inlined from {chunk.module.replace('.', '/')}.py" if chunk.module != section else None
        blocks.append((inliner.modules[chunk.module], chunk, mark))
        section = chunk.module
    blocks += [
        (recipe, chunk, f"the {name} recipe's Config and start" if i == 0 else None) for i, chunk in enumerate(late)
    ]
    body = ""
    for i, (module, chunk, mark) in enumerate(blocks):
        text = _chunk_text(module, chunk, names).strip("\n")
        text = f"# {mark}\n{text}" if mark else text
        body += (_separator(blocks[i - 1], (module, chunk, mark)) if i else "") + text
    text = "\n\n".join([*top, "\n".join(imports).rstrip("\n")]) + "\n\n\n" + body + "\n"
    return ruff_format(text) if formatted else text


def _separator(before: tuple, after: tuple) -> str:
    """Blank lines between two top-level statements: none between simple statements that stood together in one
    module (constants), two around a function or class, as ruff format has them."""
    (module, first, _), (_, second, mark) = before, after
    simple = not isinstance(first.node, _DEFINITIONS) and not isinstance(second.node, _DEFINITIONS)
    together = simple and first.module == second.module and second.index == first.index + 1 and mark is None
    if together:
        between = module.source.splitlines()[first.node.end_lineno : second.node.lineno - 1]
        return "\n" + "\n" * min(sum(1 for line in between if not line.strip()), 1)
    return "\n\n\n"


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def ruff_format(text: str) -> str:
    """`text` as `ruff format` (line length 120, no configuration read) writes it, where ruff is installed."""
    try:
        from ruff.__main__ import find_ruff_bin

        ruff = find_ruff_bin()
    except (ImportError, FileNotFoundError):
        ruff = shutil.which("ruff")
    if not ruff:
        return text
    done = subprocess.run(
        [ruff, "format", "--isolated", "--line-length", "120", "-"], input=text, capture_output=True, text=True
    )
    return done.stdout if done.returncode == 0 and done.stdout else text


def copy_size(text: str) -> tuple[int, int]:
    """(lines, code lines): a code line holds a token other than a comment or a docstring (the budgets' count)."""
    docstrings, strings = _strings(ast.parse(text))
    lines = text.split("\n")
    if _ODD_LINES.search(text):  # line breaks or continuations the line test below does not know: the tokenizer
        code = _token_lines(text)
    else:  # a line holds a token if it starts with one, or lies in a string that spans lines
        code = {i for i, line in enumerate(lines, 1) if line.lstrip(" \t") and not line.lstrip(" \t").startswith("#")}
        for node in strings:
            # the literal's tokens (one, or several joined: comment lines may stand between them)
            segment = "\n".join(lines[node.lineno - 1 : node.end_lineno]).encode()
            end = len(segment) - len(lines[node.end_lineno - 1].encode()) + node.end_col_offset
            code |= {
                line + node.lineno - 1 for line in _token_lines("(" + segment[node.col_offset : end].decode() + ")")
            }
    return len(text.splitlines()), len(code - docstrings)


# a carriage return, a form feed or another line break of str.splitlines, a backslash that continues a line
_ODD_LINES = re.compile(r"[\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]|\\\n")


def _strings(tree: ast.AST) -> tuple[set[int], list[ast.expr]]:
    """The lines of docstrings (a string alone as a statement), and the other string literals that span lines (an
    f-string as a whole)."""
    docstrings, found, todo = set(), [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings |= set(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.JoinedStr) or isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            found += [node] if node.end_lineno > node.lineno else []
        else:
            todo.extend(ast.iter_child_nodes(node))
    return docstrings, found


def _token_lines(text: str) -> set[int]:
    """The lines a token other than a comment or layout touches."""
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    return {
        line
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type not in layout
        for line in range(token.start[0], token.end[0] + 1)
    }

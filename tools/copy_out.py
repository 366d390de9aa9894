"""`python -m recipes cp NAME DEST --standalone [--with F,...]`: one file that joins whole files, as they are written.

    the recipe's docstring, then a header of a few lines (what was left out, and the --with that adds each)
    the imports of every file joined, merged (the package's own, `core` and `recipes`, dropped)
    the recipe's functions, to read first
    the kernel files (core/kernel/), the opt-ins the recipe imports (core/NAME.py: a technique it shows), then the
    plug-ins asked for (core/plugins/), each whole
    the recipe's options and start (its Config and __main__ block), which use all of the above

No line of a file changes: the join works on lines, and a name is defined in one joined file only, so the result runs
as its parts do.
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from pathlib import Path

from tools.registry import PLUGINS, RECIPES, plugins_of

CORE = Path(__file__).resolve().parent.parent / "core"
# The kernel's files in the order a reader meets what they define; a copy joins those its files import (and no other).
KERNEL = ("step", "loss", "train", "store", "replica", "job", "builtin", "seams")
TAIL = "# Options and start:"  # the recipe's line where its Config and __main__ block begin
LEFT_OUT = "the pre-launch checks (tools/precheck.py), the loopback-only store (tools/join.py), other built-in models"
OWN = re.compile(r"(from|import) (core|recipes)\b")
OPT_IN = re.compile(r"^from core\.(\w+) import", re.M)  # core.NAME: an opt-in (kernel/, plugins/, attach are not)
OWN_KERNEL = re.compile(r"^ *from core\.kernel\.(\w+) import", re.M)


class CopyError(Exception):
    """A `cp` the registry cannot make: one line for the user."""


def retarget_commands(text: str, name: str, dest: str) -> str:
    """Point the docstring's launch commands at the copied file instead of the package."""
    text = re.sub(rf"python -m recipes run {name}\b", f"python {dest}", text)
    text = re.sub(rf"-m recipes run {name}\b", dest, text)
    return re.sub(rf"launch_single_node\.sh {name}\b", f"launch_single_node.sh {dest}", text)


def launch_lines(docstring: str, dest: str, nproc: int) -> str:
    """`./launch_single_node.sh DEST ...` needs that script; a copy elsewhere is started with torchrun."""
    pattern = re.compile(
        rf"^(\s*)(?:NPROC_PER_NODE=(\d+)\s+)?\./launch_single_node\.sh\s+{re.escape(dest)}(?=\s|$)", re.M
    )
    lines = docstring.splitlines(keepends=True)
    torchrun = lambda m: f"{m[1]}torchrun --standalone --nproc-per-node {m[2] or nproc} {dest}"  # noqa: E731
    converted = [pattern.sub(torchrun, line) for line in lines]
    # a launcher line that became the same command as another line of the docstring goes
    return "".join(
        new for new, old in zip(converted, lines) if new == old or new.strip() not in {other.strip() for other in lines}
    )


def parse_with(names: str, *, recipe: str) -> list[str]:
    """`--with a,b` (or all) -> the plug-ins of `recipe` to join, in the registry's order; an unknown one is a line."""
    offered = plugins_of(RECIPES[recipe])
    asked = [n.strip() for n in names.split(",") if n.strip()]
    if unknown := [n for n in asked if n != "all" and n not in offered]:
        raise CopyError(f"--with {','.join(sorted(unknown))}: choose from {', '.join(['all', *offered])}")
    return list(offered) if "all" in asked else [n for n in offered if n in asked]


def split_file(text: str) -> tuple[str, list[str], str]:
    """(its docstring, its import statements, the rest): the imports are the top-level ones after the docstring."""
    lines = text.split("\n")
    doc_end = 0
    if lines[0].startswith('"""'):
        doc_end = next(i for i, line in enumerate(lines) if line.rstrip().endswith('"""') and (i or line != '"""'))
        doc_end += 1
    imports, i = [], doc_end
    while i < len(lines):
        line = lines[i]
        if line.startswith(("import ", "from ")):
            statement = [line]
            while statement[-1].rstrip().endswith("(") or ("(" in "".join(statement) and ")" not in statement[-1]):
                i += 1
                statement.append(lines[i])
            imports.append("\n".join(statement))
        elif line.strip():
            break
        i += 1
    return "\n".join(lines[:doc_end]), imports, "\n".join(lines[i:]).strip("\n")


def merge_imports(statements: list[str]) -> str:
    """One import block: the __future__ line, the standard library, then the rest, each `import` before `from`."""
    plain, named = set(), {}
    for statement in statements:
        flat = " ".join(part.strip() for part in statement.split("\n"))
        flat = re.sub(r"\s*#.*$", "", flat.replace("( ", "(")).replace("(", "").replace(")", "").rstrip(", ")
        if OWN.match(flat):
            continue
        if flat.startswith("import "):
            plain.add(flat)
        else:
            module, names = re.fullmatch(r"from (\S+) import (.+)", flat).groups()
            named.setdefault(module, set()).update(n.strip() for n in names.split(",") if n.strip())
    future = named.pop("__future__", None)
    sections = {True: [], False: []}  # standard library or not
    for line in sorted(plain, key=lambda s: s.split()[1].lower()):
        sections[line.split()[1].split(".")[0] in sys.stdlib_module_names].append(line)
    for module in sorted(named, key=str.lower):
        names = sorted(named[module], key=lambda n: (not n.isupper(), not n[:1].isupper(), n.lower()))
        line = f"from {module} import {', '.join(names)}"
        if len(line) > 120:  # as ruff format writes it
            line = f"from {module} import (\n" + "".join(f"    {n},\n" for n in names) + ")"
        sections[module.split(".")[0] in sys.stdlib_module_names].append(line)
    blocks = [["from __future__ import annotations"] if future else [], sections[True], sections[False]]
    return "\n\n".join("\n".join(block) for block in blocks if block)


def header(name: str, kept: list[str]) -> str:
    """What the copy is, what it left out, and the `--with` names that add those (the README says what each holds)."""
    lines = [
        f"# A standalone copy of torch-dist-recipes' {name} recipe, made by `python -m recipes cp {name} FILE "
        f"--standalone`: the recipe, the kernel (core/kernel/), its opt-ins and the plug-ins asked for, joined as "
        "written.",
        f"# Left out: {LEFT_OUT} (`python -m recipes run {name}` has them).",
    ]
    if left := [plugin for plugin in plugins_of(RECIPES[name]) if plugin not in kept]:
        added = "each added by `--with NAME` (the README's plug-in table says what)"
        lines.append(f"# Left out, {added}: {', '.join(left)}.")
    return "\n".join(_wrap(line) for line in lines)


def _wrap(line: str) -> str:
    """A comment line cut at 120 characters, its continuation a comment too."""
    out = []
    while len(line) > 120:
        cut = line.rfind(" ", 0, 120)
        out.append(line[:cut])
        line = "# " + line[cut + 1 :]
    return "\n".join([*out, line])


def opt_ins(text: str, seen: list[Path] | None = None) -> list[Path]:
    """The opt-in files `text` imports from, each after those it imports itself."""
    seen = [] if seen is None else seen
    for module in OPT_IN.findall("\n".join(split_file(text)[1])):
        path = CORE / f"{module}.py"
        if module not in ("kernel", "plugins", "attach") and path not in seen:
            opt_ins(path.read_text(), seen)
            seen.append(path)
    return seen


def kernel_files(texts: list[str]) -> list[Path]:
    """The kernel's files that these texts import, and those that those import, in KERNEL's order."""
    wanted = {module for text in texts for module in OWN_KERNEL.findall(text)}
    for _ in KERNEL:  # no chain of imports is longer than the kernel
        wanted |= {m for name in wanted for m in OWN_KERNEL.findall((CORE / "kernel" / f"{name}.py").read_text())}
    return [CORE / "kernel" / f"{module}.py" for module in KERNEL if module in wanted]


def check_names(files: list[Path]) -> None:
    """A name defined at the top of two joined files would run as the later one: refused, naming both."""
    where: dict[str, Path] = {}
    for path in files:
        for name in re.findall(r"^(?:def|class) (\w+)|^(\w+)(?:: [^=]+)? =", path.read_text(), re.M):
            name = name[0] or name[1]
            if name in where and where[name] != path:
                raise CopyError(f"{name} is defined in both {where[name].name} and {path.name}; rename one")
            where[name] = path


def join(name: str, dest: str, *, kept: list[str]) -> str:
    """The text of recipe `name`'s standalone copy at `dest`, with the plug-ins in `kept`."""
    recipe = RECIPES[name]
    text = retarget_commands(Path(recipe.source_file).read_text(), name, dest)
    doc, imports, body = split_file(text)
    doc = launch_lines(doc, dest, 2 if recipe.multi_node else 1)  # the package's launcher: torchrun in a copy
    head, _, tail = body.partition(TAIL)
    source = f"recipes/{Path(recipe.source_file).name}"
    parts = [f"# from {source}\n" + head.strip("\n")]
    files = opt_ins(text) + [Path(PLUGINS[plugin].load().__file__) for plugin in kept]
    files = kernel_files([text, *(path.read_text() for path in files)]) + files
    check_names(files)
    for path in files:
        part_doc, part_imports, part_body = split_file(path.read_text())
        imports += part_imports
        where = f"# from {path.relative_to(CORE.parent)}"  # where each part comes from, as written there
        parts.append("\n\n\n".join(filter(None, [f"{where}\n{part_doc}" if part_doc else where, part_body])))
    parts.append(f"# from {source}: its options and start\n" + (TAIL + tail).strip("\n"))
    top = "\n\n".join([doc, header(name, kept), merge_imports(imports)])
    return "\n\n\n".join([top, *parts]) + "\n"


def copy_size(text: str) -> tuple[int, int]:
    """(lines, code lines): a code line holds a token other than a comment or a docstring (the budgets' count)."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    code, statement_start = set(), True
    for i, token in enumerate(tokens):
        alone = token.type == tokenize.STRING and statement_start and tokens[i + 1].type in (tokenize.NEWLINE,)
        if token.type not in skip and not alone:  # a string alone as a statement is a docstring
            code.update(range(token.start[0], token.end[0] + 1))
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            statement_start = token.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    return len(text.splitlines()), len(code)

"""Layer 1: the copy is the source (issue 35). A recipe written on the kernel (core/kernel/) is copied by joining whole
files, its features are plug-in files (core/plugins/) attached at the kernel's seams, and the lean copy's size is held.

What the copies train is tests/test_standalone.py's (one launch: the lean copy, each `--with` and `--with all`
against the packaged recipe, bit for bit); this file holds the rules that make such a copy possible.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import REPO
from tools.cli import cli
from tools.copy_out import KERNEL, copy_size, join, merge_imports, parse_with, split_file
from tools.registry import PLUGINS, RECIPES, plugins_of

pytestmark = pytest.mark.fast

ON_KERNEL = [name for name, recipe in RECIPES.items() if recipe.plugins]
KERNEL_FILES = [REPO / "core" / "kernel" / f"{module}.py" for module in KERNEL]
PLUGIN_FILES = sorted((REPO / "core" / "plugins").glob("[a-z]*.py"))
# Issue 35.5: the lean ddp copy's size. The design asks 450 code lines (650 in all); what the kernel holds beyond the
# sketch it was measured on (the guarantees every copy carries, the seams) is in docs/copying-and-checking.md "Size".
# A ratchet: a copy RATCHET code lines under its budget fails until the budget is lowered, down to what the issue asks
# (ASKED: 450 code lines and 650 in all for ddp, 750 code lines for every other copy).
ASKED = {"ddp": 450}
LEAN_BUDGET = {
    "ddp": (801, 541), "dp": (792, 750), "ddp_amp": (947, 750), "ddp_monitored": (1025, 750), "fsdp": (1118, 750),
    "pipeline_naive": (932, 750), "pipeline": (1042, 750), "tensor_parallel": (1145, 750), "fsdp_tp": (1159, 750),
}  # fmt: skip
RATCHET = 20


def _defined(path: Path) -> set[str]:
    """The top-level names a file defines (functions, classes, assignments), private ones too."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _imports(path: Path) -> list[str]:
    """The modules a file imports, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.append(node.module or "")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def test_no_two_files_a_copy_joins_define_one_name():
    """35.4: the recipe, the kernel files and every plug-in define each name once, private names too, so that any
    joined variant runs as its files do."""
    seen: dict[str, Path] = {}
    for path in [*KERNEL_FILES, *PLUGIN_FILES, *(Path(RECIPES[n].source_file) for n in ON_KERNEL)]:
        for name in _defined(path):
            assert name not in seen or path.parent.name == "recipes", f"{name}: {seen.get(name)} and {path}"
            seen.setdefault(name, path)


def test_the_kernel_imports_no_plug_in_and_no_module_outside_itself():
    """The import graph is one-way: the kernel imports only the kernel; a plug-in imports the kernel and the opt-ins
    every recipe that offers it joins (a seam read by an opt-in lives there); no recipe imports tools, and no core
    module imports tools or recipes."""
    from tools.copy_out import opt_ins

    for path in KERNEL_FILES:
        assert all(not m.startswith("core") or m.startswith("core.kernel") for m in _imports(path)), path
    for path in PLUGIN_FILES:
        wanted = {m.removeprefix("core.") for m in _imports(path) if m.startswith("core.") and "kernel" not in m}
        offering = [n for n in ON_KERNEL if path.stem in plugins_of(RECIPES[n])]
        for name in offering:
            joined = {p.stem for p in opt_ins(Path(RECIPES[name].source_file).read_text())}
            assert wanted <= joined, (path.stem, name, wanted - joined)
    for path in [*(REPO / "recipes").glob("[a-z]*.py"), *(REPO / "core").rglob("*.py")]:  # not `python -m recipes`
        assert not any(m.split(".")[0] == "tools" for m in _imports(path)), path
    for path in (REPO / "core").rglob("*.py"):
        assert not any(m.split(".")[0] == "recipes" for m in _imports(path)), path


def test_a_plug_in_appends_to_the_seams_and_never_rebinds_a_kernel_name():
    """35.3: a plug-in's module-level statements that touch the kernel are appends or updates of a seam table."""
    tables = _defined(REPO / "core" / "kernel" / "seams.py")
    kernel_names = set().union(*(_defined(p) for p in KERNEL_FILES))
    for path in PLUGIN_FILES:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                target = node.value.func
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    if target.value.id in kernel_names:
                        assert target.value.id in tables and target.attr in ("append", "update"), (path, target.attr)
            if isinstance(node, ast.Assign):
                assert not {t.id for t in node.targets if isinstance(t, ast.Name)} & kernel_names, path
            if isinstance(node, ast.Subscript | ast.Assign) and isinstance(
                getattr(node, "targets", [None])[0], ast.Subscript
            ):
                assert node.targets[0].value.id in tables, path


def test_every_plug_in_is_registered_and_the_package_attaches_exactly_those():
    """The registry's PLUGINS table names each file of core/plugins/; the package's recipes on the kernel run with
    the shared ones (core/attach.py imports each) and their own, which the recipe's module imports."""
    from tools.registry import KERNEL_PLUGINS

    assert sorted(p.stem for p in PLUGIN_FILES) == sorted(PLUGINS)
    init = (REPO / "core" / "attach.py").read_text()
    assert sorted(re.findall(r"^    (\w+),$", init, flags=re.M)) == sorted(KERNEL_PLUGINS)
    for name in ON_KERNEL:
        own = plugins_of(RECIPES[name])[len(KERNEL_PLUGINS) :]
        assert plugins_of(RECIPES[name])[: len(KERNEL_PLUGINS)] == list(KERNEL_PLUGINS), name
        source = Path(RECIPES[name].source_file).read_text()
        assert all(re.search(rf"^from core\.plugins import .*\b{p}\b", source, flags=re.M) for p in own), name


def test_an_optional_package_is_imported_inside_the_function_that_uses_it():
    for path in [*KERNEL_FILES, *PLUGIN_FILES]:
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.Import | ast.ImportFrom)]
        modules = {getattr(n, "module", None) or n.names[0].name for n in top}
        assert not {m.split(".")[0] for m in modules} & {"transformers", "tensorboard", "wandb", "sklearn"}, path


def test_tools_join_on_lines_and_import_no_ast():
    """35.4: the join works on lines; the generator's `ast` is gone from the files that copy a kernel recipe."""
    for name in ("copy_out.py",):
        assert "ast" not in [m.split(".")[0] for m in _imports(REPO / "tools" / name)]


def test_tools_is_at_most_3700_lines():
    """35.7: the command line, pre-check, plan and join together; the kernel's pieces do the rest."""
    assert sum(len(p.read_text().splitlines()) for p in (REPO / "tools").glob("*.py")) <= 3700


def test_the_join_changes_no_line_of_a_file_it_joins(tmp_path):
    """35.4: beyond the imports merged, the package's own imports dropped and the header, every line of the recipe,
    the kernel and the plug-ins stands in the copy as written, the recipe's functions first and its options last."""
    text = join("ddp", str(tmp_path / "train.py"), kept=plugins_of(RECIPES["ddp"]))
    for path in [*KERNEL_FILES, *(REPO / "core" / "plugins" / f"{p}.py" for p in plugins_of(RECIPES["ddp"]))]:
        doc, _, body = split_file(path.read_text())
        assert body in text and doc in text, path
    recipe = Path(RECIPES["ddp"].source_file).read_text()
    head, _, tail = split_file(recipe)[2].partition("# Options and start:")
    assert text.index(head.strip()) < text.index("# from core/kernel/seams.py") < text.index(tail.strip())
    assert not re.search(r"^\s*(from|import) core\b", text, flags=re.M)


def test_merged_imports_keep_each_name_once_and_drop_the_package():
    block = merge_imports(
        [
            "from __future__ import annotations",
            "import os",
            "from torch import nn",
            "from core.kernel.job import say",
            "import os",
            "from torch import Tensor, nn",
            "from collections.abc import (\n    Callable,\n    Mapping,\n)",
        ]
    )
    assert block == (
        "from __future__ import annotations\n\nimport os\nfrom collections.abc import Callable, Mapping\n\n"
        "from torch import Tensor, nn"
    )


def test_with_names_the_plug_ins_and_all_in_one_line():
    """35.4: an unknown --with is one line ending `choose from all, A, B, ...`."""
    with pytest.raises(Exception, match=r"--with nosuch: choose from all, init_from, hf, loss, factories, meter"):
        parse_with("nosuch,hf", recipe="ddp")
    offered = plugins_of(RECIPES["ddp"])
    assert parse_with("all", recipe="ddp") == offered and parse_with("hf,lock", recipe="ddp") == ["hf", "lock"]
    bad = CliRunner().invoke(cli, ["cp", "ddp", "x.py", "--standalone", "--with", "nosuch"])
    assert bad.exit_code == 2 and bad.output.strip().splitlines()[-1].endswith(", ".join(offered))


def test_the_header_names_each_plug_in_left_out_and_the_with_that_adds_it(tmp_path):
    text = join("ddp", str(tmp_path / "train.py"), kept=["hf"])
    said = text.replace("\n# ", " ")
    left = said[said.index("each added by `--with NAME`") :].split(": ", 1)[1].split(".")[0].split(", ")
    assert left == [p for p in plugins_of(RECIPES["ddp"]) if p != "hf"]


@pytest.mark.parametrize("name", ON_KERNEL)
def test_the_lean_copy_meets_its_budget_and_imports_nothing_it_does_not_need(name, tmp_path):
    """35.5: the lean copy within its budget (a ratchet), and the lean ddp copy imports none of inspect, importlib,
    struct and fcntl (what only the plug-ins need)."""
    text = join(name, str(tmp_path / "train.py"), kept=[])
    lines, code = copy_size(text)
    budget_lines, budget_code = LEAN_BUDGET[name]
    assert lines <= budget_lines and code <= budget_code, (lines, code)
    if budget_code > ASKED.get(name, 750):  # not yet what the issue asks: every cut lowers the ceiling
        assert code > budget_code - RATCHET, f"{name}'s copy is {code} code lines: lower its budget to {code}"
    imported = {m.split(".")[0] for m in _imports_text(text)}
    assert not imported & {"inspect", "importlib", "struct", "fcntl"}, imported


def _imports_text(text: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            found.append(node.module or "")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


@pytest.mark.parametrize("name", ON_KERNEL)
def test_every_top_level_function_a_lean_copy_joins_is_called(name, tmp_path):
    """35.1 for every lean copy: each function its files define is called (a copy joins only the kernel files whose
    functions it calls: kernel/replica.py with a whole replica's evaluation and checkpoint, kernel/step.py with
    step_plain)."""
    tree = ast.parse(join(name, str(tmp_path / "train.py"), kept=[]))
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert functions - used == set()


def test_a_copy_names_only_options_it_has(tmp_path):
    """35.4: the lean copy's --help lists the recipe's own options, none of a plug-in left out; with a plug-in, its
    options too (the whole --help of the package's recipe when joined with all)."""
    lean, full = tmp_path / "lean.py", tmp_path / "full.py"
    lean.write_text(join("ddp", str(lean), kept=[]))
    full.write_text(join("ddp", str(full), kept=list(plugins_of(RECIPES["ddp"]))))
    said = {}
    for path in (lean, full):
        proc = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
        said[path.stem] = set(re.findall(r"^  (--[a-z-]+)", proc.stdout, flags=re.M))
    for option in ("--init-from", "--model", "--data", "--loss", "--hf-attr"):
        assert option in said["full"] and option not in said["lean"], option
    assert {"--epochs", "--resume", "--ckpt-every", "--static-graph"} <= said["lean"]

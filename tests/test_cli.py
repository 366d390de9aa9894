"""Layer 3: the command line and the launcher as a user runs them; bad input gives one line."""

import ast
import itertools
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from core.kernel.builtin import MLP
from helpers import REPO, in_one_interpreter, recipe_params, recipes_cli, run, torchrun, user_env
from tools.cli import cli
from tools.registry import RECIPES


def _one_error_line(proc):
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return lines[-1]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


@pytest.mark.fast
def test_ls_prints_the_readmes_table():
    """27.6: the README's recipe table is what `ls` prints, cell for cell, every recipe in the registry's order; the
    README adds two columns, each copy's size and each feature's cost."""
    printed = [_cells(line) for line in CliRunner().invoke(cli, ["ls"]).output.splitlines()]
    readme = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(readme) if line.startswith("| recipe | builds on |"))
    table = [_cells(line) for line in itertools.takewhile(lambda line: line.startswith("|"), readme[start:])]
    assert [row[: len(printed[0])] for row in table] == printed and len(printed) == len(RECIPES) + 2
    assert printed[0][:3] == ["recipe", "builds on", "multi-node"]
    assert table[0][-2:] == ["its lean standalone copy: lines (code)", "code lines each `--with FEATURE` adds"]
    for row, recipe in zip(printed[2:], RECIPES.values()):
        assert (
            row[0] == f"`{recipe.name}`" and row[3] == recipe.summary and row[4] == (", ".join(recipe.opt_ins) or "-")
        )


@pytest.mark.e2e
def test_ls_runs_as_a_command(commands):
    proc, _ = commands["ls"]
    assert proc.returncode == 0 and proc.stdout == CliRunner().invoke(cli, ["ls"]).output


def _core_imports(name: str) -> set[str]:
    """The core modules a recipe's file imports: `from core import a, b`, `from core.x import y`, `import core.x`."""
    found = set()
    for node in ast.walk(ast.parse(Path(RECIPES[name].source_file).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "core":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("core."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("core.")}
    return found


@pytest.mark.fast
@pytest.mark.parametrize("name", recipe_params(sorted(RECIPES)))
def test_the_registry_names_exactly_the_opt_ins_a_recipe_imports(name):
    """ddp is the base: a recipe's opt-ins are the core modules it imports beyond the kernel and the plug-ins (README's
    table)."""
    assert RECIPES["ddp"].opt_ins == () and _core_imports("ddp") == {"kernel", "attach"}
    base = _core_imports("ddp") | {"plugins"}  # its own plug-ins are no opt-in
    assert sorted(RECIPES[name].opt_ins) == sorted(_core_imports(name) - base)


README_MOST_LINES = 300  # issue 36: a README a newcomer reads; the reference lives in docs/
QUICK_START = ("pip install -e . && ./launch_single_node.sh", "pip install -e '.[test]' && pytest")


def _anchors(markdown: str) -> Iterator[str]:
    """The anchors GitHub makes of a file's headings: lower case, punctuation out, spaces to dashes, repeats -1, -2."""
    seen: dict[str, int] = {}
    for line in _outside_code(markdown):
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def _outside_code(markdown: str) -> Iterator[str]:
    """The lines of a markdown file outside its fenced code blocks."""
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield line


def _relative_links(path: Path) -> list[str]:
    """Every link target in a markdown file that is not a URL: `[text](target)`, outside code blocks."""
    return [
        target
        for line in _outside_code(path.read_text())
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", line)
        if not re.match(r"[a-z]+:", target)
    ]


@pytest.mark.fast
def test_the_readme_is_short_holds_the_two_commands_and_links_to_docs():
    """Issue 36.2: the README is at most 300 lines, shows the quick start's two commands each in a code block, and
    names every page of docs/ by a link (where each topic's reference lives)."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MOST_LINES, len(readme.splitlines())
    code = list(itertools.chain.from_iterable(block.splitlines() for block in readme.split("```")[1::2]))
    for command in QUICK_START:
        assert command in code, command
    linked = {(REPO / target.split("#")[0]).resolve() for target in _relative_links(REPO / "README.md")}
    assert {page.resolve() for page in (REPO / "docs").glob("*.md")} <= linked


@pytest.mark.fast
@pytest.mark.parametrize("page", ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))])
def test_every_relative_link_resolves(page):
    """Every relative link in README.md and docs/*.md names a file or folder that exists, and an anchor its page has."""
    source = REPO / page
    for target in _relative_links(source):
        file, _, anchor = target.partition("#")
        dest = (source.parent / file).resolve() if file else source
        assert dest.exists(), f"{page}: {target}: no {dest}"
        if anchor and dest.suffix == ".md":
            assert anchor in set(_anchors(dest.read_text())), f"{page}: {target}: no heading makes #{anchor}"


BAD_INPUT = [
    (["run", "resnet"], "unknown recipe 'resnet'; choose one of: "),
    (["run", "ddp", "--batch-size", "0"], "--batch-size 0"),
    (["run", "ddp", "--epochs", "-1"], "--epochs -1"),
    (["run", "ddp_amp", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["run", "ddp", "--batch-size", "many"], "invalid int value: 'many'"),
    (["run", "ddp", "--model", "nosuchpkg.models:build"], "cannot import 'nosuchpkg.models'"),
    (["run", "ddp", "--data", "core.zoo:nothing"], "has no function 'nothing'"),
    (["run", "ddp", "--no-such-option"], "--no-such-option: ddp does not take it; no recipe does"),
    (["cp", "nope", "x.py"], "unknown recipe 'nope'"),
]
# Issue 36 item 4: a malformed RANK, WORLD_SIZE or LOCAL_RANK in any path (the error path, which reads RANK to print,
# included) is one line naming the variable: (its environment, the command, `python FILE` or not, what it says)
BAD_ENV = [
    ({"RANK": "abc"}, ["run", "ddp", "--max-steps", "1"], None, "RANK='abc'"),
    ({"RANK": "abc", "WORLD_SIZE": "2"}, ["run", "ddp", "--max-steps", "1"], None, "RANK='abc'"),
    ({"WORLD_SIZE": "two"}, ["run", "ddp", "--max-steps", "1"], None, "WORLD_SIZE='two'"),
    ({"LOCAL_RANK": "-1"}, ["run", "ddp", "--max-steps", "1"], None, "LOCAL_RANK='-1'"),
    ({"RANK": "abc"}, ["run", "ddp", "--max-steps", "1", "--dry-run"], None, "RANK='abc'"),
    ({"WORLD_SIZE": "x"}, ["plan", "ddp"], None, "WORLD_SIZE='x'"),
]


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """This module's `python -m recipes ARGS` and `python FILE ARGS` on one process (BAD_INPUT, --help, an unwritable
    --out, ls, a dp run; cp, the copy's run, cp again), all in one interpreter, in turn (tests/cli_cases.py: the same
    __main__, each case in a working folder of its own, its own stdout and stderr, its exit status): {case: (what it
    returned, its folder)}."""
    cases = {}

    def case(key: str, args: list[str], folder: Path | None = None, file: Path | None = None, env=None) -> Path:
        folder = folder or tmp_path_factory.mktemp(key.replace(" ", "-"))
        cases[key] = ({"args": args, "cwd": str(folder)} | ({"file": str(file)} if file else {}), folder)
        cases[key][0].update({"env": env} if env else {})
        return folder

    for i, (args, _) in enumerate(BAD_INPUT):
        folder = tmp_path_factory.mktemp(f"bad{i}")
        case(f"bad{i}", [*args, "--out", str(folder)] if args[0] == "run" else args, folder)
    for i, (env, args, file, _) in enumerate(BAD_ENV):
        folder = tmp_path_factory.mktemp(f"env{i}")
        case(f"env{i}", [*args, "--out", str(folder)] if args[0] != "plan" else args, folder, file, env)
    case("file env", ["--max-steps", "1"], None, REPO / "recipes" / "ddp.py", {"RANK": "abc"})  # the recipe as a file
    case("help", ["--help"])
    case("run help", ["run", "ddp", "--help"])
    blocker = tmp_path_factory.mktemp("unwritable") / "a-file"
    blocker.write_text("not a folder")
    case("unwritable", ["run", "ddp", "--out", str(blocker / "runs")], blocker.parent)
    case("ls", ["ls"])
    dp = tmp_path_factory.mktemp("dp")
    case("dp", ["run", "dp", "--max-steps", "3", "--out", str(dp)], dp)
    copied = tmp_path_factory.mktemp("cp")
    case("cp", ["cp", "ddp", str(copied / "train.py")], copied)
    case("the copy", ["--max-steps", "2", "--out", str(copied / "runs")], copied, file=copied / "train.py")
    case("cp again", ["cp", "ddp", str(copied / "train.py")], copied)
    said = in_one_interpreter([c for c, _ in cases.values()])
    return {key: (proc, folder) for (key, (_, folder)), proc in zip(cases.items(), said, strict=True)}


def test_help_works(commands):
    assert "run" in commands["help"][0].stdout
    assert "--batch-size" in commands["run help"][0].stdout


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[" ".join(args) for args, _ in BAD_INPUT])
def test_bad_input_is_one_line(commands, case):
    proc, folder = commands[f"bad{case}"]
    assert BAD_INPUT[case][1] in _one_error_line(proc)
    assert not list(folder.glob("ddp-*")), "nothing is created by a run that never started"


@pytest.mark.parametrize("case", range(len(BAD_ENV)), ids=[f"{e} {' '.join(a)}" for e, a, _, _ in BAD_ENV])
def test_a_malformed_rank_variable_is_one_line_naming_it(commands, case):
    proc, folder = commands[f"env{case}"]
    line = _one_error_line(proc)  # the last line, no traceback: also where `fail` reads RANK to print it
    assert BAD_ENV[case][3] in line and "is not an integer" in line, line
    assert not list(folder.glob("ddp-*")), "nothing is created by a run that never started"


def test_a_malformed_rank_variable_stops_a_recipe_file_before_it_writes(commands):
    """The recipe run as a file (as a copy is) reads torchrun's variables as they are: the package's runner checks
    them (above); here int() refuses the value, in the run's last line, before anything is written."""
    proc, folder = commands["file env"]
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and line.startswith("error: ValueError: ") and "'abc'" in line, proc.stderr
    assert not list(folder.glob("ddp-*")), "nothing is created by a run that never started"


def test_unwritable_out_is_one_line(commands):
    proc, folder = commands["unwritable"]
    line = _one_error_line(proc)
    assert f"--out {folder / 'a-file' / 'runs'}: cannot write there" in line


@pytest.mark.parametrize("recipe", [["ddp"], []], ids=["named", "default"])
def test_bad_input_under_the_launcher_is_one_line(tmp_path, recipe):
    launcher = [str(REPO / "launch_single_node.sh"), *recipe, "--lr", "-1"]  # NPROC_PER_NODE: no python counts GPUs
    proc = run(launcher, cwd=tmp_path, env=user_env(NPROC_PER_NODE="2"), check=False, timeout=60)
    assert "--lr -1.0" in _one_error_line(proc)


def test_bad_input_under_torchrun_leaves_no_rank_hanging(tmp_path):
    # Straight under torchrun (no launcher pre-check): every rank fails before joining, torchrun exits.
    proc = run(
        torchrun("-m", "recipes", "run", "ddp", "--model", "nosuchpkg:build", "--out", str(tmp_path)),
        cwd=tmp_path,
        check=False,
        timeout=120,
    )
    assert proc.returncode != 0 and "cannot import 'nosuchpkg'" in proc.stderr


def test_recipes_never_import_each_other():
    for path in (REPO / "recipes").glob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
            )
            assert not any(n == "recipes" or n.startswith("recipes.") for n in names), f"{path.name} imports {names}"


def test_every_recipe_docstring_starts_with_its_launch_commands():
    for name, recipe in RECIPES.items():
        doc = ast.get_docstring(ast.parse(Path(recipe.source_file).read_text()))
        commands = [line.strip() for line in doc.splitlines()[1:8] if line.strip()]
        assert any(name in c and ("launch_single_node.sh" in c or "recipes run" in c) for c in commands), name


@pytest.mark.fast
def test_python_m_recipes_reads_the_console_script_and_says_one_line_without_it(monkeypatch):
    """recipes/__main__.py imports no tools/: it runs the installed torch-dist-recipes entry point (tools.cli:main);
    a source tree that was never installed has none, and `python -m recipes` says so in one line."""
    import importlib.metadata
    import runpy

    (command,) = importlib.metadata.entry_points(group="console_scripts", name="torch-dist-recipes")
    assert command.value == "tools.cli:main"
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("recipes", run_name="__main__")
    message = str(exited.value.code)
    assert message.startswith("error: python -m recipes needs the package installed") and "\n" not in message
    assert message.endswith("run pip install -e . in the repository")


def test_the_import_graph_is_one_way_and_has_no_cycle():
    """recipes -> core, tools -> recipes and core; nothing in core imports upward; no module imports itself back."""
    graph = {}
    for folder in ("core", "recipes", "tools"):
        for path in (REPO / folder).glob("*.py"):
            module = f"{folder}.{path.stem}"
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
            graph[module] = {
                m
                for m in found
                if m.split(".")[0] in ("core", "recipes", "tools")
                and m in {f"{f}.{p.stem}" for f in ("core", "recipes", "tools") for p in (REPO / f).glob("*.py")}
            }
    layer = {"core": 0, "recipes": 1, "tools": 2}
    for module, imports in graph.items():
        for imported in imports:
            assert layer[imported.split(".")[0]] <= layer[module.split(".")[0]], f"{module} imports {imported}"
            if module.startswith("recipes.") and not module.endswith("__main__"):
                assert not imported.startswith("recipes."), f"{module} imports {imported}"
    state = dict.fromkeys(graph, 0)  # 0 new, 1 on the path, 2 done: a depth-first search for a cycle

    def visit(module, path):
        state[module] = 1
        for imported in graph.get(module, ()):
            assert state.get(imported) != 1, f"an import cycle: {' -> '.join([*path, imported])}"
            if state.get(imported) == 0:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in graph:
        if state[module] == 0:
            visit(module, [module])


def test_launcher_default_job_trains_digits_and_writes_plain_weights(tmp_path):
    """The README's first command: no argument, the ddp recipe, 2 CPU processes, the embedded digits."""
    proc = run([str(REPO / "launch_single_node.sh")], cwd=tmp_path, timeout=300, env=user_env())
    summary_line = proc.stdout.strip().splitlines()[-1]
    assert summary_line.startswith("summary ") and "model.safetensors" in summary_line
    run_dir = tmp_path / "runs" / "ddp-1"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"train", "eval", "summary"} <= {r["kind"] for r in records}
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["world_size"] == 2
    for field in ("val_loss", "val_acc", "samples_per_s", "steps", "elapsed_s"):
        assert field in summary
    assert summary["val_acc"] >= 0.95, summary
    config = json.loads((run_dir / "config.json").read_text())
    assert config["recipe"] == "ddp" and config["world_size"] == 2
    state = load_file(run_dir / "model.safetensors")
    assert not any(k.startswith("module.") for k in state)
    model = MLP()
    model.load_state_dict(state)  # strict: every key of the plain model, nothing else
    from core.zoo import quick_digits as digits

    inputs, targets = digits()[1][:]
    accuracy = (model(inputs).argmax(-1) == targets).float().mean().item()
    assert accuracy == pytest.approx(summary["val_acc"], abs=1e-6), "the saved weights are the evaluated ones"


def test_dp_without_gpus_says_so_and_trains(commands):
    proc, folder = commands["dp"]
    assert proc.returncode == 0 and "plain single-device training" in proc.stdout, proc.stderr
    assert (folder / "dp-1" / "model.safetensors").exists()


def test_cp_copies_a_recipe_that_runs(commands):
    copied, folder = commands["cp"]
    assert copied.returncode == 0, copied.stderr
    dest = folder / "train.py"
    text = dest.read_text()
    assert f"python {dest}" in text and "-m recipes run ddp" not in text
    proc, _ = commands["the copy"]
    assert proc.returncode == 0 and "summary " in proc.stdout, proc.stderr
    assert "exists" in _one_error_line(commands["cp again"][0])


def test_third_party_recipe_joins_through_the_entry_point_group(tmp_path):
    (tmp_path / "my_recipe.py").write_text(
        '"""my_recipe: a plugin.\n\n    python -m recipes run my_recipe\n"""\n'
        "from dataclasses import dataclass\n\n"
        "from core.kernel.job import Training\n"
        "from core.kernel.seams import SEAMS\n"
        "from core.plugins import factories, loss  # --model, --data, --loss: what the pre-check calls\n"
        "from tools.registry import Recipe\n\n"
        "PLUGINS = ('factories', 'loss')\n"
        "RECIPE = Recipe('my_recipe', 'my_recipe', 'a third-party recipe', builds_on='ddp', plugins=PLUGINS)\n\n\n"
        "@dataclass(frozen=True)\nclass Config(Training, *SEAMS['option_groups']):\n    pass\n\n\n"
        "def main(cfg):\n    print('plugin ran with lr', cfg.lr)\n"
    )
    dist_info = tmp_path / "my_recipe-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-recipe\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[torch_dist_recipes]\nmy_recipe = my_recipe:RECIPE\n")
    env = user_env(PYTHONPATH=str(tmp_path))
    assert "a third-party recipe" in recipes_cli("ls", env=env).stdout
    assert "plugin ran with lr 0.5" in recipes_cli("run", "my_recipe", "--lr", "0.5", env=env, cwd=tmp_path).stdout


def test_third_party_plug_in_joins_through_its_entry_point_group(tmp_path):
    """35.3: a package adds a plug-in as it adds a recipe: the runner attaches it to the recipes on the kernel (its
    option in --help, its hook in the run), and `cp --standalone --with` offers it and joins its file."""
    (tmp_path / "my_plugin.py").write_text(
        '"""my_plugin: a greeting after the job."""\n'
        "from dataclasses import dataclass\n\n"
        "from core.kernel.job import Options, option\n"
        "from core.kernel.seams import SEAMS\n"
        "from tools.registry import Plugin\n\n"
        "PLUGIN = Plugin('greeting', 'my_plugin', 'a greeting in the summary')\n\n\n"
        "@dataclass(frozen=True)\nclass Greeting(Options):\n"
        "    greeting: str = option('hello', 'what the summary says')\n\n\n"
        "def greet(cfg, run, model):\n    return {'greeting': cfg.greeting}\n\n\n"
        "SEAMS['option_groups'].append(Greeting)\nSEAMS['after_job'].append(greet)\n"
    )
    dist_info = tmp_path / "my_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[torch_dist_recipes.plugins]\ngreeting = my_plugin:PLUGIN\n")
    commands = [  # in one interpreter, in turn (tests/cli_cases.py)
        ["run", "ddp", "--help"],
        ["run", "ddp", "--max-steps", "1", "--epochs", "1", "--greeting", "hi"],
        ["cp", "ddp", "x.py", "--standalone", "--with", "nosuch"],
    ]
    cases = [{"args": args, "cwd": str(tmp_path)} for args in commands]
    helped, ran, bad = in_one_interpreter(cases, env=user_env(PYTHONPATH=str(tmp_path)))
    assert helped.returncode == 0 and "--greeting" in helped.stdout, helped.stderr
    assert ran.returncode == 0 and "greeting=hi" in ran.stdout, ran.stderr
    assert bad.stderr.strip().endswith("take_back, replicas, longer, greeting"), bad.stderr


@pytest.mark.e2e
@pytest.mark.parametrize(
    "entry", ["runpy.run_module('recipes', run_name='__main__')", "runpy.run_path(RECIPE, run_name='__main__')"]
)
def test_a_training_process_ends_without_the_interpreter_teardown(entry, tmp_path):
    """DDP keeps gloo's worker threads alive to the end; a teardown racing them can SIGABRT a run that ended well
    (tools/options.py's leave, the kernel's cli_main). Both entry points leave through os._exit, after flushing what
    they printed."""
    # the package's CLI checks the options (--dry-run); the recipe's file, run as a script, trains no step
    script = (
        "import atexit, runpy, sys\n"
        "atexit.register(print, 'teardown ran')\n"
        f"RECIPE = {str(REPO / 'recipes' / 'ddp.py')!r}\n"
        "module = 'module' in sys.argv[1]\n"
        "sys.argv = [RECIPE, *(['run', 'ddp', '--dry-run'] if module else ['--epochs', '0', '--out', sys.argv[2]])]\n"
        f"{entry}\n"
    )
    proc = run([sys.executable, "-c", script, entry, str(tmp_path)], check=False)
    assert proc.returncode == 0, proc.stderr
    said = "ok: " if "module" in entry else "summary "
    assert said in proc.stdout and "teardown ran" not in proc.stdout


@pytest.mark.e2e
def test_a_failed_collective_ends_with_its_traceback_and_without_the_teardown():
    """An error that is not the user's (a peer's link cut: a RuntimeError from gloo) prints Python's traceback and
    exits 1, as an uncaught exception would, but through os._exit (the kernel's cli_main): the teardown race aborted
    it too."""
    script = (
        "import atexit, sys\n"
        "atexit.register(print, 'teardown ran')\n"
        "from core.kernel.job import cli_main\n"
        "from recipes.ddp import Config\n"
        "def main(cfg):\n"
        "    raise RuntimeError('Application timeout caused pair closure')\n"
        "sys.argv = ['ddp']\n"
        "cli_main(main, Config)\n"
    )
    proc = run([sys.executable, "-c", script], check=False)
    assert proc.returncode == 1 and "teardown ran" not in proc.stdout
    assert proc.stderr.startswith("Traceback") and "RuntimeError: Application timeout" in proc.stderr

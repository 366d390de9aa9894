"""Layer 3: `python -m recipes cp NAME DEST --standalone`, for every recipe registered when the tests run.

Each copy goes into a fresh folder, and its PYTHONPATH puts stand-ins for `core` and `recipes`
first that raise on import: a copy that still needs this package fails loudly instead of quietly
importing the installed one. It runs under torchrun with the process count of its docstring's
first launch command, at most 2 (1 for dp and pipeline_naive; fsdp_tp on 2), next to the packaged
recipe on as many processes, and the final weights must be equal bit for bit: the same code doing the same
arithmetic in the same order, so there is nothing for a tolerance to absorb.
"""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file
from test_copy_out import LEAN_BUDGET

from helpers import REPO, recipe_params, run, torchrun, user_env, waiting
from tools.cli import cli
from tools.copies import breakdown, copy_source, feature_options, offered, size_cells, size_variants
from tools.copy_out import copy_size
from tools.registry import PLUGINS, RECIPES

NAMES = sorted(RECIPES)
READY = [n for n in NAMES if not waiting(n)]  # the others wait for their move to the new core


def _first_command(text: str) -> str:
    """The first launch command of a recipe's docstring (its docstring starts with them)."""
    return next(line.strip() for line in ast.get_docstring(ast.parse(text)).splitlines()[1:] if line.strip())


# A copy trains on the process count of its first launch command, at most 2 (this machine's cores): fsdp_tp's
# 2 x 2 mesh runs as 1 x 2 here, the same code; tests/test_model_parallel_2d.py trains the 2 x 2 mesh.
MAX_PROCS = 2
# ddp's copy trains a transformers GPT-2 on dict batches (tests/check_user.py), ddp_amp's a nanoGPT-style model on its
# own loss over a stream without a length, the others their built-in model and data.
USER_ARGS = {
    "ddp": ["--model", "check_user:gpt2", "--data", "check_user:lm"],
    "ddp_amp": ["--model", "check_user:nano", "--data", "check_user:pair_stream"],
}
TRAIN_ARGS = ["--max-steps", "3", "--epochs", "1", "--timeout-s", "60"]
# Per rank: 8 on the user's small data sets (USER_ARGS), which hold 3 steps of it; 32 on the built-in data, where the
# evaluation of the whole validation set is the most of a short run's time (under tensor parallel a collective per
# forward): a quarter of the forwards of 8.
BATCH, USER_BATCH = "32", "8"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A folder without this package, holding standalone copies of every recipe: `NAME.py` (lean), `NAME_all.py`
    and `NAME_with_FEATURE.py`, each as `cp NAME PATH --standalone [--with ...]` writes it (tools.copies.copy_source,
    what cp calls), all formatted by one `ruff format` (one process, not 130)."""
    root = tmp_path_factory.mktemp("standalone")
    for package in ("core", "recipes"):  # found before the installed package, and refusing to load
        (root / "blocked" / package).mkdir(parents=True)
        (root / "blocked" / package / "__init__.py").write_text(
            f'raise ImportError("a standalone copy imported {package!r} from torch-dist-recipes")\n'
        )
    (root / "project").mkdir()
    for name in READY:
        for variant in size_variants(name):
            kept = set(offered(name)) if variant == "all" else {variant} - {""}
            path = root / "project" / f"{_stem(name, variant)}.py"
            path.write_text(copy_source(name, str(path), kept=kept))
    if ruff := shutil.which("ruff"):
        run([ruff, "format", "--isolated", "--line-length", "120", str(root / "project")], timeout=120)
    return root


def _stem(name: str, variant: str) -> str:
    """ddp.py (lean), ddp_all.py (--with all), ddp_with_hf.py (--with hf)."""
    return name if not variant else f"{name}_{variant}" if variant == "all" else f"{name}_with_{variant}"


# Every recipe's lean copy and its --with all copy; ddp's copy with each single feature too.
VARIANTS = [(n, v) for n in READY for v in ("", "all")]
VARIANTS += [("ddp", f) for f in offered("ddp")]


def _env(project: Path) -> dict[str, str]:
    return user_env(PYTHONPATH=str(project / "blocked"))


def _world_size(text: str) -> int:
    """The process count of a copy's first launch command: the world size the recipe is made for."""
    found = re.match(r"torchrun .*--nproc-per-node (\d+)", _first_command(text))
    return int(found[1]) if found else 1  # otherwise `python DEST ...`: one process


def test_the_package_cannot_be_imported_there(project):
    proc = run([sys.executable, "-c", "import core"], cwd=project / "project", env=_env(project), check=False)
    assert proc.returncode != 0 and "imported 'core'" in proc.stderr


@pytest.fixture(scope="module")
def linted(project) -> dict[str, list[str]]:
    """path -> what `ruff check --select F` and `ruff format --check` say of it, for every copy of VARIANTS: one run
    of each over all of them (each names the file of what it finds), not two processes per copy."""
    files = [str(project / "project" / f"{_stem(name, variant)}.py") for name, variant in VARIANTS]
    said: dict[str, list[str]] = {path: [] for path in files}
    if not shutil.which("ruff"):
        return said
    for command in (["check", "--select", "F"], ["format", "--check", "--line-length", "120"]):
        proc = subprocess.run(
            ["ruff", *command, "--no-cache", "--isolated", "--output-format", "json", *files],
            capture_output=True,
            text=True,
            timeout=120,
        )
        found = json.loads(proc.stdout or "[]")
        assert found or proc.returncode == 0, proc.stdout + proc.stderr  # a failure that names no file
        for entry in found:
            said[entry["filename"]].append(f"{command[0]}: {entry['code']} {entry['message']} line {entry['location']}")
    return said


@pytest.mark.parametrize("name,variant", VARIANTS)
def test_copy_is_one_whole_file(project, linted, name, variant):
    path = project / "project" / f"{_stem(name, variant)}.py"
    text = path.read_text()
    tree = ast.parse(text)
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + [
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    ]
    assert not [m for m in imported if m and m.split(".")[0] in ("core", "recipes")], imported
    doc = ast.get_docstring(tree)
    assert not _misindented(tree), f"{name}: lines indented off the 4-space grid: {_misindented(tree)}"
    assert text.index("\ndef train(") < re.search(r"# (inlined )?from core/", text).start()  # the recipe comes first
    assert doc.startswith(f"{name}:")
    first = next(line.strip() for line in doc.splitlines()[1:] if line.strip())
    assert first.startswith(("torchrun ", "python ")) and str(path) in first, first
    assert "-m recipes" not in doc and "launch_single_node.sh" not in doc
    if shutil.which("ruff"):  # no undefined, unused or redefined names after the merge, and formatted
        assert not linted[str(path)], linted[str(path)]
    header = text[: text.index("\nfrom __future__")]
    assert f"`python -m recipes run {name}` has them" in header and "# Left out: the pre-launch checks" in header
    have = offered(name)
    kept = have if variant == "all" else [variant] if variant else []
    flat = header.replace("\n# ", " ")  # the header's lines are wrapped at 120 columns
    left = set(re.findall(r"`--with (\w+)` adds it", flat))  # the generator's copies: a line each
    if "each added by `--with NAME`" in flat:  # a joined copy: the names in one sentence
        left |= set(flat.split("each added by `--with NAME`")[1].split(": ", 1)[1].split(".\n")[0].split(", "))
    assert left == {feature for feature in have if feature not in kept}, header  # each with the --with that adds it


# The lean copies' budgets are tests/test_copy_out.py's LEAN_BUDGET (its budget test holds them, with a ratchet down to
# what issue 35 asks). The README's recipe table prints each lean copy's size and each feature's cost: tests hold it
# exact, and `TDR_SIZES=rewrite pytest tests/test_standalone.py -k readme` rewrites it after a change of the code.
BUDGET = LEAN_BUDGET  # one table of the lean copies' budgets: tests/test_copy_out.py's
SIZE_COLUMNS = ("its lean standalone copy: lines (code)", "code lines each `--with FEATURE` adds")


@pytest.fixture(scope="module")
def sizes(project) -> dict[str, dict[str, tuple[int, int]]]:
    """{recipe: {variant: (lines, code lines)}} of every copy the README sizes (a copy's path is in its docstring
    only, so its size is the same at any path: test_cp_says_the_copys_size checks one made by `cp` elsewhere)."""
    return {
        name: {v: copy_size((project / "project" / f"{_stem(name, v)}.py").read_text()) for v in size_variants(name)}
        for name in READY
    }


def _readme_size_rows() -> tuple[list[str], int, dict[str, tuple[int, list[str]]]]:
    """(README lines, the index of the first row, {recipe: (its line's index, its cells)}) of the recipe table."""
    readme = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(readme) if line.startswith("| recipe | builds on |"))
    rows = {}
    for i in range(start + 2, len(readme)):
        if not readme[i].startswith("|"):
            break
        cells = [c.strip() for c in readme[i].strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = (i, cells)
    return readme, start, rows


def test_readme_prints_each_copys_size_and_each_features_cost(sizes):
    """Issue 28.2: next to each recipe, its lean copy's lines (code lines), and the code lines each feature adds."""
    readme, start, rows = _readme_size_rows()
    header = [c.strip() for c in readme[start].strip().strip("|").split("|")]
    assert tuple(header[-2:]) == SIZE_COLUMNS
    if os.environ.get("TDR_SIZES") == "rewrite":
        for name, (i, cells) in rows.items():
            readme[i] = "| " + " | ".join([*cells[:-2], *size_cells(sizes[name])]) + " |"
        (REPO / "README.md").write_text("\n".join(readme) + "\n")
        rows = _readme_size_rows()[2]
    for name in READY:
        assert tuple(rows[name][1][-2:]) == size_cells(sizes[name]), (
            f"{name}: the README's copy sizes are not today's; if the change is meant: TDR_SIZES=rewrite pytest "
            f"tests/test_standalone.py -k readme"
        )


@pytest.mark.parametrize("name", recipe_params(NAMES))
def test_copy_size_is_held(project, sizes, name):
    """The lean copy `cp` writes is the size the README says (any dest), and --with all carries more."""
    lines, code = copy_size((project / "project" / f"{name}.py").read_text())
    assert (lines, code) == sizes[name][""], f"{name}: the copy at another path has another size"
    all_lines, all_code = copy_size((project / "project" / f"{name}_all.py").read_text())
    assert all_code >= code and (all_code > code) == bool(offered(name))


def test_ddp_copy_holds_no_run_object_no_threads_no_dtensor_no_source_inspection(project):
    """What ddp's copy leaves to the recipes that need it (issue 19): a class that owns the run, threads,
    DTensor, inspect.getsource."""
    text = (project / "project" / "ddp.py").read_text()
    tree = ast.parse(text)
    for word in ("threading", "DTensor", "torch.distributed.tensor", "getsource", "ThreadPool"):
        assert word not in text, word
    for node in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        methods = [m.name for m in node.body if isinstance(m, ast.FunctionDef)]
        assert len(methods) <= 6 and not node.name.endswith(("Run", "Runner", "Trainer")), (node.name, methods)
    step = text.index("\ndef step_plain(")
    assert 0 < step - text.index("\ndef train(") < 6000, "the step is a few screens below the loop, not 1,800 lines"


def test_lean_copies_leave_out_the_checkpoint_and_meter_code_of_their_features(project):
    """28.2: a lean copy runs its evaluation and checkpoints without the clock's pause (the `meter` feature), keeps a
    killed write's temporaries (their removal is the `lock` feature's), writes no trackers entry (`trackers`) and
    leaves the sharded load's model and NaN checks to `checks`; the --with all copies keep every one of them."""
    copy = {n: (project / "project" / f"{n}.py").read_text() for n in ("ddp", "ddp_all", "fsdp", "fsdp_all")}
    kept = ("def clock_paused(", "def remove_stale_temporaries(", "class InitFrom(")  # ddp: the plug-ins' files
    assert all(word in copy["ddp_all"] and word not in copy["ddp"] for word in kept)
    # fsdp: the trackers' sink, the NaN checks that `checks` runs on each shard file too, the clock's pause
    sharded = ('SEAMS["log_sinks"].append(', "def check_read(", "def clock_paused(")
    assert all(word in copy["fsdp_all"] and word not in copy["fsdp"] for word in sharded)
    # ddp takes no --log-to: no copy of it, --with all too, carries the trackers' code (a feature it does not have)
    assert "run.sinks" not in copy["ddp"] + copy["ddp_all"] and "--with trackers" not in copy["ddp"]


def test_copies_parse_the_same_options(project):
    """`--help` of every copy (one interpreter runs them all) lists the packaged recipe's options, less those of
    the features it left out: --with all lists them all."""
    script = (
        "import runpy, sys\n"
        "for path in sys.argv[1:]:\n"
        "    sys.argv = [path, '--help']\n"
        "    try:\n"
        "        runpy.run_path(path, run_name='__main__')\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    print('=====', flush=True)\n"
    )
    files = [str(project / "project" / f"{_stem(name, variant)}.py") for name, variant in VARIANTS]
    proc = run([sys.executable, "-c", script, *files], cwd=project / "project", env=_env(project))
    for (name, variant), copied in zip(VARIANTS, proc.stdout.split("=====\n")):
        packaged = CliRunner().invoke(cli, ["run", name, "--help"]).output
        have = offered(name)
        left_out = [f for f in have if variant != "all" and f != variant]
        gone = {"--" + o.replace("_", "-") for f in left_out for o in feature_options(name, f)}
        if RECIPES[name].plugins:  # a joined copy parses its Config's fields in their order; --dry-run is the CLI's
            gone.add("--dry-run")
            assert sorted(_options(copied)) == sorted(o for o in _options(packaged) if o not in gone), (name, variant)
            continue
        assert _options(copied) == [o for o in _options(packaged) if o not in gone], (name, variant)


def _options(help_text: str) -> list[str]:
    """The option names of a --help text (one per line at the first indent; wrapped help is indented more)."""
    return [m[1] for m in re.finditer(r"^  (?:-\w, )?(--[\w-]+)", help_text, re.M) if m[1] != "--help"]


def _options_of(name: str, variant: str) -> set[str]:
    """The options of recipe `name`'s copy `variant` ("" lean, "all", or one feature)."""
    fields = set(RECIPES[name].load().Config.__dataclass_fields__)
    left_out = [f for f in offered(name) if variant not in ("all", f)]
    return fields - {o for f in left_out for o in feature_options(name, f)}


def _args(name: str, variant: str, *extra: str) -> list[str]:
    """TRAIN_ARGS, the batch size and the options walk's (tests/test_options.py: every code path an option steers)
    that this variant takes: a checkpoint and a record at every step, trackers, the recipe's own. Not --tp or --pp 1:
    the copies run on the recipe's layout."""
    from test_options import WALK

    options = _options_of(name, variant)
    walk = {"ckpt_every": 1, "log_every": 1, "log_to": "tensorboard", **WALK.get(name, {})}
    walk = {k: v for k, v in walk.items() if k in options and k not in ("tp", "pp")}
    batch = ["--batch-size", USER_BATCH if "--data" in extra else BATCH]
    return [*TRAIN_ARGS, *batch, *[a for k, v in walk.items() for a in ("--" + k.replace("_", "-"), str(v))], *extra]


def _jobs(name: str, out: Path, copies: Path) -> tuple[list[dict], list[tuple[str, str]]]:
    """The runs of one launch (the copies, then the packaged recipe) and the pairs whose weights must be equal:
    each copy against the package run with the same options (the package takes them all)."""
    user = USER_ARGS.get(name, [])
    init = ["--init-from", str(out / "lean" / f"{name}-1" / "model.safetensors")]  # the lean run's weights
    variants = {"lean": ("", []), "all": ("all", user)}
    if name == "ddp":  # each feature alone: factories on the user's model, init_from from the lean run's weights
        extra = {"factories": user, "init_from": init}
        variants |= {f: (f, extra.get(f, [])) for f in offered(name)}
    jobs, pairs, packaged = [], [], {}
    for label, (variant, extra) in variants.items():
        args = _args(name, variant, *extra)
        jobs.append({"label": label, "copy": str(copies / f"{_stem(name, variant)}.py"), "args": args})
        package_args = _args(name, "all", *extra)
        pairs.append((label, packaged.setdefault(tuple(package_args), f"package_{len(packaged)}")))
    jobs += [{"label": label, "recipe": name, "args": list(args)} for args, label in packaged.items()]
    for job in jobs:
        job["args"] = [*job["args"], "--out", str(out / job["label"])]
    return jobs, pairs


@pytest.fixture(scope="module")
def trained(project, tmp_path_factory):
    """trained(name) -> (the launch's output, the recipe's jobs, its pairs, the process count, its runs' folder).
    The recipes on one process count share one launch (tests/copy_jobs.py): every copy of every one of them, then
    the packaged runs, so that no copy runs after the package was imported; the launch and its imports (seconds of
    CPU on each rank) are paid twice, not once per recipe. A launch starts when the first of its recipes asks."""
    copies = project / "project"
    nprocs = {n: min(_world_size((copies / f"{n}.py").read_text()), MAX_PROCS) for n in READY}
    done: dict[int, tuple] = {}

    def launch(nproc: int) -> str:
        out = tmp_path_factory.mktemp(f"trained{nproc}")
        jobs = []
        for name in (n for n in READY if nprocs[n] == nproc):
            for job in _jobs(name, out / name, copies)[0]:
                jobs.append({**job, "label": f"{name}/{job['label']}"})  # the runs' folders stay those of _jobs
        jobs.sort(key=lambda job: "copy" not in job)  # stable: every copy first, each recipe's in its order
        (out / "jobs.json").write_text(json.dumps(jobs))
        user_module = str(REPO / "tests")  # check_user: the user's own module; the copies import nothing of ours
        proc = run(
            [*torchrun(str(REPO / "tests" / "copy_jobs.py"), str(out / "jobs.json"), nproc=nproc)],
            cwd=out,
            env=user_env(PYTHONPATH=os.pathsep.join([user_module, str(REPO)]), TDR_PRECHECKED="1"),
            timeout=400,
            check=False,
        )
        return proc, len(jobs), out

    def trained_one(name: str) -> tuple[str, list[dict], list[tuple[str, str]], int, Path]:
        nproc = nprocs[name]
        if nproc not in done:
            done[nproc] = launch(nproc)
        proc, count, out = done[nproc]
        said = f"--stdout--\n{proc.stdout}\n--stderr--\n{proc.stderr[-5000:]}"
        assert proc.returncode == 0 and proc.stdout.count("summary ") == count, said  # every run its summary
        jobs, pairs = _jobs(name, out / name, copies)
        return said, jobs, pairs, nproc, out / name

    return trained_one


@pytest.mark.parametrize("name", recipe_params(NAMES))
def test_copies_train_exactly_like_the_recipe(trained, name):
    """Its lean copy, its --with all copy (and ddp's single-feature copies), then the packaged recipe, in one launch
    with the other recipes on its process count: each pair ends with the same weights bit for bit; every copy's
    run reads every option it takes (the walk rides on the run: tests/copy_jobs.py)."""
    stdout, jobs, pairs, nproc, runs = trained(name)
    for job in jobs:
        assert f"job {name}/{job['label']} exit 0 rank 0" in stdout, stdout
        if "copy" in job:  # the options walk on every copy variant: an option its run never reads is ignored
            assert f"unread {name}/{job['label']} []" in stdout, f"{name} {job['label']}: " + stdout
    # a copy records what it built: one without --model names no model (not the default the owner may have
    # replaced in its build lines), in the weights' header and in config.json (`records`: the lean copy writes none)
    lean = runs / "lean" / f"{name}-1"
    with safe_open(lean / "model.safetensors", "pt") as weights:
        assert "model" not in weights.metadata()
    assert not (lean / "config.json").exists() and not (lean / ".lock").exists()
    if name == "ddp":
        records = runs / "records" / f"{name}-1" / "config.json"
        assert not {"model", "data"} & set(json.loads(records.read_text()))
    printed = _progress(stdout.split("--stderr--")[0])  # the launch's jobs run one after another
    for copied, packaged in pairs:
        mine = load_file(runs / copied / f"{name}-1" / "model.safetensors")
        theirs = load_file(runs / packaged / f"{name}-1" / "model.safetensors")
        assert mine.keys() == theirs.keys()
        for key in theirs:
            assert torch.equal(mine[key], theirs[key]), f"{name} ({copied}) on {nproc} processes: {key} differs"
        # and the same numbers: evaluation too (a copy that lost its evaluation loop trains the same weights)
        said = [_summary(runs / run / f"{name}-1") for run in (copied, packaged)]
        assert {k: said[0].get(k) for k in NUMBERS} == {k: said[1].get(k) for k in NUMBERS}, (name, copied)
        # and the same progress lines (a copy without the clock prints no rates)
        mine, theirs = printed[f"{name}/{copied}"], printed[f"{name}/{packaged}"]
        assert mine == theirs and mine, (name, copied, mine)


NUMBERS = ("val_loss", "val_acc", "train_loss", "steps", "skipped_steps", "global_batch")


def _progress(stdout: str) -> dict[str, list[str]]:
    """Each job's progress lines (rank 0 prints them, then `job LABEL exit`), without the training clock's rates."""
    jobs, lines = {}, []
    for line in stdout.splitlines():
        if ended := re.match(r"job (\S+) exit \d+ rank 0", line):
            jobs[ended[1]], lines = lines, []
        elif re.match(r"step \d+/\d+ epoch", line):
            lines.append(re.sub(r" \d+ (samples|tokens)/s", "", line))
    return jobs


def _summary(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r["kind"] == "summary")


def test_cp_standalone_refuses_to_overwrite_and_names_the_launcher_line(tmp_path):
    dest = tmp_path / "train.py"
    assert CliRunner().invoke(cli, ["cp", "dp", str(dest), "--standalone"]).exit_code == 0
    assert f"torchrun --standalone --nproc-per-node 1 {dest}" in dest.read_text()  # dp: one process
    again = CliRunner().invoke(cli, ["cp", "dp", str(dest), "--standalone"])
    assert again.exit_code != 0 and "exists" in again.output
    nowhere = CliRunner().invoke(cli, ["cp", "dp", str(tmp_path / "missing" / "train.py"), "--standalone"])
    assert nowhere.exit_code != 0 and f"the folder {tmp_path / 'missing'} does not exist" in nowhere.output


def _misindented(tree: ast.AST) -> list[int]:
    """Lines of statements not indented 4 spaces more than the statement whose body they are in."""
    wrong = []
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(node, (ast.stmt, ast.ExceptHandler)) and isinstance(block, list) and block:
                first = block[0]
                if isinstance(first, (ast.stmt, ast.ExceptHandler)) and first.lineno != node.lineno:
                    expected = node.col_offset + (0 if field == "handlers" or _is_elif(node, field) else 4)
                    wrong += [first.lineno] if first.col_offset != expected else []
    return wrong


def _is_elif(node: ast.AST, field: str) -> bool:
    """An `elif` is an If in its parent's orelse, at the parent's column (the `else:` case is indented)."""
    return (
        field == "orelse"
        and isinstance(node, ast.If)
        and isinstance(node.orelse[0], ast.If)
        and (node.orelse[0].col_offset == node.col_offset)
    )


# --- diff A B: one feature at a time ----------------------------------------------------------------


@pytest.mark.parametrize("name", recipe_params([n for n in NAMES if RECIPES[n].builds_on]))
def test_diff_against_what_a_recipe_builds_on(name):
    base = RECIPES[name].builds_on  # the registry says what a recipe builds on; its docstring says what it does
    result = CliRunner().invoke(cli, ["diff", base, name])  # not a terminal: no colour codes
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"# {name} builds on {base}: the lines below are what it adds"
    assert lines[1].startswith(f"--- {base}: ") and lines[2].startswith(f"+++ {name}: ")
    assert any(line.startswith("+") for line in lines[3:]) and "\x1b[" not in result.output


def test_diff_says_when_b_does_not_build_on_a():
    result = CliRunner().invoke(cli, ["diff", "ddp", "fsdp_tp"])
    assert result.output.splitlines()[0] == (
        f"# fsdp_tp does not build on ddp (it builds on "
        f"{RECIPES['fsdp_tp'].builds_on}; try: python -m recipes diff "
        f"{RECIPES['fsdp_tp'].builds_on} fsdp_tp)"
    )
    backwards = (
        CliRunner().invoke(cli, ["diff", "fsdp", "ddp"]).output.splitlines()[0]
    )  # a review find: it advised itself
    assert backwards == "# ddp does not build on fsdp (it builds on no other recipe)"
    assert (
        CliRunner()
        .invoke(cli, ["diff", "ddp_amp", "ddp"])
        .output.splitlines()[0]
        .endswith("; try: python -m recipes diff ddp ddp_amp)")
    )
    assert CliRunner().invoke(cli, ["diff", "ddp", "nope"]).exit_code != 0


def test_diff_is_coloured_on_a_terminal():
    result = CliRunner().invoke(cli, ["diff", "ddp", "ddp_amp"], color=True)
    assert "\x1b[32m+" in result.output and "\x1b[31m-" in result.output


@pytest.mark.fast
def test_with_names_the_valid_features_in_one_line(tmp_path):
    bad = CliRunner().invoke(cli, ["cp", "ddp", str(tmp_path / "a.py"), "--standalone", "--with", "hf,wandb,clock"])
    assert bad.exit_code == 2 and not (tmp_path / "a.py").exists()
    valid = ", ".join(["all", *offered("ddp")])
    assert f"--with clock,wandb: choose from {valid}" in bad.output
    alone = CliRunner().invoke(cli, ["cp", "ddp", str(tmp_path / "b.py"), "--with", "hf"])
    assert alone.exit_code == 2 and "--with: only a --standalone copy leaves features out" in alone.output


@pytest.mark.fast
def test_the_copys_writer_writes_what_the_package_reads_and_refuses_a_flipped_bit(tmp_path, monkeypatch):
    """A lean copy writes with safetensors' own writer (the kernel's write_tensors, no writers seam), the package
    with its own (the fast_writer plug-in): the same checksums, verified by the same reader; one flipped bit is
    refused naming the tensor."""
    from core.kernel import store as ckpt
    from core.kernel.job import RecipeError
    from core.kernel.seams import SEAMS
    from core.plugins.fast_writer import write_fast

    tensors = {
        "model/w": torch.randn(3, 5),
        "optim/0/exp_avg_sq": torch.rand(4, dtype=torch.float64),
        "rng": torch.arange(7, dtype=torch.uint8),
        "empty": torch.zeros(0),
    }
    for writers in ([write_fast], []):
        path = tmp_path / f"{'fast' if writers else 'plain'}.safetensors"
        monkeypatch.setitem(SEAMS, "writers", writers)
        ckpt.write_tensors(path, tensors, {"format": ckpt.FORMAT, "step": "3"})
        loaded, meta = ckpt.read_checkpoint(path)
        assert meta["step"] == "3" and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    data[8 + size + json.loads(data[8 : 8 + size])["model/w"]["data_offsets"][0] + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(RecipeError, match="tensor model/w does not match its checksum"):
        ckpt.read_checkpoint(path)


def test_a_lean_copy_refuses_another_global_batch_and_other_options_and_only_checks_takes_the_rest(project):
    """Every copy refuses another global batch and another option that shapes training (--lr, --seed, --epochs:
    resumed, they would be silently ignored or train another run); a checkpoint of a sharded recipe is refused by the
    copy with `checks` and the package, not by the lean copy, whose header says so."""
    import runpy

    import core.attach  # noqa: F401 - the package's plug-ins: the checks one among them
    from core.kernel.store import check_continues

    lean = runpy.run_path(str(project / "project" / "ddp.py"), run_name="lean_copy")
    checked = runpy.run_path(str(project / "project" / "ddp_with_checks.py"), run_name="checks_copy")
    config = {"recipe": "ddp", "world_size": 2, "global_batch": 64, "batch_size": 32, "lr": 0.001, "seed": 0}
    meta = {"recipe": "ddp", "global_batch": "64", "world_size": "2", "config": json.dumps(config)}
    for check in (lean["check_continues"], checked["check_continues"], check_continues):
        with pytest.raises(Exception, match="saved with global batch 32.* use --batch-size 16"):
            _on_2_ranks(check, Path("c"), {**meta, "global_batch": "32"}, config)
        for option, value in (("lr", 0.002), ("seed", 7), ("epochs", 9)):
            changed = {**meta, "config": json.dumps({**config, option: value})}
            with pytest.raises(Exception, match=f"--{option} {value} -> .*would train another run"):
                _on_2_ranks(check, Path("c"), changed, {**config, "epochs": config.get("epochs", 5)})
    sharded = {**meta, "recipe": "fsdp", "config": json.dumps({**config, "recipe": "fsdp"})}
    _on_2_ranks(lean["check_continues"], Path("c"), sharded, config)  # another recipe's layout: the lean copy takes it
    for check in (checked["check_continues"], check_continues):
        with pytest.raises(Exception, match="a checkpoint of recipe fsdp"):
            _on_2_ranks(check, Path("c"), sharded, config)
    header = (project / "project" / "ddp.py").read_text().replace("\n# ", " ")  # it names checks as left out,
    assert re.search(r"each added by `--with NAME` .*: .*\bchecks\b", header)  # and the docs' table says what that is
    row = next(line for line in (REPO / "docs" / "copying-and-checking.md").open() if line.startswith("| `checks` |"))
    assert "a checkpoint of another layout (a sharded recipe's)" in row


def _on_2_ranks(check, path: Path, meta: dict, config: dict) -> None:
    """check_continues on 2 data-parallel ranks: the kernel's reads them from the config (global batch, batch size)."""
    check(path, meta, config)


def test_a_tensor_parallel_copy_without_model_plans_splits_the_gpt_and_refuses_a_llama_in_one_line(project):
    """Without `model_plans` the copies split the built-in GPT's layout by core.tp_plan's plan; a transformers
    Llama, which the package splits by its own plan, is refused by the copy's check in one line naming fsdp."""
    import runpy

    from core import tp_plan
    from mp_reference import tiny_llama

    for name in ("tensor_parallel", "fsdp_tp"):
        lean = runpy.run_path(str(project / "project" / f"{name}.py"), run_name="lean_copy")
        assert "model_tp_plan" not in lean and "TiesAndHeadsKept" not in lean
        gpt = lean["gpt"]()
        assert set(lean["gpt_tp_plan"](gpt)) == set(tp_plan.plan_of(gpt, tp=2))  # the package's plan for the GPT
        lean["plan_of"](gpt, tp=2)
        with torch.device("meta"):
            llama = tiny_llama()
        tp_plan.plan_of(llama, tp=2)  # the package splits it by its own plan
        with pytest.raises(lean["RecipeError"], match="tensor parallelism needs .*use fsdp"):
            lean["plan_of"](llama, tp=2)


def test_a_copy_without_stream_takes_map_style_data_and_refuses_a_stream_in_one_line(project):
    """The `stream` feature left out, a copy keeps the map-style branch of `if stream.is_stream(...)` alone, and
    its make_loaders refuses an IterableDataset in one line naming `--with stream` (the package's refusal, before
    launch: test_factories' stream test)."""
    import runpy
    from types import SimpleNamespace

    class Numbers(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    topo = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)
    for name in ("ddp_amp", "fsdp", "tensor_parallel", "fsdp_tp"):
        text = (project / "project" / f"{name}.py").read_text()
        assert "is_stream" not in text and "StreamLoader" not in text, name
        assert "is_stream(" in (project / "project" / f"{name}_all.py").read_text()
    lean = runpy.run_path(str(project / "project" / "ddp_amp.py"), run_name="lean_copy")
    cfg = SimpleNamespace(batch_size=2, seed=0, epochs=1, max_steps=0, accum=1)
    with pytest.raises(lean["RecipeError"], match=r"a stream \(Numbers, an IterableDataset\).*--with stream"):
        lean["make_loaders"](cfg, topo, Numbers(), None, None)  # ddp_amp's copy, on the kernel


def test_a_ddp_amp_copy_without_loss_counts_takes_the_models_own_loss_as_a_mean_per_micro_batch(project):
    """`loss_counts` left out, the copy's make_exact_loss reads no traits of the model's own loss; the package and
    the `--with all` copy hand a forward that names num_items_in_batch the global batch's count."""
    import runpy
    from types import SimpleNamespace

    import core.plugins.loss_counts  # noqa: F401 - as the package runs ddp_amp
    from core.exact_loss import make_exact_loss
    from core.kernel.loss import make_loss

    class Counts(torch.nn.Module):  # a user model that divides its own summed loss by num_items_in_batch
        def forward(self, x, targets=None, num_items_in_batch=None):
            return x

    lean_text = (project / "project" / "ddp_amp.py").read_text()
    left_out = lean_text.replace("\n# ", " ").split("each added by `--with NAME`", 1)[1].split(".")[0]
    assert "def forward_counted(" not in lean_text and "loss_counts" in left_out
    lean = runpy.run_path(str(project / "project" / "ddp_amp.py"), run_name="lean_copy")
    full = runpy.run_path(str(project / "project" / "ddp_amp_all.py"), run_name="lean_copy")
    cfg = SimpleNamespace(loss="auto")
    for (exact, loss), takes in (
        ((make_exact_loss, make_loss), True),
        ((full["make_exact_loss"], full["make_loss"]), True),
        ((lean["make_exact_loss"], lean["make_loss"]), False),
    ):
        assert (exact(loss(cfg, Counts()), model=Counts()).counted is not None) is takes


@pytest.mark.fast
def test_the_docs_table_names_every_feature_and_the_recipes_that_have_it():
    """docs/copying-and-checking.md's feature table: one row per plug-in of the registry, its recipes right."""
    text = (REPO / "docs" / "copying-and-checking.md").read_text()
    rows = {}
    for line in text[text.index("| feature | without it, a lean copy | recipes |") :].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[-1]
    assert list(rows) == list(PLUGINS)
    for name in rows:
        have = [r for r in RECIPES if name in offered(r)]
        assert rows[name] == ("all" if len(have) == len(RECIPES) else ", ".join(have)), name


def test_cp_says_the_copys_size_and_tools_copies_says_where_its_code_lines_come_from(project, sizes, tmp_path, capsys):
    from tools.copies import main

    text = (project / "project" / "ddp.py").read_text()
    parts = breakdown(text)
    assert sum(parts.values()) == copy_size(text)[1]
    assert {"header and imports", "the recipe", "core/kernel/store.py", "core/kernel/train.py"} <= set(parts)
    out = CliRunner().invoke(cli, ["cp", "ddp", str(tmp_path / "t.py"), "--standalone"]).output
    lines, code = copy_size((tmp_path / "t.py").read_text())
    assert f"({lines:,} lines, {code:,} of code; `python -m tools.copies ddp` says where they come from)" in out
    assert (lines, code) == sizes["ddp"][""]  # the size the README says, at another path
    capsys.readouterr()
    main(["ddp"])  # the same parts, largest first
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"ddp's copy: {lines:,} lines, {code:,} code"
    assert printed[1].split() == [f"{max(parts.values()):,}", max(parts, key=parts.get)]


def test_the_docs_show_the_lean_ddp_copys_header_as_it_is(project):
    """docs/copying-and-checking.md quotes the header of `cp ddp FILE --standalone`: its `# Left out:` lines, as a
    copy made today has them (`TDR_SIZES=rewrite` rewrites the quote with the README's sizes)."""
    text = (project / "project" / "ddp.py").read_text()
    header = text[text.index("# Left out:") : text.index("\nfrom __future__")].strip("\n")
    docs = REPO / "docs" / "copying-and-checking.md"
    page = docs.read_text()
    start = page.index("```\n", page.index("Its header says what it left out")) + 4
    end = page.index("```", start)
    if os.environ.get("TDR_SIZES") == "rewrite":
        docs.write_text(page[:start] + header + "\n" + page[end:])
    assert page[start:end].strip("\n") == header or os.environ.get("TDR_SIZES") == "rewrite"


def test_the_docs_say_where_the_lean_ddp_copys_code_lines_are(project):
    """docs/copying-and-checking.md's table of the lean ddp copy's parts: each row's code lines are what
    `python -m tools.copies ddp` counts for its modules, and every part is in a row (`TDR_SIZES=rewrite` rewrites)."""
    parts = breakdown((project / "project" / "ddp.py").read_text())
    docs = REPO / "docs" / "copying-and-checking.md"
    lines = docs.read_text().splitlines()
    start = lines.index("| part (`core/` modules) | code lines | what it keeps right |") + 2
    seen = []
    for i in range(start, len(lines)):
        if not lines[i].startswith("|"):
            break
        cells = lines[i].split(" | ")
        names = [n.strip("| ") for n in re.split(r"[,;]", cells[0])]
        keys = [n if n in ("the recipe", "header and imports") else f"core/{n}.py" for n in names]
        seen += keys
        counted = f"{sum(parts.get(k, 0) for k in keys):,}"
        if os.environ.get("TDR_SIZES") == "rewrite":
            lines[i] = " | ".join([cells[0], counted, *cells[2:]])
        assert cells[1] == counted or os.environ.get("TDR_SIZES") == "rewrite", (cells[0], cells[1], counted)
    if os.environ.get("TDR_SIZES") == "rewrite":
        docs.write_text("\n".join(lines) + "\n")
    assert sorted(seen) == sorted(parts), "a part of the copy is in no row, or a row names no part"

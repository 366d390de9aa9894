"""Options are honest: each recipe takes exactly the options it implements, and uses every one.

Layer 1: the Config of every recipe, its --help, and the values refused when it is built.
The walk: every recipe runs a few steps in this process (a world of one) with a Config that
records which of its fields the run reads; an option no code path reads would be a silently
ignored one, and fails the test.
"""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from copy_jobs import recording

from core.kernel.job import RecipeError
from core.kernel.train import cleanup_pg
from helpers import in_one_interpreter, recipe_params, waiting
from tools.options import UsageError, parse_args
from tools.registry import RECIPES, takers

NAMES = sorted(RECIPES)


def _config(name):
    return RECIPES[name].load().Config


def _fields(name) -> set[str]:
    return {f.name for f in dataclasses.fields(_config(name))}


@pytest.mark.fast
@pytest.mark.parametrize("name", recipe_params(NAMES))
def test_help_lists_exactly_the_config(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(_config(name), ["--help"], prog=name)
    assert exit_.value.code == 0
    words = re.findall(r"(?<![\w'])--([a-z][\w-]*)\b(?!')", capsys.readouterr().out)
    listed = {w.replace("-", "_") for w in words if not w.startswith("no-")} - {"help", "dry_run"}
    assert listed == _fields(name)


@pytest.mark.fast
def test_an_option_a_recipe_does_not_take_names_the_ones_that_do():
    with pytest.raises(UsageError) as refused:
        parse_args(_config("ddp"), ["--accum", "4"])
    assert str(refused.value) == "unrecognized arguments: --accum 4"
    expected = {"ddp_amp"} | ({"fsdp"} if not waiting("fsdp") else set())
    assert expected <= set(takers("--accum")) and "ddp" not in takers("--accum")


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """`python -m recipes run ddp ...` of this module's two refusals, each in a folder of its own, one after the other
    in one interpreter (tests/cli_cases.py): {case: (what it returned, its folder)}."""
    folders = {key: tmp_path_factory.mktemp(key) for key in ("unknown", "escape")}
    cases = [
        {
            "args": ["run", "ddp", "--precision", "bf16", "--out", str(folders["unknown"])],
            "cwd": str(folders["unknown"]),
        },
        {
            "args": ["run", "ddp", "--name", "../escape", "--out", str(folders["escape"] / "runs")],
            "cwd": str(folders["escape"]),
        },
    ]
    return {key: (proc, folders[key]) for key, proc in zip(folders, in_one_interpreter(cases), strict=True)}


@pytest.mark.e2e
def test_unknown_option_is_a_usage_error_naming_the_takers(refused):
    proc, tmp_path = refused["unknown"]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --precision: ddp does not take it; ") and "ddp_amp" in line
    assert not list(tmp_path.iterdir()), "a refused run creates nothing"


BAD = [  # (option, value, words in the one line): the option, the value, the fix
    ("--timeout-s", "inf", "--timeout-s inf: use 1 to 604800"),
    ("--timeout-s", "1e20", "--timeout-s 1e+20: use 1 to 604800"),
    ("--timeout-s", "0", "--timeout-s 0.0: use 1 to 604800"),
    ("--seed", "100000000000000000000", "--seed 100000000000000000000: use 0 to 2147483648"),
    ("--seed", "1e20", "argument --seed: invalid int value: '1e20'"),
    ("--batch-size", "100000000000000000000000", "use 1 to 2147483648"),
    ("--batch-size", "0", "--batch-size 0: use 1 to 2147483648"),
    ("--lr", "inf", "--lr inf: use 1e-09 to 10"),
    ("--lr", "nan", "--lr nan: use 1e-09 to 10"),
    ("--lr", "1e6", "--lr 1000000.0: use 1e-09 to 10"),
    ("--out", "", "--out '': name a folder, e.g. runs"),
    ("--name", "a/b", "--name 'a/b': use a plain name"),
    ("--name", "../x", "--name '../x': use a plain name"),
    ("--epochs", "-1", "--epochs -1: use 0 to 2147483648"),
]


@pytest.mark.fast
@pytest.mark.parametrize("option,value,words", BAD)
def test_bad_values_fail_when_the_config_is_built(option, value, words):
    with pytest.raises(RecipeError, match=None) as refused:
        parse_args(_config("ddp"), [option, value])
    assert words in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.fast
@pytest.mark.skipif(waiting("ddp_monitored"), reason="ddp_monitored waits for its move to the new core (issue 19)")
@pytest.mark.parametrize("value", ["inf", "0", "1e6"])
def test_bucket_size_is_checked_where_it_exists(value):
    with pytest.raises(RecipeError, match="--bucket-mb"):
        parse_args(_config("ddp_monitored"), ["--bucket-mb", value])


@pytest.mark.e2e
def test_a_bad_value_under_the_launcher_leaves_no_folder(refused):
    proc, tmp_path = refused["escape"]
    assert proc.returncode == 1 and proc.stderr.count("error: ") == 1
    assert not (tmp_path / "runs").exists() and not (tmp_path / "escape-1").exists()


# --- the walk: every option of every recipe is read by its run ----------------------------------------------


WALK = {  # small runs that take every code path an option steers: checkpoints, evaluation, the logs
    "ddp": {},
    "ddp_amp": {"accum": 2, "clip": 1.0},
    "ddp_monitored": {},
    "dp": {},
    "pipeline_naive": {},
    "fsdp": {"accum": 2, "clip": 1.0},
    "tensor_parallel": {"tp": 1},
    "fsdp_tp": {"tp": 1},
    "pipeline": {"pp": 1, "microbatches": 2},
}
NEVER_READ_IN_ONE_PROCESS = {"debug"}


def walk_values(name: str, fields: set[str], out) -> dict:
    """The walk's options for recipe `name` (or a copy of it) whose Config has `fields`."""
    return {
        "max_steps": 2,
        "epochs": 1,
        "batch_size": 8,
        "ckpt_every": 1,
        "log_every": 1,
        "out": str(out),
        **({"log_to": "tensorboard"} if "log_to" in fields else {}),  # --wandb-project is read where a tracker is
        **{k: v for k, v in WALK.get(name, {}).items() if k in fields},
    }  # read before the process group exists, by main(): checked below


@pytest.mark.world
@pytest.mark.parametrize("name", recipe_params(NAMES))
def test_every_option_is_read_by_the_run(name, tmp_path, monkeypatch):
    monkeypatch.setenv("TDR_DEVICE", "cpu")
    module = RECIPES[name].load()
    fields = _fields(name)
    cfg = recording(module.Config)(**walk_values(name, fields, tmp_path))
    try:
        module.main(cfg)
    finally:
        cleanup_pg()
    unread = fields - cfg._read - NEVER_READ_IN_ONE_PROCESS
    assert not unread, f"{name} takes options its run never reads: {sorted(unread)}"


@pytest.mark.fast
def test_recipes_import_nothing_heavy_until_run():
    code = (
        "import sys, tools.cli, tools.registry, recipes; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert not [m for m in sys.modules if m.startswith('recipes.')], 'a recipe imported'"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.fast
@pytest.mark.parametrize("name", recipe_params(sorted(RECIPES)))
def test_help_puts_each_option_in_its_groups_section_even_with_the_recipes_own_default(name, capsys):
    """A recipe that gives --epochs its own default (ddp_amp's 10) still lists it under `training`, and no section
    is a leftover `Config options` holding one such option."""
    config = RECIPES[name].load().Config
    with pytest.raises(SystemExit):
        parse_args(config, ["--help"], prog=name)
    text = capsys.readouterr().out
    sections = re.split(r"\n(?=\S[^\n]*:\n)", text)
    training = next(s for s in sections if s.startswith("training:"))
    assert "--epochs" in training and "--lr" in training and "Config options" not in text

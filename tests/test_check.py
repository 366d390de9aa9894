"""`python -m recipes check NAME`: is a model safe to train distributed?

Fast: the probes, in this process, on the built-in models and on a user's own as they really come (a
transformers causal LM and classifier from tiny configs, a nanoGPT-style model, dict batches, streams with and
without a length), with the loss the recipe takes; each cause found and named with a fix in options that exist;
the weight comparison; the verdict on a crashed run; every problem before a launch one RecipeError line.
End to end: the command itself, which runs the recipe under torchrun and as one process: it agrees on a user's own
model and stream from the working folder, compares dropout's runs with the masks off, fails naming the cause on an
unused parameter, and says "the run crashed" with the run's error line when a run crashes. Then the same check
(prepared, run and judged as the command does) on a built-in model and on the models people really have under the
recipes that take them, on BatchNorm and on the advised option, its runs shared by two launches.
tests/check_user.py is the user's module."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import check_user
from core.kernel.job import RecipeError
from helpers import REPO, build_data, build_model, in_one_interpreter, run, torchrun, user_env
from tools import probes
from tools.check import (
    REL_TOL,
    Comparison,
    Crash,
    Report,
    _error_line,
    _verdict,
    check_recipe,
    compare_weights,
    conclude,
    distributed_args,
    judge,
    one_process_args,
    prepare,
    run_summary,
)
from tools.probes import RANDOMNESS, Finding, probe
from tools.registry import RECIPES

DDP = frozenset({"find_unused_parameters", "static_graph", "sync_batchnorm"})  # the ddp recipes' DDPOptions


def sample_batches(spec: str, *, size: int, count: int = 1) -> list:
    train, _, collate = build_data(spec)
    return probes.sample_batches(train, collate, spec=spec, size=size, count=count)


def sample_batch(spec: str, *, size: int):
    return sample_batches(spec, size=size)[0]


class Drifting(nn.Module):
    """Gives another answer every call with the same seed: state that changes outside the RNG."""

    calls = 0  # on the class: a copy of the model shares it

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x):
        type(self).calls += 1
        return self.linear(x) * (1 + 1e-3 * self.calls)


@pytest.fixture(scope="module")
def digits_batch():
    return sample_batch("digits", size=8)


@pytest.mark.fast
@pytest.mark.parametrize(
    "model,data",
    [
        ("mlp", "digits"),
        ("cnn", "digits"),
        ("gpt", "text"),
        ("check_user:gpt2", "check_user:lm_stream"),  # ModelOutput with its own loss; dicts; a stream with __len__
        ("check_user:bert", "check_user:classify"),  # a classifier; map-style dicts padded by the factory's collate
        ("check_user:nano", "check_user:pair_stream"),  # (logits, loss); pairs; a stream without __len__
    ],
)
def test_probes_find_nothing_in_models_that_train_alike(model, data):
    torch.manual_seed(0)
    first, other = sample_batches(data, size=4, count=2)
    assert probe(build_model(model), first, other=other, takes=DDP) == []


@pytest.mark.fast
@pytest.mark.parametrize(
    "factory,cause,names",
    [
        ("unused", "unused parameters", "spare.weight, spare.bias"),
        ("batchnorm", "BatchNorm without SyncBatchNorm", "1 (BatchNorm1d)"),
        ("dropout", RANDOMNESS, "dropout (2)"),
    ],
)
def test_probes_name_the_cause_and_the_layer(digits_batch, factory, cause, names):
    findings = probe(getattr(check_user, factory)(), digits_batch)
    assert [f.cause for f in findings] == [cause]
    assert names in findings[0].detail


@pytest.mark.fast
def test_probes_see_a_layer_that_is_not_deterministic(digits_batch):
    assert [f.cause for f in probe(Drifting(), digits_batch)] == ["non-deterministic layers"]


@pytest.mark.fast
def test_unused_parameters_get_the_option_that_fixes_them(digits_batch):
    """Unused in every step: --static-graph (or --find-unused-parameters); a set that varies: only the latter.
    Never a DDP(...) keyword no option sets; a recipe without DDP's options gets neither."""
    (always,) = probe(check_user.unused(), digits_batch, takes=DDP)
    assert "--static-graph" in always.detail and "--find-unused-parameters" in always.detail and always.crashes
    x, y = digits_batch
    (varies,) = probe(check_user.Switch(), (x + 1, y), other=(x - 1, y), takes=DDP)
    assert "up.weight" in varies.detail and "down.weight" in varies.detail
    assert "pass --find-unused-parameters (--static-graph needs the same set every step)" in varies.detail
    (other_recipe,) = probe(check_user.unused(), digits_batch, takes=())
    assert "--" not in other_recipe.detail and not other_recipe.crashes
    assert all("find_unused_parameters=" not in f.detail for f in (always, varies, other_recipe))


@pytest.mark.fast
def test_batchnorm_advice_fits_the_machine_and_the_recipe(digits_batch):
    def advice(**kwargs):
        return probe(check_user.batchnorm(), digits_batch, **kwargs)[0].detail

    assert "pass --sync-batchnorm" in advice(takes=DDP, cuda=True)
    on_cpu = advice(takes=DDP, cuda=False)
    assert "needs CUDA" in on_cpu and "LayerNorm/GroupNorm" in on_cpu and "pass --sync-batchnorm" not in on_cpu
    assert "--sync-batchnorm" not in advice(takes=(), cuda=True)


@pytest.mark.fast
def test_weights_are_compared_against_how_far_training_moved_them(tmp_path):
    gen = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(1000, generator=gen), "b": torch.zeros(10)}
    single = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in start.items()}
    noisy = {"w": single["w"].clone(), "b": single["b"] + torch.tensor([1e-5] + [0.0] * 9)}  # one element off
    broken = {k: v + 3e-4 * torch.randn(v.shape, generator=gen) for k, v in single.items()}  # every element off
    paths = {}
    for name, tensors in (("start", start), ("single", single), ("noisy", noisy), ("broken", broken)):
        paths[name] = tmp_path / f"{name}.safetensors"
        save_file(tensors, paths[name])
    noise = compare_weights(paths["noisy"], paths["single"], paths["start"])
    assert noise.where == "b" and noise.max_diff == pytest.approx(1e-5, rel=1e-2) and noise.relative < REL_TOL
    assert compare_weights(paths["broken"], paths["single"], paths["start"]).relative > 10 * REL_TOL
    assert compare_weights(paths["single"], paths["single"], paths["start"]).relative == 0.0


@pytest.mark.fast
def test_a_model_that_is_not_finite_is_named_so_not_non_deterministic(digits_batch):
    """Review find: nan != nan made two equal probe steps look non-deterministic."""
    (found,) = probe(check_user.nan_weights(), digits_batch)
    assert found.cause == "not finite" and found.crashes
    assert "the weights 0.weight hold nan or inf" in found.detail


@pytest.mark.fast
def test_a_training_loss_that_is_not_finite_is_a_verdict_not_a_type_error():
    """Review find: a summary's train_loss null (nan) made `check` die on None - None."""
    run = {"train_loss": 2.0, "global_batch": 8}
    report = judge(
        Report(["check"]), run | {"train_loss": None}, run, Comparison(0.0, "", 0.0), half=False, distribution=False
    )
    assert not report.equivalent and "the distributed run's training loss is not a number (nan or inf, or no " in (
        report.reason
    )
    assert judge(Report(["check"]), run, run, Comparison(0.0, "", 0.0), half=False, distribution=False).equivalent


@pytest.mark.fast
def test_an_interrupted_check_ends_the_run_it_waits_for(tmp_path):
    """A review find: Ctrl-C or SIGTERM to `check` left its torchrun running alone."""
    import signal
    import subprocess

    from tools.check import _finish

    def interrupt(*_):
        raise KeyboardInterrupt

    run = subprocess.Popen(["sleep", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    before = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)  # the interrupt comes while check waits for its run
    try:
        with pytest.raises(KeyboardInterrupt):
            _finish(run, out=str(tmp_path), timeout_s=30)
    finally:
        signal.signal(signal.SIGALRM, before)
    assert run.poll() == -signal.SIGTERM  # ended, not left behind


@pytest.mark.fast
def test_a_sigterm_is_one_line_and_only_a_training_run_speaks_of_checkpoints(monkeypatch, capsys):
    """A review find: SIGTERM to `check` said "checkpoints already written are kept: --resume auto ..."."""
    import signal

    from tools import cli

    def stopped(**_):
        raise cli.Stopped(15)

    monkeypatch.setattr(cli.cli, "main", stopped)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}  # run_cli sets its own
    try:
        assert cli.run_cli(["check", "ddp"]) == 143 and capsys.readouterr().err == "error: stopped by SIGTERM\n"
        assert cli.run_cli(["run", "ddp", "--dry-run"]) == 143
        assert capsys.readouterr().err == "error: stopped by SIGTERM\n"  # the launcher's pre-check: no run yet
        assert cli.run_cli(["run", "ddp"]) == 143
        assert capsys.readouterr().err.startswith("error: stopped by SIGTERM; checkpoints already written are kept")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.mark.fast
def test_a_crashed_run_is_reported_as_a_crash_with_its_error_line():
    crash = Crash("the run on 2 processes", "crashed", "error: --data x: boom", "torchrun ... -m recipes run ddp")
    alone = _verdict(Report(["check"]), crash=crash).text
    assert "the run crashed: error: --data x: boom" in alone and "none of the usual" not in alone
    assert "rerun it alone to see the whole error: torchrun" in alone
    unused = Finding("unused parameters", "spare.weight get no gradient", crashes=True)
    norm = Finding("BatchNorm without SyncBatchNorm", "0 (BatchNorm1d)")
    report = _verdict(Report(["check"], [unused, norm]), crash=crash)
    assert "likely cause: unused parameters" in report.text and "warning: BatchNorm" in report.text
    assert report.reason == "the run on 2 processes crashed: error: --data x: boom" and not report.equivalent


@pytest.mark.fast
def test_the_error_line_is_the_runs_own_one_sentence():
    ddp = "[rank1]: RuntimeError: Expected to have finished reduction in the prior iteration. " + "More. " * 60
    stderr = f"W1203 some warning\nTraceback (most recent call last):\n  File x\n{ddp}\n[rank0]: OtherError: later"
    line = _error_line(stderr)  # whole sentences, up to 240 characters
    assert line.startswith("RuntimeError: Expected to have finished reduction in the prior iteration. More.")
    assert line.endswith("More.") and len(line) <= 240
    assert _error_line("noise\nerror: --model m: the factory raised X\nValueError: y") == (
        "error: --model m: the factory raised X"
    )
    ours = "error: --model m: " + "a long line of our own " * 20 + "ends here"
    assert _error_line(f"[rank1]: {ours}") == ours  # one line already: never cut
    words = "ValueError: " + "word " * 80
    assert _error_line(words).endswith("word ...") and len(_error_line(words)) <= 244  # between words


@pytest.mark.fast
@pytest.mark.parametrize(
    "model,data,message",
    [
        ("mlp", "text", r"--model mlp --data text: one training step fails \(RuntimeError"),
        ("check_user:raising", "digits", r"one training step fails \(RuntimeError: unflatten"),
        ("mlp", "check_user:broken_data", r"--data check_user:broken_data: the factory raised FileNotFoundError"),
        ("mlp", "check_user:failing_stream", r"reading the training set raised ConnectionError: stream closed"),
        ("check_user:bert", "digits", r"--model check_user:bert --data digits: one training step fails"),
    ],
)
def test_what_fails_before_any_launch_is_one_line(model, data, message):
    with pytest.raises(RecipeError, match=message) as raised:
        check_recipe(RECIPES["ddp_amp" if "stream" in data else "ddp"], model=model, data=data)
    assert "\n" not in str(raised.value)


# --- the command, end to end: each case one `check`, two launches ----------------------------------------


CHECKS = {  # the commands of the tests below: `python -m recipes check ARGS`
    "user model and stream": ["ddp_amp", "--model", "usermodels:nano", "--data", "usermodels:pair_stream"],
    "dropout": ["ddp", "--model", "usermodels:dropout"],
    "unused": ["ddp", "--model", "usermodels:unused_dropout"],
    "crashing": ["ddp", "--model", "usermodels:crashing"],
    "failing stream": ["ddp_amp", "--data", "usermodels:failing_stream"],
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict:
    """CHECKS, each `python -m recipes check ...` from a folder holding the user's own module, as a user runs it: one
    after another in one interpreter (tests/cli_cases.py; each check's own runs are processes of their own, as
    always), which pays its imports once: {case: what it returned}."""
    folder = tmp_path_factory.mktemp("user")
    shutil.copy(Path(check_user.__file__), folder / "usermodels.py")
    env = user_env(PYTHONPATH=os.pathsep.join([str(folder), str(REPO)]))  # this checkout, not an installed one
    said = in_one_interpreter([{"args": ["check", *a], "cwd": str(folder)} for a in CHECKS.values()], env=env,
                              timeout=420 * len(CHECKS))  # fmt: skip
    return dict(zip(CHECKS, said, strict=True))


def _agrees(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equivalent: yes" in proc.stdout and "Traceback" not in proc.stderr
    assert "largest parameter difference" in proc.stdout and "training loss difference" in proc.stdout


@pytest.mark.e2e
def test_check_agrees_on_a_users_model_and_stream(checked):
    _agrees(checked["user model and stream"])


@pytest.mark.e2e
def test_check_reports_dropout_as_equal_in_distribution_not_bitwise(checked):
    """Each rank draws its own masks (seed + rank): the runs are compared with dropout off, and the verdict says
    what holds with it on."""
    proc = checked["dropout"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dropout (2) is off (p=0) in both runs" in proc.stdout and "within" in proc.stdout
    assert "equivalent: in distribution, not bit for bit: with dropout off the runs match" in proc.stdout


@pytest.mark.e2e
def test_check_fails_on_an_unused_parameter_and_names_the_option(checked):
    """The runs' own pre-check refuses the model before DDP's first step; the probe names the likely cause. The
    model has dropout too, so the runs take it through check's own factory with dropout off: what check prints
    names the model as the user did (27.6), never that factory."""
    proc = checked["unused"]
    assert proc.returncode == 1 and "tools.check" not in proc.stdout + proc.stderr
    assert "equivalent: NO: the run on 2 processes crashed" in proc.stdout
    crash = "the run crashed: error: --model usermodels:unused_dropout: parameters spare.weight, spare.bias get no "
    assert crash in proc.stdout
    assert "likely cause: unused parameters: spare.weight, spare.bias" in proc.stdout
    assert "pass --static-graph" in proc.stdout and "find_unused_parameters=True" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.e2e
def test_a_run_that_crashes_is_named_as_a_crash_with_its_error(checked):
    proc = checked["crashing"]
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    assert "equivalent: NO: the run on 2 processes crashed" in proc.stdout
    assert "the run crashed: error: --model usermodels:crashing: the factory raised RuntimeError: " in proc.stdout
    assert "none of the usual" not in proc.stdout


@pytest.mark.e2e
def test_the_command_prints_one_error_line_not_a_traceback(checked):
    proc = checked["failing stream"]
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: --data usermodels:failing_stream: reading the training set raised ConnectionError: "
        "stream closed by the server"
    ]


# --- the same check on more models and recipes, their runs in two shared launches --------------------------------
#
# The models and data people really have (a transformers GPT-2 and BERT from tiny configs, no download, a nanoGPT-style
# model; dict and pair batches, streams with and without a length: tests/check_user.py), a built-in one, and the
# verdicts that need a real run (BatchNorm's weights apart; --static-graph fixing an unused parameter). Each check is
# prepared (probed) as `check` prepares it and judged as `check` judges it (tools.check.prepare, conclude), and its
# runs are the command lines `check` starts (distributed_args, one_process_args): every distributed run in one torchrun
# launch of tests/copy_jobs.py, then every single-process and initial run in one launch on one process. The launches
# and their imports are paid twice, not three times per check. (The check command's own launches: the tests above.)

SHARED = {  # id: recipe, prepare's options
    "fsdp-builtin": ("fsdp", {}),
    "batchnorm": ("ddp", {"model": "check_user:batchnorm"}),
    "unused-static-graph": ("ddp", {"model": "check_user:unused", "options": ("--static-graph",)}),
    "ddp_amp-gpt2": (  # its own loss, dicts, a sized stream
        "ddp_amp",
        {"model": "check_user:gpt2", "data": "check_user:lm_stream", "options": ("--accum", "2")},
    ),
    "ddp_amp-nano": (  # an unsized stream
        "ddp_amp",
        {
            "model": "check_user:nano",
            "data": "check_user:pair_stream",
            "options": ("--accum", "2", "--precision", "bf16"),
        },
    ),
    "fsdp-nano": ("fsdp", {"model": "check_user:nano", "data": "check_user:pair_stream"}),
    "fsdp-bert": ("fsdp", {"model": "check_user:bert", "data": "check_user:classify"}),  # the root keeps parameters
    "fsdp-gpt2": (
        "fsdp",
        {"model": "check_user:gpt2", "data": "check_user:lm_stream", "options": ("--accum", "2", "--clip", "1.0")},
    ),
}
REAL_MODEL = {"ddp_amp-gpt2", "ddp_amp-nano", "fsdp-nano", "fsdp-bert", "fsdp-gpt2"}  # steps 3, batch 4 per rank


def _launch(jobs: list[dict], folder: Path, nproc: int) -> str:
    """tests/copy_jobs.py's launch of `jobs` on `nproc` processes: its output, each job's `job LABEL exit` lines."""
    (folder / "jobs.json").write_text(json.dumps(jobs))
    env = user_env(PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]))  # check_user: the user's module
    proc = run(torchrun(str(REPO / "tests" / "copy_jobs.py"), str(folder / "jobs.json"), nproc=nproc), cwd=folder,
               env=env, timeout=400, check=False)  # fmt: skip
    return f"--stdout--\n{proc.stdout}\n--stderr--\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def shared_checks(tmp_path_factory) -> dict[str, tuple[Report | None, str]]:
    """id -> (the check's report, or None where a run has no summary; the launches' output)."""
    out = tmp_path_factory.mktemp("checks")
    plans = {}
    for key, (name, options) in SHARED.items():
        sizes = {"steps": 3, "batch_size": 4} if key in REAL_MODEL else {}
        plans[key] = prepare(RECIPES[name], **sizes, **options)

    def job(key: str, run_args: list[str], kind: str) -> dict:
        plan = plans[key]
        args = [*run_args[3:], *plan.quiet, "--out", str(out / key / kind)]  # after `recipes run NAME`
        return {"label": f"{key}/{kind}", "recipe": plan.args[2], "args": args, "env": plan.env}

    said = _launch([job(k, distributed_args(p), "distributed") for k, p in plans.items()], out, nproc=2)
    distributed = {key: run_summary(out / key / "distributed") for key in plans}
    single = [job(k, a, kind) for k, d in distributed.items() if d for kind, a in one_process_args(plans[k], d).items()]
    (out / "one").mkdir()
    said += _launch(single, out / "one", nproc=1)
    reports = {}
    for key, plan in plans.items():
        runs = [run_summary(out / key / kind) for kind in ("distributed", "single", "initial")]
        reports[key] = (conclude(plan, runs, None) if None not in runs else None, said)
    return reports


def _shared(shared_checks, key: str) -> Report:
    report, said = shared_checks[key]
    assert f"job {key}/distributed exit 0 rank 0" in said and report is not None, said
    return report


@pytest.mark.e2e
@pytest.mark.parametrize("key", ["fsdp-builtin", *sorted(REAL_MODEL)])
def test_two_ranks_train_like_one_process(shared_checks, key):
    """A built-in model under fsdp, and the models people really have under the recipes that take them."""
    report = _shared(shared_checks, key)
    assert report.equivalent and "equivalent: yes" in report.text, report.text
    assert "largest parameter difference" in report.text and "training loss difference" in report.text


@pytest.mark.e2e
def test_check_fails_on_batchnorm_and_names_it(shared_checks):
    report = _shared(shared_checks, "batchnorm")
    assert not report.equivalent and "weights apart / moved by training" in report.text and "OUTSIDE" in report.text
    assert "likely cause: BatchNorm without SyncBatchNorm: 1 (BatchNorm1d)" in report.text
    expected = "pass --sync-batchnorm" if torch.cuda.is_available() else "needs CUDA"
    assert expected in report.text


@pytest.mark.e2e
def test_the_advised_option_fixes_the_unused_parameter(shared_checks):
    report = _shared(shared_checks, "unused-static-graph")
    assert report.equivalent, report.text
    assert "warning: unused parameters" in report.text  # still said: they never train


@pytest.mark.fast
def test_unequal_counted_targets_are_the_likely_cause_named_for_ddp_not_for_ddp_amp():
    """review4: `check ddp` on padded text (a GPT-2's labels, -100 tails of other lengths) failed blaming "none of
    the usual ones"; ddp averages each rank's mean, so the pre-check's line on unequal counts is the likely cause.
    ddp_amp weighs every target alike: no such finding."""
    from tools.check import prepare

    plan = prepare(RECIPES["ddp"], model="check_user:gpt2", data="check_user:lm", batch_size=2)
    (finding,) = [f for f in plan.report.findings if f.cause == "targets counted unequally across the ranks"]
    assert finding.detail.startswith("the first samples hold ") and "ddp_amp weighs every target" in finding.detail
    plan = prepare(RECIPES["ddp_amp"], model="check_user:gpt2", data="check_user:lm", batch_size=2)
    assert not [f for f in plan.report.findings if "unequally" in f.cause]

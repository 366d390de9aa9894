"""The run folder's promises under faults and careless use (issue 11): a finished run stays finished,
a refused resume touches nothing, records stay whole and strict JSON, one job holds a folder."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core.kernel.job import RunFolder, write_record
from core.plugins.records import repair_records
from helpers import REPO, in_one_interpreter, recipes_cli, run, torchrun, user_env
from tools.options import KEPT

pytestmark = pytest.mark.e2e
TINY = ["--model", "tiny:mlp", "--batch-size", "16", "--timeout-s", "60"]


def _env():  # this checkout's code, not the one an editable install points at
    return user_env(PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]))


def _run(tmp_path, *args, check=True):
    return recipes_cli(
        "run", "ddp", *TINY, "--out", str(tmp_path / "runs"), *args, cwd=tmp_path, env=_env(), check=check
    )


def _strict(path):
    """Every line of metrics.jsonl parsed as strict JSON (no NaN, no Infinity)."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def _snapshot(folder):
    return {p.relative_to(folder): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The quick start's shape (115 steps, checkpoints at 50 and 100), and the checkpoint every run ends with (issue
    36: it can train longer), --keep 3 keeping them all."""
    tmp_path = tmp_path_factory.mktemp("finished")
    proc = _run(tmp_path, "--max-steps", "7", "--ckpt-every", "3", "--keep", "3")
    (tmp_path / "stdout.txt").write_text(proc.stdout)
    names = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").rglob("*") if p.is_file())
    files = (".lock", *CKPTS, "config.json", "metrics.jsonl", "model.safetensors", "train.log")
    assert names == [f"runs/ddp-1/{n}" for n in files]
    return tmp_path


def test_train_log_holds_every_line_the_run_printed_with_time_level_and_rank(finished):
    """Issue 28 item 5: the terminal keeps its lines as they were; train.log has each of them, in order."""
    printed = (finished / "stdout.txt").read_text().splitlines()
    assert printed[0].startswith("step 7/7 epoch 0 loss ") and printed[-1].startswith("summary val_loss=")
    log = (finished / "runs" / "ddp-1" / "train.log").read_text().splitlines()
    line = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \| (\w+) *\| rank 0 \| (.*)")
    said = [line.fullmatch(entry).groups() for entry in log]
    assert [message for level, message in said if level == "INFO"] == printed
    assert said[0] == ("DEBUG", f"run folder {finished / 'runs' / 'ddp-1'}")  # stderr's line, for the launcher


CKPTS = ("ckpt/step-000003.safetensors", "ckpt/step-000006.safetensors", "ckpt/step-000007.safetensors")


def _stopped(finished, tmp_path):
    """A copy of the finished run stopped before its end (no summary, no weights, no checkpoint at its last step): it
    has steps left to train."""
    shutil.copytree(finished / "runs", tmp_path / "runs")
    metrics, run_dir = tmp_path / "runs" / "ddp-1" / "metrics.jsonl", tmp_path / "runs" / "ddp-1"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _strict(metrics) if r["kind"] != "summary"))
    (run_dir / "model.safetensors").unlink()
    (run_dir / CKPTS[-1]).unlink()
    return tmp_path


REFUSED = [  # a resume of the stopped run with another option: (its options, words of its one line)
    (["--model", "cnn"], "holds another model"),
    (["--lr", "0.01"], "--lr 0.001 -> 0.01"),
    (["--seed", "3"], "--seed 0 -> 3"),
]


@pytest.fixture(scope="module")
def alone(finished, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path, dict]]:
    """The runs of this module's tests that take one process and no signal (`python -m recipes run ddp ...`), each
    in a working folder of its own (a copy of the finished run for its resumes, a stopped copy for each refused
    resume), one after another in one interpreter (tests/cli_cases.py): {case: (what it returned, its folder, the
    snapshot of its runs/ taken before)}."""
    cases = {}

    def case(key: str, args: list[str], *, runs=None, env=None) -> Path:
        folder = tmp_path_factory.mktemp(key.replace(" ", "-"))
        if runs == "finished":
            shutil.copytree(finished / "runs", folder / "runs")
        elif runs == "stopped":
            _stopped(finished, folder)
        elif runs == "empty":
            (folder / "runs" / "ddp-1").mkdir(parents=True)
        before = _snapshot(folder / "runs") if runs else {}
        command = ["run", "ddp", *args, "--out", str(folder / "runs")]
        cases[key] = ({"args": command, "cwd": str(folder), "env": env or {}}, folder, before)
        return folder

    finished_args = [*TINY, "--max-steps", "7"]
    case("--resume auto", [*finished_args, "--resume", "auto"], runs="finished")
    case("torchrun restart", finished_args, runs="finished", env={"TORCHELASTIC_RESTART_COUNT": "1"})
    for i, (args, _) in enumerate(REFUSED):
        cli_args = [a for a in TINY if a not in ("--model", "tiny:mlp")] if "--model" in args else TINY
        case(f"refused {i}", [*cli_args, "--max-steps", "7", "--resume", "auto", *args], runs="stopped")
    case("no checkpoint", [*TINY, "--max-steps", "1", "--epochs", "1", "--resume", "auto"], runs="empty")
    exploding = ["--model", "tiny:exploding", "--log-every", "1"]
    case("non-finite", [*exploding, "--max-steps", "6"])
    case("skip non-finite", [*exploding, "--max-steps", "5", "--on-nonfinite", "skip"])
    case(
        "child named module",
        [*TINY, "--model", "tiny:wrapper", "--data", "tiny:named", "--max-steps", "3", "--epochs", "1"],
    )
    said = in_one_interpreter([c for c, _, _ in cases.values()], env=_env())
    return {key: (proc, folder, before) for (key, (_, folder, before)), proc in zip(cases.items(), said, strict=True)}


@pytest.mark.parametrize("how", ["--resume auto", "torchrun restart", "--resume step-3 at 2 ranks", "a copy"])
def test_resuming_a_finished_run_trains_nothing_and_changes_no_byte(finished, alone, how, tmp_path):
    """27.2: the run's summary says it is finished: a resume of any of its checkpoints, at any world size (its
    global batch and options are not even checked), through the CLI, bare torchrun or a standalone copy, prints one
    line and exits 0, and every file (the lock's contents, config.json, metrics.jsonl, weights) keeps its bytes. (The
    CLI's two: in `alone`, each on a copy of the finished run.)"""
    runs, out = finished / "runs", ["--out", str(finished / "runs"), "--max-steps", "7"]
    before = _snapshot(runs)
    if how in ("--resume auto", "torchrun restart"):
        proc, folder, before = alone[how]
        runs = folder / "runs"
        assert proc.returncode == 0, proc.stderr
    elif how == "a copy":
        copy = tmp_path / "ddp_copy.py"
        recipes_cli("cp", "ddp", str(copy), "--standalone", cwd=tmp_path, env=_env())
        lean = [a for a in TINY if a not in ("--model", "tiny:mlp")]  # a lean copy names its model in its code
        proc = run([sys.executable, str(copy), *lean, *out, "--resume", "auto"], cwd=tmp_path, env=_env())
    else:  # 2 ranks, global batch 32 (the run's was 16), under bare torchrun
        step3 = str(runs / "ddp-1" / CKPTS[0])
        proc = run([*torchrun("-m", "recipes", "run", "ddp"), *TINY, *out, "--resume", step3], cwd=finished, env=_env())
    last, lean = proc.stdout.strip().splitlines()[-1], " in a copy made --with longer" * (how == "a copy")
    assert last.endswith(f"at step 7; nothing to train (more --epochs or --max-steps{lean} train it on)"), proc.stdout
    assert _snapshot(runs) == before
    assert sorted(p.name for p in runs.iterdir()) == ["ddp-1"]


def test_a_run_stopped_during_its_hf_write_writes_what_is_missing_and_trains_nothing(tmp_path):
    """27.7: SIGTERM during the hf/ write, after the checkpoint at the last step: the weights are on disk, hf/ is
    half written, no summary. The run is not finished: resumed, it trains nothing, evaluates the final weights again
    and writes the weights, hf/ and the summary, the same bytes and numbers as the run that was not stopped. A torn
    last record (the kill came mid-write) is dropped first."""
    gpt2 = ["--model", "check_user:gpt2", "--data", "check_user:lm_val", "--batch-size", "8", "--max-steps", "4"]
    run_dir, kept = tmp_path / "runs" / "ddp-1", tmp_path / "kept"
    command = ["run", "ddp", *TINY, "--out", str(tmp_path / "runs"), *gpt2, "--ckpt-every", "2"]
    (tmp_path / "stop.py").write_text(STOPPED)
    stop = {"file": str(tmp_path / "stop.py"), "args": [str(run_dir), str(kept)]}  # what it left is kept aside first
    cases = [{"args": command}, stop, {"args": [*command, "--resume", "auto"]}]  # the run, its stop, the resume
    said = in_one_interpreter([case | {"cwd": str(tmp_path)} for case in cases], env=_env())  # in turn
    for case in said:
        assert case.returncode == 0, case.stdout + case.stderr
    proc = said[-1]
    promised = {
        run_dir / p.relative_to(kept): p.read_bytes() for p in [kept / "model.safetensors", *(kept / "hf").iterdir()]
    }
    records = _strict(kept / "metrics.jsonl")
    after = _strict(run_dir / "metrics.jsonl")
    assert after[: len(records) - 1] == records[:-1] and "already finished" not in proc.stdout
    assert [r["kind"] for r in after[len(records) - 1 :]] == ["resume", "eval", "summary"]
    assert {p: p.read_bytes() for p in promised} == promised
    same = ("val_loss", "val_acc", "steps", "weights")
    assert {k: after[-1].get(k) for k in same} == {k: records[-1].get(k) for k in same} and "val_loss" in after[-1]
    assert after[-2] | {"epoch": None} == [r for r in records if r["kind"] == "eval"][-1] | {"epoch": None}


STOPPED = """
import json, shutil, sys
from pathlib import Path
from core.plugins.lock import HELD
for handle in HELD:  # the stopped run's process ends: its lock with it (the run, in this interpreter, left it held)
    handle.close()
HELD.clear()
run_dir, kept = Path(sys.argv[1]), Path(sys.argv[2])
kept.mkdir()
shutil.copy(run_dir / "model.safetensors", kept)
shutil.copytree(run_dir / "hf", kept / "hf")
shutil.copy(run_dir / "metrics.jsonl", kept)
records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
done = "".join(json.dumps(r) + "\\n" for r in records[:-1])  # all but the summary
(run_dir / "metrics.jsonl").write_text(done + '{"kind": "train", "step": 5, "lo')
(run_dir / "hf" / "model.safetensors").unlink()
"""


@pytest.mark.parametrize("refused", range(len(REFUSED)), ids=[" ".join(args) for args, _ in REFUSED])
def test_a_refused_resume_is_refused_before_anything_starts_and_touches_nothing(alone, refused):
    proc, folder, before = alone[f"refused {refused}"]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.count("error: ") == 1 and REFUSED[refused][1] in proc.stderr
    assert _snapshot(folder / "runs") == before


def test_a_recipe_run_as_a_file_refuses_a_resume_itself_and_a_refused_new_run_leaves_no_folder(finished, tmp_path):
    """`python recipes/ddp.py` (or a copy) has no CLI pre-check: the run checks the checkpoint's header before it
    touches anything, a damaged checkpoint refused at load takes back the folder made for it, and a new run refused
    for bad input never made a folder (it builds before it opens one)."""
    finished = _stopped(finished, tmp_path)
    runs = finished / "runs"
    before = _snapshot(runs)
    damaged = finished / "damaged.safetensors"  # outside the runs: its resume would make a new folder
    body = bytearray(next((runs / "ddp-1" / "ckpt").glob("*.safetensors")).read_bytes())
    body[-9] ^= 0x10  # one bit of tensor data: its header passes, its checksum does not
    damaged.write_bytes(bytes(body))
    recipe = [*TINY, "--out", str(runs), "--max-steps", "7"]
    cases = [
        (["--resume", str(damaged)], "does not match its checksum"),  # a review find: it left an empty runs/ddp-2
        (["--resume", "auto", "--lr", "0.01"], "--lr 0.001 -> 0.01"),
        (["--resume", "auto", "--batch-size", "8"], "saved with global batch 16"),
        (["--model", "no_such_module:build"], "cannot import 'no_such_module'"),
        (["--out", str(runs / "ddp-1" / "config.json")], "Not a directory"),
    ]
    file = str(REPO / "recipes" / "ddp.py")  # `python recipes/ddp.py ARGS`, the five in one interpreter, in turn
    said = in_one_interpreter(
        [{"file": file, "args": [*recipe, *a], "cwd": str(finished)} for a, _ in cases], env=_env()
    )
    for proc, (_, words) in zip(said, cases, strict=True):
        assert proc.returncode == 1 and proc.stderr.count("error: ") == 1 and words in proc.stderr, proc.stderr
    assert _snapshot(runs) == before and sorted(p.name for p in runs.iterdir()) == ["ddp-1"]


def test_resume_auto_says_so_when_the_newest_run_has_no_checkpoint(alone):
    """A run that stopped before its first checkpoint (or took none) is the newest: --resume auto starts a new run,
    as a requeued job that never saved must, and says so rather than silently."""
    proc, folder, _ = alone["no checkpoint"]
    assert proc.returncode == 0, proc.stderr
    runs = folder / "runs"
    assert f"--resume auto: {runs / 'ddp-1'}, the newest ddp run, has no usable checkpoint" in proc.stdout
    assert sorted(p.name for p in runs.iterdir()) == ["ddp-1", "ddp-2"]


def test_records_are_one_write_each_and_torn_lines_repair(tmp_path):
    path = tmp_path / "metrics.jsonl"
    run = RunFolder(tmp_path, None, "ddp", {}, writer=True)
    write_record(run, {"kind": "train", "loss": float("nan"), "grad_norm": float("inf"), "step": 1})
    path.write_bytes(path.read_bytes() + b'{"kind": "tr')
    repair_records(path)
    assert _strict(path) == [{"kind": "train", "loss": None, "grad_norm": None, "step": 1}]


def test_a_non_finite_loss_stops_the_run_naming_the_step(alone):
    proc, folder, _ = alone["non-finite"]
    assert proc.returncode == 1 and "error: step 3: the loss or the gradients are not finite" in proc.stderr
    assert "Traceback" not in proc.stderr
    _strict(folder / "runs" / "ddp-1" / "metrics.jsonl")
    last = (folder / "runs" / "ddp-1" / "train.log").read_text().splitlines()[-1]  # the error ends the log too
    assert re.fullmatch(r"\S+ \S+ \| ERROR   \| rank 0 \| error: step 3: the loss or the gradients are not .*", last)


def test_a_recipe_run_as_a_file_from_nan_weights_stops_in_one_line_naming_its_own_options(tmp_path):
    """A review find: a first step that is not finite printed torch's lr_scheduler warning before the error, and
    the error advised --clip, which ddp does not take (the CLI's pre-check refuses nan weights before this)."""
    recipe = [sys.executable, str(REPO / "recipes" / "ddp.py"), "--model", "check_user:nan_weights"]
    proc = subprocess.run(
        [*recipe, "--max-steps", "2", "--out", str(tmp_path / "runs")],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and "Warning" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: step 1: the loss or the gradients are not finite (gradient norm nan); lower --lr, or pass "
        "--on-nonfinite skip"
    )
    assert not list((tmp_path / "runs").iterdir())  # issue 27 item 7: it left config.json and .lock in a folder


def test_skip_on_non_finite_skips_and_counts(alone):
    proc, folder, _ = alone["skip non-finite"]
    assert proc.returncode == 0 and "skipped_steps=3" in proc.stdout, proc.stdout + proc.stderr
    records = _strict(folder / "runs" / "ddp-1" / "metrics.jsonl")
    assert [r["loss"] for r in records if r["kind"] == "train"][-1] is None


HOLD = """
import fcntl, os, socket, sys, time
lock = open(sys.argv[1], "a+")
fcntl.flock(lock, fcntl.LOCK_EX)
lock.truncate(0); lock.write(f"PID {os.getpid()} on {socket.gethostname()}"); lock.flush()
print("held", flush=True)
time.sleep(60)
"""


def test_a_folder_held_by_a_live_job_is_refused_and_a_stale_lock_is_taken_over(finished, tmp_path):
    """The lock is an flock the kernel releases when its holder ends, however it ends: a lock file left behind
    by a killed job is no lock."""
    finished = _stopped(finished, tmp_path)  # a finished run is said finished before the lock
    lock = finished / "runs" / "ddp-1" / ".lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = recipes_cli(
            "run",
            "ddp",
            *TINY,
            "--out",
            str(finished / "runs"),
            "--max-steps",
            "7",
            "--resume",
            "auto",
            cwd=finished,
            env=_env(),
            check=False,
        )
        assert proc.returncode == 1 and f"is in use by PID {holder.pid}" in proc.stderr
    finally:
        holder.kill()
        holder.wait()
    proc = recipes_cli(
        "run",
        "ddp",
        *TINY,
        "--out",
        str(finished / "runs"),
        "--max-steps",
        "7",
        "--resume",
        "auto",
        cwd=finished,
        env=_env(),
    )  # the holder is gone: the kernel released its lock, the file it left is no lock
    assert "summary " in proc.stdout and "already finished" not in proc.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs to fill")
def test_a_full_disk_is_one_line_naming_the_folder(tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        proc = recipes_cli(
            "run",
            "ddp",
            "--max-steps",
            "4",
            "--ckpt-every",
            "2",
            "--log-every",
            "1",  # 26 MB each
            "--out",
            str(disk / "runs"),
            cwd=tmp_path,
            env=_env(),
            check=False,
        )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: {disk}/runs/ddp-1") and "the disk is full" in line, line  # not the cwd's
        assert int(re.search(r"\(([\d,]+) bytes free\)", line)[1].replace(",", "")) < 600_000, line  # that disk's
        _strict(next(disk.glob("runs/ddp-*/metrics.jsonl")))
    finally:
        subprocess.run(["umount", str(disk)])


@pytest.mark.parametrize(
    "stop,code,says",
    [
        (signal.SIGINT, 130, f"interrupted; {KEPT}"),
        (signal.SIGTERM, 143, "stopped by SIGTERM; checkpoints already written are kept: --resume auto continues"),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_or_sigterm_exits_in_one_line_and_keeps_the_run_and_its_checkpoints(tmp_path, stop, code, says):
    """A review find: SIGTERM (a scheduler's preemption) to `python -m recipes run` ended it with no line at all."""
    args = [*TINY, "--out", str(tmp_path / "runs"), "--epochs", "50", "--ckpt-every", "2", "--log-every", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "recipes", "run", "ddp", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=tmp_path,
    )
    for line in proc.stdout:  # a checkpoint is written at step 4: interrupt after it
        if line.startswith("step 5/"):
            break
    proc.send_signal(stop)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code and err.strip().splitlines()[-1].startswith(f"error: {says}"), err
    assert list((tmp_path / "runs" / "ddp-1" / "ckpt").glob("step-*.safetensors"))


def test_a_model_with_a_child_named_module_and_namedtuple_samples_train_and_save_whole(alone):
    """Issue 19 item 1: both defects of the helpers that existed twice, through the real CLI."""
    from safetensors.torch import load_file

    from tiny import Wrapper

    proc, folder, _ = alone["child named module"]
    assert proc.returncode == 0 and "val_acc=" in proc.stdout, proc.stderr  # evaluation moved the namedtuple batches
    saved = load_file(folder / "runs" / "ddp-1" / "model.safetensors")
    assert saved.keys() == Wrapper().state_dict().keys() == {"module.weight", "module.bias", "head.weight", "head.bias"}


RACE = """
import sys, time
from pathlib import Path
from core.kernel.job import RecipeError
from core.plugins.lock import take_lock
start, folder = float(sys.argv[1]), Path(sys.argv[2])
time.sleep(max(start - time.time(), 0))  # every contender goes at the same instant
try:
    lock = take_lock(folder)
    print("won", flush=True)
    sys.stdin.read()  # hold it until the test has heard from everyone
except RecipeError as err:
    print("refused:", err, flush=True)
"""


def _contend(folder, contenders: int) -> list[str]:
    """`contenders` threads take the folder's lock at the same instant (each its own open file, as jobs have)."""
    import threading

    from core.kernel.job import RecipeError
    from core.plugins.lock import take_lock

    barrier, said, held = threading.Barrier(contenders), [], []

    def contend():
        barrier.wait()
        try:
            held.append(take_lock(folder))
            said.append("won")
        except RecipeError as err:
            said.append(f"refused: {err}")

    threads = [threading.Thread(target=contend) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for handle in held:
        handle.close()
    return said


@pytest.mark.fast
def test_contenders_for_one_run_folder_at_the_same_instant_leave_exactly_one_holder(tmp_path):
    """Issue 20 item 9: the lock is one flock, taken atomically (the old check-then-write let two jobs in once in
    eight tries): 200 times, 4 contenders at once, exactly one holds the folder and the others are refused."""
    for trial in range(200):
        said = _contend(tmp_path, 4)
        assert said.count("won") == 1, (trial, said)
        assert all(s.startswith(f"refused: {tmp_path} is in use by ") for s in said if s != "won"), said


def test_two_jobs_started_at_the_same_instant_on_one_run_folder_one_is_refused(tmp_path):
    """The same with processes (two jobs), a few times: one holds the folder, the other is refused naming it. The
    trials go side by side, each pair of jobs on a folder of its own, all at one instant (one wait for the imports)."""
    env = user_env(PYTHONPATH=str(REPO))
    start = time.time() + 4  # every job has imported torch by then: they go at this instant
    trials = {}
    for trial in range(2):
        folder = tmp_path / f"run-{trial}"
        folder.mkdir()
        trials[folder] = [
            subprocess.Popen(
                [sys.executable, "-c", RACE, str(start), str(folder)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in range(2)
        ]
    for folder, jobs in trials.items():
        said = sorted(job.stdout.readline().strip() for job in jobs)
        for job in jobs:
            job.communicate("", timeout=60)
        assert said[1] == "won" and said[0].startswith(f"refused: {folder} is in use by "), said


KILLED_SAVE = """
import os, signal, sys
from core.kernel import replica, store  # ddp's checkpoints: the kernel's, written by the fast_writer plug-in
from core.plugins import fast_writer
point, at_step = sys.argv[1], int(sys.argv[2])
sys.argv[1:3] = []

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def wrap(module, name, when):
    original = getattr(module, name)
    def patched(*args, **kwargs):
        if when(*args):
            die()
        return original(*args, **kwargs)
    setattr(module, name, patched)

saving = lambda path, *a: f"step-{at_step:06d}" in str(path)
if point == "before the write":
    wrap(replica, "write_tensors", saving)  # the name save_checkpoint calls
elif point == "mid-file":
    calls = []
    wrap(fast_writer, "_write_all", lambda f, view: saving(f.name) and len(calls.append(1) or calls) == 3)
elif point == "before the rename":
    wrap(store.os, "replace", lambda src, dst: saving(dst))
elif point == "after the rename":
    real_replace = store.os.replace
    def replaced(src, dst):
        real_replace(src, dst)
        if saving(dst):
            die()
    store.os.replace = replaced
import runpy
runpy.run_path(sys.argv[0] if False else "{recipe}", run_name="__main__")
"""


KILLED_ARGS = [*TINY, "--max-steps", "9", "--epochs", "1", "--ckpt-every", "3", "--log-every", "1"]


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory) -> dict:
    """Each kill point's job, SIGKILLed during its step-6 checkpoint (the four side by side), then `python
    recipes/ddp.py --resume auto` of each, and the uninterrupted run they must match, these five one after another in
    one interpreter (tests/cli_cases.py): {point: (killed, resumed, its out folder)}, and "uninterrupted": weights."""
    recipe = str(REPO / "recipes" / "ddp.py")
    env = user_env(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    script = KILLED_SAVE.replace("{recipe}", recipe)
    outs = {point: tmp_path_factory.mktemp("cut") for point in POINTS}
    started = {
        point: subprocess.Popen(
            [sys.executable, "-c", script, point, "6", *KILLED_ARGS, "--out", str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for point, out in outs.items()
    }
    killed = {}
    for point, proc in started.items():
        stdout, stderr = proc.communicate(timeout=120)
        killed[point] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    whole = tmp_path_factory.mktemp("whole")
    runs = [whole, *outs.values()]  # the uninterrupted run first: the same command, a new folder
    cases = [
        {"file": recipe, "args": [*KILLED_ARGS, "--resume", "auto", "--out", str(out)], "cwd": str(out)} for out in runs
    ]
    uninterrupted, *resumed = in_one_interpreter(cases, env=env)
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    done = {point: (killed[point], resumed[i], outs[point]) for i, point in enumerate(POINTS)}
    return done | {"uninterrupted": whole / "ddp-1" / "model.safetensors"}


POINTS = ["before the write", "mid-file", "before the rename", "after the rename"]


@pytest.mark.parametrize("point", POINTS)
def test_a_run_killed_at_any_point_of_a_checkpoint_write_resumes_bitwise(point, killed_and_resumed):
    """Issue 20 item 9: SIGKILL before, during and after a checkpoint's write and rename; --resume auto then
    continues from the newest whole checkpoint and ends bit for bit where the uninterrupted run ends."""
    from safetensors.torch import load_file

    killed, resumed, out = killed_and_resumed[point]
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr
    cut, expected = load_file(out / "ddp-1" / "model.safetensors"), load_file(killed_and_resumed["uninterrupted"])
    assert cut.keys() == expected.keys() and all(torch.equal(cut[k], expected[k]) for k in cut)
    assert not list((out / "ddp-1" / "ckpt").glob(".*.tmp-*")), "the interrupted write is cleaned up"

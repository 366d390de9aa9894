"""A run's printed lines and its log (core.kernel.job): train.log through loguru, the error line a job prints once, and
the line a failed write gives (issue 28 item 5, issue 27 item 7). In-process: no process group, no launch."""

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from loguru import logger

from core.kernel import job as records  # the log lives in the kernel now
from core.kernel.job import RecipeError, RunFolder, fail, open_log, os_error_line, say, write_record
from core.plugins.take_back import take_back
from tools.options import env_number

pytestmark = pytest.mark.fast
LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \| (INFO|WARNING|ERROR) +\| rank (\d+) \| (.*)")


@pytest.fixture
def run(tmp_path):
    folder = tmp_path / "ddp-1"
    folder.mkdir()
    (folder / "config.json").write_text("{}\n")
    (folder / ".lock").write_text("PID 1\n")
    yield RunFolder(folder, None, "ddp", {}, True)
    close_log()


def close_log() -> None:
    """The end of this process's run log (a run's process ends with it; tests run many)."""
    if records.RUN_LOG:
        logger.remove(records.RUN_LOG.pop("id"))
        records.RUN_LOG.clear()


def logged(run: RunFolder) -> list[tuple[str, str, str]]:
    """(level, rank, message) of every train.log line; each line has its time."""
    lines = (run.path / "train.log").read_text().splitlines()
    found = [LINE.fullmatch(line) for line in lines]
    assert all(found), lines
    return [(m[2], m[3], m[4]) for m in found]


def test_every_line_printed_goes_to_train_log_with_time_level_and_rank(run, capsys):
    open_log(run)
    assert (run.path / "train.log").is_file()  # from the moment the folder is known
    say(run, "step 10/20 epoch 0 loss 1.0000")
    say(run, "warning: something", level="WARNING")
    say(RunFolder(run.path, None, "ddp", {}, False), "rank 1 says nothing")  # not the writer: no line
    write_record(run, {"kind": "train", "step": 2})  # a run that trained keeps its folder
    assert fail("step 3: the loss is not finite", 1) == 1
    out, err = capsys.readouterr()
    assert out == "step 10/20 epoch 0 loss 1.0000\n"  # the terminal keeps today's forms
    assert err == "warning: something\nerror: step 3: the loss is not finite\n"
    assert logged(run) == [
        ("INFO", "0", "step 10/20 epoch 0 loss 1.0000"),
        ("WARNING", "0", "warning: something"),
        ("ERROR", "0", "error: step 3: the loss is not finite"),
    ]
    close_log()
    say(run, "after the end")  # the sink is gone: the terminal only
    assert logged(run)[-1][2] == "error: step 3: the loss is not finite"


def test_lines_said_while_the_folder_is_chosen_open_train_log_with_their_own_times(run, tmp_path, capsys):
    """--resume auto's lines (a damaged checkpoint passed over, a new run started) come before the folder is known:
    train.log starts with them; lines of an earlier choice, or said after a run ended, are kept for no run."""
    open_log(None)
    say(None, "said while another run chose its folder, a choice that failed", level="WARNING")
    open_log(None)  # this run's choice
    say(None, "warning: --resume auto: skipping ckpt/step-000020.safetensors, damaged", level="WARNING")
    say(None, "--resume auto: no ddp run in runs; starting a new run")
    assert capsys.readouterr().out == "--resume auto: no ddp run in runs; starting a new run\n"  # as before
    open_log(run)
    say(run, "step 1/1 epoch 0 loss 1.0000")
    assert [m for _, _, m in logged(run)] == [
        "warning: --resume auto: skipping ckpt/step-000020.safetensors, damaged",
        "--resume auto: no ddp run in runs; starting a new run",
        "step 1/1 epoch 0 loss 1.0000",
    ]
    close_log()
    say(None, "said after the run ended", level="WARNING")  # kept for no later run
    other = RunFolder(tmp_path / "ddp-2", None, "ddp", {}, True)
    other.path.mkdir()
    open_log(other)
    say(other, "second")
    assert [m for _, _, m in logged(other)] == ["second"]


def test_a_second_run_in_one_process_logs_to_its_own_folder_only(run, tmp_path):
    other = RunFolder(tmp_path / "ddp-2", None, "ddp", {}, True)
    other.path.mkdir()
    open_log(run)
    say(run, "first")
    open_log(other)  # the run before ended: its log is closed
    say(other, "second")
    assert [m for _, _, m in logged(run)] == ["first"] and [m for _, _, m in logged(other)] == ["second"]


def test_a_users_own_loguru_lines_stay_out_of_train_log(run):
    open_log(run)
    logger.info("the user's own line")
    say(run, "ours")
    assert [m for _, _, m in logged(run)] == ["ours"]


@pytest.mark.parametrize(
    "rank, world, everyone, says",
    [
        ("0", "1", True, "error: it failed"),  # no torchrun: as it always was
        ("0", "1", False, "error: it failed"),
        ("0", "2", True, "error: it failed"),  # every rank meets it: rank 0 says it, as it is
        ("1", "2", True, ""),  # ... and rank 1 does not (torchrun ends it while it waits)
        ("1", "2", False, "error: rank 1: it failed"),  # its own: with its number
        ("0", "2", False, "error: rank 0: it failed"),
        ("1", "2", "late", "error: rank 1: it failed"),  # every rank's, but rank 0 did not end the job: with its number
    ],
)
def test_under_torchrun_an_error_every_rank_meets_is_said_once_and_a_ranks_own_with_its_number(
    rank, world, everyone, says, monkeypatch, capsys
):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    waited = []
    if everyone is True and rank != "0":  # torchrun ends rank 1 in its grace: as if it did
        monkeypatch.setattr(records.time, "sleep", lambda s: (waited.append(s), (_ for _ in ()).throw(SystemExit)))
    else:
        monkeypatch.setattr(records.time, "sleep", waited.append)
    try:
        fail("it  failed", 1, everyone=bool(everyone))
    except SystemExit:
        pass
    assert capsys.readouterr().err.strip() == says
    assert waited == ([records.GRACE_S] if everyone and rank != "0" else [])


@pytest.mark.parametrize("variable", ["RANK", "WORLD_SIZE"])
def test_fail_says_its_line_when_rank_or_world_size_is_malformed(variable, monkeypatch, capsys):
    """Issue 36 item 4: `fail` reads RANK and WORLD_SIZE to print; a malformed one raised a ValueError inside the
    error path. It reads them through the one tolerant reader and says the error it was given."""
    monkeypatch.setenv(variable, "abc")
    monkeypatch.setattr(records.time, "sleep", lambda s: None)
    assert fail("environment variable RANK='abc' is not an integer", 1) == 1
    assert capsys.readouterr().err.strip() == "error: environment variable RANK='abc' is not an integer"
    with pytest.raises(RecipeError, match=f"{variable}='abc' is not an integer"):  # the runner's reader says it
        env_number(variable, 0)
    assert env_number("NOT_SET_HERE", 3) == 3


def test_a_refused_run_takes_back_a_folder_that_holds_nothing_but_its_config_lock_and_log(run, tmp_path):
    open_log(run)
    fail("step 1: the loss is not finite", 1)  # every rank's: a restart would meet it again
    assert not run.path.exists()
    kept = RunFolder(tmp_path / "ddp-2", None, "ddp", {}, True)
    kept.path.mkdir()
    open_log(kept)
    write_record(kept, {"kind": "train", "step": 10})
    take_back(refused=True)  # it wrote a record: kept, and its log with it
    close_log()
    assert sorted(p.name for p in kept.path.iterdir()) == ["metrics.jsonl", "train.log"]


def test_a_full_disk_names_the_folder_written_to_never_the_working_directory(run, tmp_path, monkeypatch):
    """Issue 27 item 7: an OSError from a write to an open file carried no name, and the line named the working
    directory's disk; a bytes file name (TensorBoard's) made the error path raise a TypeError."""
    monkeypatch.chdir(tmp_path)
    (run.path / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC, a file the error does not name
    open_log(run)
    with pytest.raises(OSError) as caught:
        write_record(run, {"kind": "train", "step": 1})
    assert caught.value.errno == errno.ENOSPC
    line = os_error_line(caught.value)
    assert re.fullmatch(rf"{re.escape(str(run.path))}: the disk is full \([\d,]+ bytes free\); .*", line)
    close_log()
    nameless = OSError(errno.ENOSPC, "No space left on device")
    assert os_error_line(nameless).startswith(".: the disk is full")  # no run open: the working directory
    open_log(run)
    assert os_error_line(nameless).startswith(f"{run.path}: the disk is full")  # a run: its folder's disk
    tensorboard = OSError(errno.EACCES, "Permission denied", os.fsencode(run.path / "tensorboard" / "events.out"))
    assert os_error_line(tensorboard) == f"{run.path}/tensorboard/events.out: Permission denied; check the folder"


def test_a_sharded_checkpoint_on_a_full_disk_is_the_ranks_oserror_not_a_checkpointexception(run, monkeypatch, group1):
    """DCP's CheckpointException is a BaseException: past every handler, a traceback and 'rank 1 exited with code 1
    without an error message'. save_sharded raises the OSError it holds."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from core import shard_ckpt

    def failing(failures):
        def save(*args, **kwargs):
            raise CheckpointException("save", failures)

        return save

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    state = dict(model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1))
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shard_ckpt.dcp, "save", failing({0: (ValueError("other"), None), 1: (full, None)}))
    with pytest.raises(OSError) as err:
        shard_ckpt.save_sharded(run, **state, progress={"step": 2}, keep=2)
    open_log(run)
    assert err.value is full and os_error_line(err.value).startswith(f"{run.path}: the disk is full")
    monkeypatch.setattr(shard_ckpt.dcp, "save", failing({0: (ValueError("bad"), None)}))
    with pytest.raises(RuntimeError, match="bad"):
        shard_ckpt.save_sharded(run, **state, progress={"step": 2}, keep=2)


def test_say_prints_info_on_stdout_and_the_rest_on_stderr(capsys):
    say(None, "progress")
    say(None, "warning: w", level="WARNING")
    assert capsys.readouterr() == ("progress\n", "warning: w\n")
    assert not records.RUN_LOG  # no run: loguru is not touched


def test_a_signal_that_landed_inside_loguru_still_ends_the_run_in_its_one_line(run, capsys):
    """CI found it: a SIGTERM raised while rank 0 was inside loguru left its handler marked busy; the stop's own
    line then raised loguru's RuntimeError, a traceback and 'rank 0: RuntimeError' as the last line, status 1."""
    open_log(run)
    handler = logger._core.handlers[records.RUN_LOG["id"]]
    handler._lock_acquired.acquired = True  # the state the interrupted emit leaves: loguru refuses every line
    try:
        assert fail("stopped by SIGTERM", 143) == 143
    finally:
        handler._lock_acquired.acquired = False
    assert capsys.readouterr().err == "error: stopped by SIGTERM\n"  # the terminal has it; train.log could not


def test_the_log_format_is_loguru_s(run):
    """The form train.log promises (docs/monitoring.md) is LOG_FORMAT's."""
    open_log(run)
    say(run, "x")
    level, rank, message = logged(run)[0]
    assert (level, rank, message) == ("INFO", "0", "x") and "{extra[rank]}" in records.LOG_FORMAT
    assert Path(run.path / "train.log").stat().st_mode & 0o777 == (run.path / "config.json").stat().st_mode & 0o777


LEAVE = """
import os, signal, sys
from tools.options import leave
def peer_gone():
    raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500")
def interrupted_while_saying():
    try:
        peer_gone()
    except RuntimeError:
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's SIGINT, landing while the error is being said
        raise
leave({"peer": peer_gone, "both": interrupted_while_saying}[sys.argv[1]])
"""


@pytest.mark.fast
@pytest.mark.parametrize("case", ["peer", "both"])
def test_a_collective_whose_peer_left_and_a_ctrl_c_inside_the_error_path_are_one_line_without_a_traceback(case):
    """A rank in a collective when its peer exits (a SIGINT to the job ends rank 0 first) says one line, no
    traceback; a KeyboardInterrupt that lands while an error is said is the interrupted line, status 130."""
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    proc = subprocess.run([sys.executable, "-c", LEAVE, case], capture_output=True, text=True, env=env, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank 1: "), proc.stderr
    assert proc.returncode == 1 if case == "peer" else (proc.returncode == 130 and "interrupted" in lines[0])

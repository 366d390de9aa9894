"""The trackers plug-in (core/plugins/trackers.py): TensorBoard read back by its own reader, W&B offline read back
from the .wandb files it writes.

A "crash" below is a job that logged past its last checkpoint; the resumed job reopens the same run folder
at the checkpoint's step and logs those steps again, with other numbers, so that which ones a reader sees
tells which survived.
"""

import errno
import json
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from core.kernel.job import RecipeError, Training
from core.plugins.trackers import (
    OPENED,
    WANDB_FILE,
    ThreadErrors,
    Trackers,
    Tracking,
    check_trackers,
    close_logs,
    log_record,
    open_logs,
    open_trackers,
)
from tools.options import parse_args

pytestmark = pytest.mark.fast


def train(step: int, loss: float) -> dict:
    return {"kind": "train", "elapsed_s": 1.0, "step": step, "epoch": 0, "lr": 1e-3, "loss": loss, "acc": 0.5}


def evaluation(step: int, val_loss: float) -> dict:
    return {"kind": "eval", "step": step, "epoch": 0, "val_loss": val_loss, "val_acc": 0.9}


SUMMARY = {"kind": "summary", "val_loss": 0.125, "steps": 40, "weights": "runs/x/model.safetensors", "train_loss": None}
RESUME = {"kind": "resume", "checkpoint": "runs/x/ckpt/step-000020", "step": 20, "world_size": 2, "global_batch": 64}


def crashed_then_resumed(run_dir: Path, kinds: list[str]) -> tuple[dict, dict]:
    """A job logs steps 10-30 with a checkpoint at 20 and dies; the resumed one logs 30-40. Returns both states."""
    first = open_trackers(kinds, run_dir=run_dir, config={"lr": 1e-3}, resume_state=None, step=0)
    first.write(train(10, 1.0))
    first.write(train(20, 0.5))
    state = first.state()  # the checkpoint at step 20
    first.write(evaluation(20, 0.75))  # the epoch's evaluation, after the checkpoint
    first.write(train(30, 9.0))  # past the checkpoint: lost with the crash, logged again after the resume
    first.close(failed=True)
    second = open_trackers(kinds, run_dir=run_dir, config={"lr": 1e-3}, resume_state=state, step=20)
    second.write(RESUME)
    second.write(train(30, 0.25))
    second.write(train(40, 0.125))
    second.write(SUMMARY)
    second_state = second.state()
    second.close()
    return state, second_state


# --log-to: parsed and checked when the Config is built.
def test_names_parse_in_order_without_repeats():
    assert check_trackers("") == []
    assert check_trackers("tensorboard") == ["tensorboard"]
    assert check_trackers(" wandb, tensorboard,wandb ") == ["wandb", "tensorboard"]


def test_an_unknown_tracker_is_one_line_when_the_config_is_built():
    with pytest.raises(RecipeError, match=r"--log-to tensorboard,mlflow: no tracker named 'mlflow'") as err:
        Tracking(log_to="tensorboard,mlflow")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_a_missing_package_is_one_line_naming_its_install(monkeypatch, kind):
    monkeypatch.setitem(sys.modules, kind, None)  # import fails, find_spec finds nothing: not installed
    with pytest.raises(RecipeError) as err:
        Tracking(log_to=f"{kind},{'wandb' if kind == 'tensorboard' else 'tensorboard'}")
    assert str(err.value).count("\n") == 0
    assert f"{kind} is not installed; pip install -e '.[{kind}]'" in str(err.value)


def test_both_missing_is_still_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        RecipeError, match=r"tensorboard and wandb are not installed; pip install -e '.\[tensorboard,wandb\]'"
    ):
        check_trackers("tensorboard,wandb")


@dataclass(frozen=True)
class Config(Training, Tracking):
    """A recipe that takes the trackers."""


def test_a_recipe_takes_the_options_from_its_command_line():
    cfg = parse_args(Config, ["--log-to", "tensorboard,wandb", "--wandb-project", "mnist"])[0]
    assert (cfg.log_to, cfg.wandb_project) == ("tensorboard,wandb", "mnist")
    assert parse_args(Config, [])[0].log_to == ""  # off unless asked for
    with pytest.raises(RecipeError, match="--log-to mlflow: no tracker named 'mlflow'"):
        parse_args(Config, ["--log-to", "mlflow"])


def test_a_bad_wandb_project_is_refused_when_the_config_is_built():
    with pytest.raises(RecipeError, match=r"--wandb-project 'team/x': use a W&B project name"):
        Tracking(wandb_project="team/x")


# TensorBoard: event files in RUN/tensorboard, read back by TensorBoard's own reader.
def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(run_dir / "tensorboard"))
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def test_tensorboard_scalars_at_their_steps_continue_after_a_resume(tmp_path):
    crashed_then_resumed(tmp_path, ["tensorboard"])
    logged = scalars(tmp_path)
    # step 30 of the crashed job is purged; the resumed job's 30 and 40 follow the checkpoint's 10 and 20
    assert logged["train/loss"] == [(10, 1.0), (20, 0.5), (30, 0.25), (40, 0.125)]
    assert logged["train/lr"] == [(s, pytest.approx(1e-3)) for s in (10, 20, 30, 40)]
    assert logged["eval/val_loss"] == [(20, 0.75)]  # logged after the checkpoint, at its step: kept
    assert logged["resume/world_size"] == [(20, 2.0)]
    assert logged["summary/val_loss"] == [(40, 0.125)]
    assert "summary/weights" not in logged and "summary/train_loss" not in logged  # not numbers
    assert not any(tag.endswith(("/step", "/elapsed_s", "/kind")) for tag in logged)


def test_tensorboard_needs_no_checkpoint_state(tmp_path):
    first, second = crashed_then_resumed(tmp_path, ["tensorboard"])
    assert first == second == {}


# W&B offline: one run id for the job, kept in the run folder and the checkpoint state.
@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))  # nothing written outside the test's folder
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    run_dir = tmp_path / "ddp-1"
    run_dir.mkdir()
    return run_dir


def wandb_records(path: Path):
    """The protobuf records of a .wandb file: LevelDB's log format (32 KiB blocks of chunks) after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunks = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in a block for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])  # crc32c, length, full/first/middle/last
        if kind == 0:
            break
        chunks, pos = chunks + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def key(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb-core writes a key with a slash as a nested one


def fragments(run_dir: Path) -> list[dict]:
    """Each offline-run folder (one per job that logged), oldest first: its run id, history rows, summary."""
    found = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (path,) = folder.glob("*.wandb")
        ids, rows, summary, config = set(), [], {}, {}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add((record.run.run_id, record.run.project))
                config.update({key(item): json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "history":
                rows.append({key(item): json.loads(item.value_json) for item in record.history.item})
            elif kind == "summary":
                summary.update({key(item): json.loads(item.value_json) for item in record.summary.update})
        found.append({"ids": ids, "rows": rows, "summary": summary, "config": config})
    return found


def test_wandb_offline_one_run_continued_after_a_resume(wandb_offline):
    run_dir = wandb_offline
    first, second = crashed_then_resumed(run_dir, ["wandb"])
    assert first == second == {"wandb_run_id": first["wandb_run_id"], "wandb_project": "torch-dist-recipes"}
    assert json.loads((run_dir / WANDB_FILE).read_text()) == first
    crashed, resumed = fragments(run_dir)  # one per job, both the same run
    assert crashed["ids"] == resumed["ids"] == {(first["wandb_run_id"], "torch-dist-recipes")}
    assert crashed["config"]["lr"] == resumed["config"]["lr"] == 1e-3
    # W&B's step is the optimizer step; the rows of one step (train, eval) are one row
    steps = [(row["_step"], row.get("train/loss"), row.get("eval/val_loss")) for row in crashed["rows"]]
    assert steps == [(10, 1.0, None), (20, 0.5, 0.75), (30, 9.0, None)]
    steps = [(row["_step"], row.get("train/loss")) for row in resumed["rows"]]
    assert steps == [(20, None), (30, 0.25), (40, 0.125)]  # 20: the resume record, at the checkpoint's step
    assert resumed["rows"][0]["resume/world_size"] == 2
    assert resumed["summary"]["summary/val_loss"] == 0.125 and resumed["summary"]["summary/steps"] == 40


def test_wandb_resumes_the_run_folders_id_when_the_checkpoint_has_none(wandb_offline):
    run_dir = wandb_offline
    first = open_trackers(["wandb"], run_dir=run_dir, config={}, resume_state=None, step=0, project="mine")
    state = first.state()
    first.close()
    again = open_trackers(["wandb"], run_dir=run_dir, config={}, resume_state=None, step=20, project="other")
    assert again.state() == state == {"wandb_run_id": state["wandb_run_id"], "wandb_project": "mine"}
    again.close()
    assert [f["ids"] for f in fragments(run_dir)] == [{(state["wandb_run_id"], "mine")}] * 2


def test_wandb_resumes_the_checkpoints_run_in_another_folder(wandb_offline):
    run_dir, elsewhere = wandb_offline, wandb_offline.parent / "ddp-2"  # resumed from ddp-1's checkpoint path
    elsewhere.mkdir()
    first = open_trackers(["wandb"], run_dir=run_dir, config={}, resume_state=None, step=0)
    state = first.state()
    first.close()
    again = open_trackers(["wandb"], run_dir=elsewhere, config={}, resume_state=state, step=20)
    assert again.state() == state
    again.close()
    assert json.loads((elsewhere / WANDB_FILE).read_text()) == state


def test_an_online_resumed_run_keeps_the_rows_wandb_already_has(wandb_offline, monkeypatch):
    import wandb.sdk.wandb_run

    # online, W&B starts a resumed run at the step after its last row (29 here); offline it cannot know (0)
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "starting_step", property(lambda run: 30))
    trackers = open_trackers(["wandb"], run_dir=wandb_offline, config={}, resume_state=None, step=20)
    trackers.write(RESUME)  # step 20: W&B has it already
    trackers.write(train(30, 0.25))
    trackers.close()
    assert [row["_step"] for row in fragments(wandb_offline)[0]["rows"]] == [30]


def test_both_trackers_at_once(wandb_offline):
    run_dir = wandb_offline
    crashed_then_resumed(run_dir, ["tensorboard", "wandb"])
    assert scalars(run_dir)["train/loss"][-1] == (40, 0.125)
    assert fragments(run_dir)[-1]["rows"][-1]["train/loss"] == 0.125


def _checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint of the kernel's format at `step` in RUN/ckpt (what the trackers read of it: its progress)."""
    from core.kernel.store import FORMAT, write_tensors

    path = run_dir / "ckpt" / f"step-{step:06d}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_tensors(path, {"model/w": torch.zeros(2)}, {"format": FORMAT, "progress": json.dumps({"step": step})})
    return path


def test_a_tracker_that_cannot_open_on_resume_refuses_the_run_before_it_writes_a_record(tmp_path):
    """Issue 27 item 7: an unwritable RUN/tensorboard refused the resumed run after it had appended its `resume`
    record to metrics.jsonl. The plug-in opens the trackers where the run folder is chosen (the before_job seam,
    before load_checkpoint writes that record): refused there, metrics.jsonl is as it was; one line names the folder."""
    from core.kernel.job import RunFolder, os_error_line, write_record

    checkpoint = _checkpoint(tmp_path, 4)
    run = RunFolder(tmp_path, checkpoint, "ddp_amp", {}, True)
    write_record(run, train(4, 0.5))
    before = (tmp_path / "metrics.jsonl").read_bytes()
    (tmp_path / "tensorboard").write_text("not a folder")
    with pytest.raises(OSError) as caught:
        open_logs(Tracking(log_to="tensorboard"), run)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before and "trackers" not in OPENED
    assert os_error_line(caught.value).startswith(f"{tmp_path / 'tensorboard'}: ")


def test_the_plug_in_logs_the_runs_records_from_the_checkpoints_step_and_closes_with_the_summary(tmp_path):
    """At the kernel's seams: the records write_record writes go to the trackers (rank 0), a resumed run's from its
    checkpoint's step on (TensorBoard purges the crashed job's later steps), and the summary closes them."""
    from core.kernel.job import RunFolder, write_record

    first = RunFolder(tmp_path, None, "ddp_amp", {}, True)
    open_logs(Tracking(log_to="tensorboard"), first)
    for record in (train(10, 1.0), train(20, 0.5), train(30, 9.0)):
        write_record(first, record)
    close_logs(refused=False)  # the job dies after step 30: SEAMS["on_fail"]
    assert "trackers" not in OPENED
    resumed = RunFolder(tmp_path, _checkpoint(tmp_path, 20), "ddp_amp", {}, True)
    open_logs(Tracking(log_to="tensorboard"), resumed)
    for record in (RESUME, train(30, 0.25), SUMMARY):
        write_record(resumed, record)
    assert "trackers" not in OPENED  # the summary closed them
    assert scalars(tmp_path)["train/loss"] == [(10, 1.0), (20, 0.5), (30, 0.25)]
    assert scalars(tmp_path)["summary/val_loss"] == [(40, 0.125)]


def test_a_run_without_log_to_opens_nothing_and_a_writer_alone_opens(tmp_path):
    """Tests import several recipes in one process: a recipe whose Config has no --log-to opens no tracker, and a
    rank other than 0 never does."""
    from core.kernel.job import RunFolder, Training

    open_logs(Training(), RunFolder(tmp_path, None, "ddp", {}, True))
    open_logs(Tracking(log_to="tensorboard"), RunFolder(tmp_path, None, "ddp_amp", {}, False))
    assert "trackers" not in OPENED and not (tmp_path / "tensorboard").exists()
    log_record(None, train(1, 0.5))  # nothing open: nothing to do


def test_a_resumed_run_continues_the_wandb_run_its_checkpoints_folder_was_logged_to(wandb_offline):
    """The W&B run id lives in RUN/wandb-run.json: a run resumed from another folder's checkpoint continues it."""
    from core.kernel.job import RunFolder

    first = open_trackers(["wandb"], run_dir=wandb_offline, config={}, resume_state=None, step=0)
    state = first.state()
    first.close()
    elsewhere = wandb_offline.parent / "ddp-2"
    elsewhere.mkdir()
    resumed = RunFolder(elsewhere, _checkpoint(wandb_offline, 20), "ddp_amp", {}, True)
    open_logs(Tracking(log_to="wandb"), resumed)
    assert OPENED["trackers"].state() == state
    close_logs(refused=False)
    assert json.loads((elsewhere / WANDB_FILE).read_text()) == state


def test_wandb_leaves_no_folder_in_tmpdir(wandb_offline):
    """wandb makes two folders in TMPDIR when imported; the recipes end with os._exit, past the finalizers that
    would remove them: closing the trackers does."""
    from wandb.sdk.artifacts.artifact import Artifact
    from wandb.sdk.data_types import _private

    trackers = open_trackers(["wandb"], run_dir=wandb_offline, config={}, resume_state=None, step=0)
    made = [Path(_private.MEDIA_TMP.name), Path(Artifact._TMP_DIR.name)]  # made at import: in the test's TMPDIR
    trackers.close()
    assert not any(folder.exists() for folder in made)
    again = open_trackers(["wandb"], run_dir=wandb_offline, config={}, resume_state=None, step=0)
    again.write(train(1, 0.5))  # W&B still logs scalars in this process
    again.close()


# Issue 36 item 4: an error in a tracker's own thread is the run's one `error:` line, not `Exception in thread`.
@pytest.fixture
def failing_writer(monkeypatch, tmp_path):
    """TensorBoard's writer thread fails as on an unwritable RUN/tensorboard (which a root user cannot make): its
    first write raises; threading's hook is put back after the test whatever the trackers did with it."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # Python's (pytest's would keep it quiet)

    def denied(self, data):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "tensorboard" / "events.out"))

    return lambda: monkeypatch.setattr(RecordWriter, "write", denied)


def test_tensorboards_writer_thread_failing_at_open_is_said_once_by_the_run(failing_writer, tmp_path, capfd):
    hook = threading.excepthook
    failing_writer()
    with pytest.raises(PermissionError) as caught:
        open_trackers(["tensorboard"], run_dir=tmp_path, config={}, resume_state=None, step=4)
    assert caught.value.filename == str(tmp_path / "tensorboard" / "events.out")
    err = capfd.readouterr().err
    assert "Exception in thread" not in err and "Traceback" not in err, err
    assert threading.excepthook is hook  # the trackers' hook lasts while they are open


def test_an_unwritable_tensorboard_folder_is_refused_before_its_writer_starts(monkeypatch, tmp_path):
    """The issue's case (RUN/tensorboard not writable, which chmod cannot make for root): found by the main thread,
    naming the folder, before TensorBoard's writer thread exists."""
    import core.plugins.trackers

    def denied(dir):
        raise PermissionError(errno.EACCES, "Permission denied", str(Path(dir) / "tmpabc"))

    monkeypatch.setattr(core.plugins.trackers.tempfile, "TemporaryFile", denied)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    threads = threading.active_count()
    with pytest.raises(PermissionError) as caught:
        open_trackers(["tensorboard"], run_dir=tmp_path, config={}, resume_state=None, step=4)
    assert caught.value.filename == str(tmp_path / "tensorboard") and threading.active_count() == threads
    assert threading.excepthook is threading.__excepthook__


def test_tensorboards_writer_thread_failing_mid_run_is_said_once_by_the_run(failing_writer, tmp_path, capfd):
    trackers = open_trackers(["tensorboard"], run_dir=tmp_path, config={}, resume_state=None, step=0)
    failing_writer()  # a disk that fills, a folder whose permissions change: the writer thread meets it
    with pytest.raises(PermissionError):
        trackers.write(train(1, 0.5))
    err = capfd.readouterr().err
    assert "Exception in thread" not in err and "Traceback" not in err, err


def test_a_run_whose_tensorboard_writer_fails_ends_in_one_error_line(failing_writer, tmp_path, capfd):
    from tools.cli import run_cli

    failing_writer()
    args = ["run", "ddp_amp", "--max-steps", "1", "--log-to", "tensorboard", "--out", str(tmp_path)]
    assert run_cli(args) == 1
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Permission denied" in lines[-1], lines
    assert not any("Exception in thread" in line or "Traceback" in line for line in lines), lines


def test_an_error_in_a_wandb_thread_is_one_line_and_other_threads_keep_their_hook(monkeypatch):
    said = []
    monkeypatch.setattr(threading, "excepthook", said.append)  # the hook before the trackers': other threads'
    space = {"__name__": "wandb.sdk.lib.service"}  # code of W&B's package, as its threads run it
    exec("def background():\n    raise RuntimeError('the service\\nstopped')", space)

    def theirs():
        raise ValueError("not a tracker's")

    trackers = Trackers(caught=ThreadErrors())
    for target in (space["background"], theirs):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert [type(args.exc_value) for args in said] == [ValueError]
    with pytest.raises(RecipeError, match=r"^--log-to wandb: its background thread failed \(RuntimeError: the "):
        trackers.write(train(1, 0.5))
    trackers.write(train(2, 0.5))  # said once
    trackers.close()
    assert threading.excepthook == said.append

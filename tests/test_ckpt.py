"""Checkpoints: round trips, atomic writes, exact resume, restarts after SIGKILL, bad files."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from core.kernel.job import RunFolder
from core.kernel.replica import load_checkpoint, save_checkpoint
from core.kernel.store import newest_good, read_checkpoint, write_weights
from helpers import REPO, checkpoints, run, torchrun, unfinished, user_env
from tiny import TiedMLP

TESTS = str(Path(__file__).parent)
PATHS = os.pathsep.join([str(REPO), TESTS])  # this checkout's core/, not the installed one
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)  # () is 0-d; a 0 is empty


def _run(folder, resume_from=None) -> RunFolder:
    """A run folder as open_run returns it, for a world of one."""
    return RunFolder(Path(folder), resume_from, "ddp", {"global_batch": 8, "model": "tiny", "world_size": 1}, True)


def _random(dtype, shape, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(2, shape, generator=gen).bool()
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=gen)
    return torch.randn(shape, generator=gen).to(dtype)


class Holder(torch.nn.Module):
    """A module whose state dict is whatever tensors we give it, some sharing storage."""

    def __init__(self, tensors, shared_with):
        super().__init__()
        for i, t in enumerate(tensors):
            self.register_buffer(f"t{i}", t)
        for i, j in shared_with:
            self.register_buffer(f"alias{i}", getattr(self, f"t{j}"))


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.tuples(st.sampled_from(DTYPES), SHAPES), min_size=1, max_size=5),
    seed=st.integers(0, 1000),
    share=st.booleans(),
)
def test_weights_round_trip_bitwise(tmp_path_factory, specs, seed, share):
    tensors = [_random(dtype, shape, seed + i) for i, (dtype, shape) in enumerate(specs)]
    holder = Holder(tensors, [(0, 0)] if share else [])
    path = write_weights(_run(tmp_path_factory.mktemp("rt")), holder.state_dict())
    loaded = load_file(path)
    assert loaded.keys() == holder.state_dict().keys()
    for key, value in holder.state_dict().items():
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape
        assert torch.equal(
            loaded[key].view(-1).view(torch.uint8) if value.numel() else loaded[key],
            value.reshape(-1).view(torch.uint8) if value.numel() else value,
        ), key


def test_tied_weights_load_into_the_plain_model(tmp_path):
    model = TiedMLP()
    write_weights(_run(tmp_path), model.state_dict())
    fresh = TiedMLP()
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"))
    assert torch.equal(fresh.encode.weight, model.encode.weight) and fresh.decode.weight is fresh.encode.weight


def _train_state(seed=0):
    torch.manual_seed(seed)
    model = TiedMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 64)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def test_train_state_round_trips_in_a_world_of_one(tmp_path, group1):
    model, optimizer, scheduler = _train_state()
    progress = {"epoch": 1, "samples": 4, "step": 3, "skipped": 0, "window": {"loss_sum": 2.5, "count": 3.0}}
    path = save_checkpoint(
        _run(tmp_path), model=model, optimizer=optimizer, scheduler=scheduler, progress=progress, keep=2
    )
    expected_rng = torch.rand(3)  # what the generator gives right after the save
    other_model, other_optimizer, other_scheduler = _train_state(seed=1)
    restored = load_checkpoint(
        _run(tmp_path, path), model=other_model, optimizer=other_optimizer, scheduler=other_scheduler
    )
    assert restored == progress
    assert torch.equal(torch.rand(3), expected_rng), "the RNG continues where it was"
    for a, b in zip(model.state_dict().values(), other_model.state_dict().values()):
        assert torch.equal(a, b)
    saved, restored = optimizer.state_dict(), other_optimizer.state_dict()
    assert saved["param_groups"] == restored["param_groups"]
    for index, state in saved["state"].items():
        assert state.keys() == restored["state"][index].keys()
        assert all(torch.equal(state[k], restored["state"][index][k]) for k in state)
    assert scheduler.state_dict() == other_scheduler.state_dict()
    header = json.loads(json.dumps(read_checkpoint(path)[1]))
    assert header["world_size"] == "1" and header["torch"] == torch.__version__


def test_keep_prunes_old_checkpoints_only_after_writing(tmp_path, group1):
    model, optimizer, scheduler = _train_state()
    for step in range(1, 6):
        progress = {"epoch": 0, "samples": step, "step": step}
        state = dict(model=model, optimizer=optimizer, scheduler=scheduler)
        save_checkpoint(_run(tmp_path), **state, keep=2, progress=progress)
    assert [p.name for p in checkpoints(tmp_path / "ckpt")] == [
        "step-000004.safetensors",
        "step-000005.safetensors",
    ]


KILL_IN_RENAME = """
import os, signal, sys, torch
sys.path[:0] = [{tests!r}]
from pathlib import Path
from core.kernel.job import RunFolder
from core.kernel.replica import save_checkpoint
from tiny import TiedMLP
torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
model = TiedMLP(); optimizer = torch.optim.AdamW(model.parameters())
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
run = RunFolder(Path({folder!r}), None, "ddp", {{"global_batch": 8}}, True)
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # die between the write and the rename
progress = {{"epoch": 0, "samples": 9, "step": 9}}
save_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler, keep=2, progress=progress)
"""


def test_writer_killed_before_rename_leaves_the_last_checkpoint(tmp_path, group1):
    run_dir = tmp_path / "ddp-1"
    run_dir.mkdir()  # as open_run makes it
    model, optimizer, scheduler = _train_state()
    progress = {"epoch": 0, "samples": 5, "step": 5}
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler)
    good = save_checkpoint(_run(run_dir), **state, progress=progress, keep=2)
    proc = subprocess.run(
        [sys.executable, "-c", KILL_IN_RENAME.format(tests=TESTS, folder=str(run_dir))],
        cwd=REPO,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL
    assert any(p.name.startswith(".step-000009") for p in (run_dir / "ckpt").iterdir()), "the half-done write"
    assert newest_good(run_dir) == good
    read_checkpoint(good)  # whole and readable


def _recipe(*args, nproc=2, cwd, timeout=180, check=True, env=None):
    command = torchrun("-m", "recipes", "run", *args, nproc=nproc)
    return run(command, cwd=cwd, timeout=timeout, check=check, env=env or user_env(PYTHONPATH=PATHS))


def _weights(path):
    return load_file(path)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One 2-rank ddp run of 30 steps (over an epoch boundary: 22 steps an epoch) with a checkpoint every step."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _recipe(
        "ddp",
        "--model",
        "tiny:mlp",
        "--max-steps",
        "30",
        "--ckpt-every",
        "1",
        "--keep",
        "100",
        "--out",
        str(out),
        cwd=out,
    )
    return out / "ddp-1"


STOPS = [1, 22, 29]  # the first step, an epoch's last, and inside the last log window


@pytest.fixture(scope="module")
def resumed(finished_run, tmp_path_factory):
    """stop -> the folder of `python -m recipes run ddp --resume CKPT` from step `stop`'s checkpoint, moved out of the
    run (the resumed run gets its own folder), and the launch's output: the three resumes, one after another in one
    launch (tests/copy_jobs.py: one process group, the imports paid once)."""
    out = tmp_path_factory.mktemp("resumed")
    jobs = []
    for stop in STOPS:
        moved = out / f"step-{stop:06d}.safetensors"
        moved.write_bytes((finished_run / "ckpt" / moved.name).read_bytes())
        args = ["--model", "tiny:mlp", "--max-steps", "30", "--resume", str(moved), "--out", str(out / str(stop))]
        jobs.append({"label": str(stop), "recipe": "ddp", "args": args})
    (out / "jobs.json").write_text(json.dumps(jobs))
    launch = torchrun(str(REPO / "tests" / "copy_jobs.py"), str(out / "jobs.json"))
    proc = run(launch, cwd=out, timeout=300, check=False, env=user_env(PYTHONPATH=PATHS))
    return {stop: out / str(stop) for stop in STOPS}, f"--stdout--\n{proc.stdout}\n--stderr--\n{proc.stderr[-5000:]}"


@pytest.mark.parametrize("stop", STOPS)
def test_resume_from_any_step_is_bitwise_exact(finished_run, resumed, stop):
    folders, output = resumed
    assert f"job {stop} exit 0 rank 0" in output and f"job {stop} exit 0 rank 1" in output, output
    tmp_path = folders[stop]
    assert _same(_weights(tmp_path / "ddp-1" / "model.safetensors"), _weights(finished_run / "model.safetensors"))
    # A review find: the log window open at the checkpoint was lost, so the first record after a resume (and the
    # summary's train_loss, when the last window was the split one) averaged fewer steps. The checkpoint keeps it.
    resume = [r for r in map(json.loads, (tmp_path / "ddp-1" / "metrics.jsonl").read_text().splitlines())]
    assert [r for r in resume if r["kind"] == "resume" and "window" not in r]  # the meter's sums, not a record's
    resumed, whole = _train_records(tmp_path / "ddp-1"), _train_records(finished_run)
    assert resumed and all(numbers == pytest.approx(whole[step], rel=1e-9) for step, numbers in resumed.items())


def _train_records(run_dir: Path) -> dict[int, tuple]:
    """step -> (loss, acc) of every train record, and the summary's train_loss under step 0."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    found = {r["step"]: (r["loss"], r["acc"]) for r in records if r["kind"] == "train"}
    return found | {0: tuple(r["train_loss"] for r in records if r["kind"] == "summary")}


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _bad(path: Path, kind: str, source: Path) -> Path:
    data = source.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "corrupted":
        path.write_bytes(b"\xff" * 16 + data[16:])
    elif kind == "pickle":
        torch.save({"weights": torch.zeros(3)}, path)
    elif kind == "plain weights":
        save_file({"x": torch.zeros(3)}, str(path))
    return path


@pytest.mark.parametrize(
    "kind,words",
    [
        ("truncated", "truncated or corrupted"),
        ("corrupted", "truncated or corrupted"),
        ("pickle", "a pickle (torch.save) file"),
        ("plain weights", "not a checkpoint of this project"),
    ],
)
def test_bad_checkpoint_file_is_one_line_and_nothing_is_overwritten(finished_run, tmp_path, kind, words):
    before = _digest(finished_run)
    bad = _bad(tmp_path / "bad.safetensors", kind, finished_run / "ckpt" / "step-000030.safetensors")
    proc = run(
        [
            sys.executable,
            "-m",
            "recipes",
            "run",
            "ddp",
            "--model",
            "tiny:mlp",
            "--resume",
            str(bad),
            "--out",
            str(tmp_path),
        ],
        cwd=tmp_path,
        check=False,
        env=user_env(PYTHONPATH=PATHS),
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and words in proc.stderr
    assert _digest(finished_run) == before and not (tmp_path / "ddp-1").exists()


def _stopped_copy(finished_run: Path, tmp_path: Path) -> Path:
    """A copy of the shared run as if its job had died before the end (a finished run, resumed, checks nothing)."""
    return unfinished(Path(shutil.copytree(finished_run, tmp_path / "stopped" / finished_run.name)))


def test_checkpoint_of_another_model_names_the_keys(finished_run, tmp_path):
    stopped = _stopped_copy(finished_run, tmp_path)
    before = _digest(stopped)
    proc = run(
        [
            str(REPO / "launch_single_node.sh"),
            "ddp",
            "--model",
            "mlp",
            "--resume",
            str(stopped / "ckpt" / "step-000030.safetensors"),
        ],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "holds another model" in line and "Traceback" not in proc.stderr
    assert "missing keys: blocks.2.0.bias" in line and "unexpected keys: blocks.2.bias" in line
    assert "shape mismatches: blocks.0.0.bias (32,) vs (1024,)" in line
    assert _digest(stopped) == before


def test_checkpoint_of_another_global_batch_is_refused(finished_run, tmp_path):
    stopped = _stopped_copy(finished_run, tmp_path)
    proc = run(
        [
            sys.executable,
            "-m",
            "recipes",
            "run",
            "ddp",
            "--model",
            "tiny:mlp",
            "--resume",
            str(stopped / "ckpt" / "step-000010.safetensors"),
        ],
        cwd=tmp_path,
        check=False,
        env=user_env(PYTHONPATH=PATHS),
    )
    assert proc.returncode != 0 and "saved with global batch" in proc.stderr and "--batch-size" in proc.stderr


def _worker_pids(launcher_pid: int) -> list[int]:
    """The recipe processes under a torchrun started by our launcher (its grandchildren or children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if (
                b"recipes" in cmdline
                and b"LOCAL_RANK=1" in environ.split(b"\0")
                and f"TDR_TEST_JOB={launcher_pid}".encode() in environ.split(b"\0")
            ):
                found.append(int(entry.name))
    return found


def test_sigkill_of_a_worker_restarts_and_finishes_with_the_same_weights(finished_run, tmp_path):
    """MAX_RESTARTS=1: torchrun restarts the group, which resumes from the newest checkpoint by itself."""
    marker = str(os.getpid())
    env = user_env(PYTHONPATH=PATHS, MAX_RESTARTS="1", NPROC_PER_NODE="2", TDR_TEST_JOB=marker)
    job = subprocess.Popen(
        [
            str(REPO / "launch_single_node.sh"),
            "ddp",
            "--model",
            "tiny:mlp",
            "--max-steps",
            "30",
            "--ckpt-every",
            "1",
            "--keep",
            "3",
            "--log-every",
            "1",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ckpt_dir, killed, deadline = tmp_path / "runs" / "ddp-1" / "ckpt", False, time.monotonic() + 120
    while not killed and job.poll() is None and time.monotonic() < deadline:
        if checkpoints(ckpt_dir):  # training is under way: kill rank 1 mid-run
            for pid in _worker_pids(int(marker)):
                os.kill(pid, signal.SIGKILL)
                killed = True
        time.sleep(0.01)  # polling the test's own subprocess, not synchronising the recipe
    stdout, stderr = job.communicate(timeout=180)
    assert killed, "the job finished before a worker could be killed"
    assert job.returncode == 0, stderr
    assert "resumed from" in stdout + stderr  # Run prints its progress to stdout
    assert _same(
        _weights(tmp_path / "runs" / "ddp-1" / "model.safetensors"), _weights(finished_run / "model.safetensors")
    )

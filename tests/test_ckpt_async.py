"""Asynchronous checkpoints (core/ckpt_async.py, ddp_monitored's --ckpt-async): the same file as a synchronous
save, the step waiting only for the copy to host memory, one write in flight, a failed write named by its own
step on every rank, the run's end waiting for the last write, and --ckpt-async refused by the recipes without it."""

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core import ckpt_async
from core.kernel.job import RecipeError, RunFolder
from core.kernel.replica import save_checkpoint
from core.kernel.store import read_checkpoint
from core.plugins.lock import HELD
from helpers import checkpoints, unfinished
from recipes import ddp_monitored
from tiny import TiedMLP
from tools.cli import _explained
from tools.options import UsageError, parse_args
from tools.registry import RECIPES
from world import GlooWorld


def _train_state(seed=0, steps=3) -> dict:
    """What a checkpoint holds: the model, the optimizer and the scheduler, after a few steps."""
    torch.manual_seed(seed)
    model = TiedMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 64)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    return dict(model=model, optimizer=optimizer, scheduler=scheduler)


def _progress(step):
    return {"epoch": 0, "samples": 8 * step, "step": step, "skipped": 0}


def _run(path, *, writer=True) -> RunFolder:
    """A run folder, made as open_run makes it (a file in its place stays: a write there fails)."""
    config = {"recipe": "ddp_monitored", "world_size": 1, "global_batch": 8, "lr": 0.01}
    if not Path(path).exists():
        Path(path).mkdir(parents=True, exist_ok=True)
    return RunFolder(Path(path), None, "ddp_monitored", config, writer)


@pytest.mark.fast
def test_async_save_writes_the_same_bytes_and_snapshots_before_returning(tmp_path, group1):
    state = _train_state()
    model, optimizer = state["model"], state["optimizer"]
    sync_path = save_checkpoint(_run(tmp_path / "sync"), **state, progress=_progress(5), keep=2)
    saver, run = ckpt_async.CheckpointSaver(background=True), _run(tmp_path / "async")
    async_path = saver.save(run, **state, progress=_progress(5), keep=2)
    with torch.no_grad():  # training goes on while the file is written: the file keeps the state of the save
        model.hidden.weight.add_(1.0)
    optimizer.state[model.hidden.weight]["exp_avg"].add_(1.0)
    saver.save(run, **state, progress=_progress(6), keep=2)  # waits for step 5's write first
    saver.wait()
    assert async_path.read_bytes() == sync_path.read_bytes()
    assert [p.name for p in checkpoints(tmp_path / "async" / "ckpt")] == [
        async_path.name,
        "step-000006.safetensors",
    ]


@pytest.mark.fast
def test_the_step_waits_for_the_copy_only_and_reuses_the_host_buffers(tmp_path, monkeypatch, group1):
    """The write is held back until the test lets it go: save() has returned by then, and the next save waits."""
    release, writers, real_write = threading.Event(), [], ckpt_async.write_tensors

    def held_write(path, tensors, metadata):
        writers.append(threading.current_thread())
        assert release.wait(timeout=60)
        real_write(path, tensors, metadata)

    monkeypatch.setattr(ckpt_async, "write_tensors", held_write)
    state = _train_state()
    model = state["model"]
    saver, run = ckpt_async.CheckpointSaver(background=True), _run(tmp_path)
    path = saver.save(run, **state, progress=_progress(1), keep=2)
    buffers = {key: buffer.data_ptr() for key, buffer in saver.buffers.items()}
    assert saver.thread.is_alive() and not path.exists()  # the step goes on while the file is being written
    for _ in range(6000):  # the thread reaches the write
        if writers:
            break
        threading.Event().wait(0.01)
    assert writers[0] is not threading.main_thread()
    release.set()
    saver.save(run, **state, progress=_progress(2), keep=2)
    assert path.exists()  # the second save waited for the first write
    assert {key: buffer.data_ptr() for key, buffer in saver.buffers.items()} == buffers  # the same host memory
    saver.wait()  # the second write (let through) lands before the third is held back
    release.clear()
    saver.save(run, **state, progress=_progress(3), keep=2)
    closing = threading.Thread(target=saver.wait)
    closing.start()
    closing.join(timeout=0.5)
    assert closing.is_alive()  # the run's end waits for the write in flight
    release.set()
    closing.join()
    tensors, _ = read_checkpoint(run.path / "ckpt" / "step-000003.safetensors")  # whole, checksums hold
    torch.testing.assert_close(tensors["model/hidden.weight"], model.hidden.weight, rtol=0, atol=0)


@pytest.mark.fast
def test_a_failed_background_write_is_named_by_its_own_step(tmp_path, group1):
    (tmp_path / "file").write_text("not a folder")
    state = _train_state()
    saver, run = ckpt_async.CheckpointSaver(background=True), _run(tmp_path / "file")
    saver.save(run, **state, progress=_progress(2), keep=2)  # fails in the background
    with pytest.raises(RecipeError) as failed:
        saver.save(run, **state, progress=_progress(4), keep=2)  # said before step 4's
    message = str(failed.value)
    assert "step-000002.safetensors" in message and "step 2" in message and "\n" not in message
    assert "step 4" not in message and "--resume auto" in message
    saver.save(run, **state, progress=_progress(6), keep=2)
    with pytest.raises(RecipeError, match="step 6"):  # the run's end: the last write's failure, one line
        saver.wait()
    saver.wait()  # said once


def _save_in_world(topo, folder, background):
    state = _train_state(seed=0)
    torch.manual_seed(100 + topo.rank)  # each rank's generator differs: the checkpoint holds both
    run = _run(folder, writer=topo.rank == 0)._replace(config={**_run(folder).config, "world_size": 2})
    if background:
        saver = ckpt_async.CheckpointSaver(background=True)
        saver.save(run, **state, progress=_progress(7), keep=2)
        saver.wait()
    else:
        save_checkpoint(run, **state, progress=_progress(7), keep=2)
    return torch.rand(1).item()


def _fail_in_world(topo, path):
    """Rank 0's write fails (its run folder is a file); every rank hears it at the run's end, none waits."""
    saver = ckpt_async.CheckpointSaver(background=True)
    saver.save(_run(path, writer=topo.rank == 0), **_train_state(), progress=_progress(3), keep=2)
    try:
        saver.wait()
    except RecipeError as err:
        return str(err)
    return "no error"


@pytest.fixture(scope="module")
def world2():
    with GlooWorld(2) as world:
        yield world


@pytest.mark.world
def test_async_equals_sync_in_a_world_of_two_and_a_failure_reaches_every_rank(world2, tmp_path):
    draws_sync = world2.run(_save_in_world, str(tmp_path / "sync"), False)
    draws_async = world2.run(_save_in_world, str(tmp_path / "async"), True)
    name = "ckpt/step-000007.safetensors"
    assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "async" / name).read_bytes()
    assert draws_sync == draws_async and draws_sync[0] != draws_sync[1]  # the gather left each generator alone
    (tmp_path / "file").write_text("not a folder")
    said = world2.run(_fail_in_world, str(tmp_path / "file"))
    assert said[0] == said[1] and "step 3" in said[0], said


def _train_monitored(topo, cfg):
    """The recipe's train, its background writes slowed down: returns its summary and the writes still in flight."""
    real_write, writes = ckpt_async.write_tensors, {"started": 0, "done": 0}

    def slow_write(*args, **kwargs):
        writes["started"] += 1
        threading.Event().wait(0.5)  # a slow disk: the run's end must wait for this write
        real_write(*args, **kwargs)
        writes["done"] += 1

    ckpt_async.write_tensors = slow_write
    try:
        summary = ddp_monitored.train(cfg, topo)
    finally:
        ckpt_async.write_tensors = real_write
        for handle in HELD:  # the run folder's lock, held for a process's life: the next train is another job
            handle.close()
        HELD.clear()
    return summary, writes["started"] - writes["done"]


@pytest.mark.world
def test_the_recipe_with_ckpt_async_resumes_bitwise_and_ends_after_its_last_write(world2, tmp_path):
    cfg = ddp_monitored.Config(
        model="tiny:mlp",
        max_steps=8,
        ckpt_every=4,
        keep=3,
        log_every=4,
        hang_factor=0,
        ckpt_async=True,
        out=str(tmp_path),
    )
    (_, in_flight), _ = world2.run(_train_monitored, cfg)
    assert in_flight == 0  # train returned after its last write
    run_dir = tmp_path / "ddp_monitored-1"
    saved = checkpoints(run_dir / "ckpt")
    assert [p.name for p in saved] == ["step-000004.safetensors", "step-000008.safetensors"]
    _, meta = read_checkpoint(saved[-1])  # the run's last write had landed, whole, when train returned
    assert json.loads(meta["progress"])["step"] == 8
    uninterrupted = load_file(run_dir / "model.safetensors")
    unfinished(run_dir)  # as if the job had died after step 4: a finished run, resumed, trains nothing
    (summary, _), _ = world2.run(_train_monitored, replace(cfg, resume=str(saved[0])))  # steps 5 to 8, from step 4
    assert summary["steps"] == 8
    for key, value in load_file(run_dir / "model.safetensors").items():
        assert torch.equal(value, uninterrupted[key]), key


@pytest.mark.fast
@pytest.mark.parametrize("name", ["ddp", "ddp_amp", "dp"])
def test_recipes_without_async_saves_refuse_the_option_naming_the_one_that_takes_it(name):
    config = RECIPES[name].load().Config
    with pytest.raises(UsageError) as refused:
        parse_args(config, ["--ckpt-async"])
    assert str(_explained(refused.value, name, config)) == f"--ckpt-async: {name} does not take it; ddp_monitored does"
    assert parse_args(ddp_monitored.Config, ["--ckpt-async"])[0].ckpt_async is True

"""core/shard_ckpt.py: sharded checkpoints of fully_shard, tensor-parallel, 2-D and pipeline-stage models (what
tests/test_dcp.py asks of core.dcp, asked of the kernel-file layout: RUN/ckpt/step-N/ shards, step-N.safetensors).

A run that saves at step K and continues from the loaded checkpoint in a freshly built model and optimizer must end
with the weights and optimizer state of the run that never stopped, bit for bit, at the same world size; at another
world size within float rounding (the gradient sums run in another order).
"""

from pathlib import Path

import pytest
import test_dcp
import torch
from test_dcp import GLOBAL_BATCH, _assert_bitwise, _build, _full, _root, _shares, _step

from core.ckpt_io import list_checkpoints
from core.kernel.job import RecipeError, RunFolder
from core.kernel.store import newest_good, read_checkpoint
from core.shard_ckpt import load_sharded, save_sharded
from world import GlooWorld

pytestmark = pytest.mark.world
world2, world1 = test_dcp.world2, test_dcp.world1  # the module's gloo worlds


def _run(folder, resume_from=None, *, recipe: str = "fsdp") -> RunFolder:
    """A run folder as the kernel's open_run returns it: its checkpoints in folder/ckpt, rank 0 the writer."""
    config = {"global_batch": GLOBAL_BATCH, "world_size": torch.distributed.get_world_size()}
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    return RunFolder(path, resume_from and Path(resume_from), recipe, config, torch.distributed.get_rank() == 0)


def train_save_resume(topo, kind: str, run_dir: str, *, stop: int, total: int) -> dict:
    """The run that never stops, and one that saves at `stop` and continues in a new model."""
    shares = _shares(kind, topo)
    model, optimizer, scheduler = _build(kind, topo.world_size)
    for step in range(total):
        _step(kind, model, optimizer, scheduler, step, shares=shares)
        if step + 1 == stop:
            rng = torch.get_rng_state()
            progress = {"epoch": 0, "samples": stop * GLOBAL_BATCH, "step": stop}
            state = dict(model=_root(model), optimizer=optimizer, scheduler=scheduler)
            path = save_sharded(_run(run_dir, recipe=kind), **state, progress=progress, keep=2)
            torch.manual_seed(1234)  # the load must put the generator back
    never_stopped = _full(model, optimizer)
    model, optimizer, scheduler = _build(kind, topo.world_size)
    resumed = _run(run_dir, path, recipe=kind)
    progress = load_sharded(resumed, model=_root(model), optimizer=optimizer, scheduler=scheduler)
    assert torch.equal(torch.get_rng_state(), rng)
    for step in range(progress["step"], total):
        _step(kind, model, optimizer, scheduler, step, shares=shares)
    return {"path": str(path), "progress": progress, "never_stopped": never_stopped, "resumed": _full(model, optimizer)}


@pytest.mark.parametrize("kind", ["fsdp", "tp", "fsdp_tp"])
def test_resume_is_bitwise(world2, tmp_path, kind):
    results = world2.run(train_save_resume, kind, str(tmp_path), stop=2, total=4)
    assert results[0]["progress"]["step"] == 2 and results[0]["progress"]["samples"] == 16
    for result in results:
        _assert_bitwise(result["never_stopped"], result["resumed"])
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["step-000002.safetensors"]
    assert read_checkpoint(tmp_path / "ckpt" / "step-000002.safetensors", tensors=False)[1]["world_size"] == "2"


@pytest.mark.parametrize("kind", ["pipeline", "interleaved"])
def test_pipeline_stages_resume_bitwise(world2, tmp_path, kind):
    """Each rank holds plain tensors of its own blocks (one stage, or a list of two)."""
    first, second = world2.run(train_save_resume, kind, str(tmp_path), stop=2, total=4)
    _assert_bitwise(first["never_stopped"], first["resumed"])
    _assert_bitwise(second["never_stopped"], second["resumed"])
    assert first["never_stopped"].keys().isdisjoint(second["never_stopped"].keys())


def save_then_continue(topo, run_dir: str, *, stop: int, total: int) -> dict:
    shares = _shares("fsdp", topo)
    model, optimizer, scheduler = _build("fsdp", topo.world_size, lr=1e-3)
    for step in range(stop):
        _step("fsdp", model, optimizer, scheduler, step, shares=shares)
    progress = {"epoch": 0, "samples": stop * GLOBAL_BATCH, "step": stop}
    save_sharded(_run(run_dir), model=model, optimizer=optimizer, scheduler=scheduler, keep=1, progress=progress)
    at_save = _full(model, optimizer)
    for step in range(stop, total):
        _step("fsdp", model, optimizer, scheduler, step, shares=shares)
    return {"at_save": at_save, "end": _full(model, optimizer)}


def load_and_continue(topo, path: str, *, total: int) -> dict:
    shares = _shares("fsdp", topo)
    model, optimizer, scheduler = _build("fsdp", topo.world_size, lr=1e-3)
    progress = load_sharded(_run(Path(path).parent.parent, path), model=model, optimizer=optimizer, scheduler=scheduler)
    loaded = _full(model, optimizer)
    for step in range(progress["step"], total):
        _step("fsdp", model, optimizer, scheduler, step, shares=shares)
    return {"loaded": loaded, "end": _full(model, optimizer)}


def test_fsdp_reshards_two_to_one(world2, world1, tmp_path):
    """2 ranks save; 1 rank loads the same values and continues on the same global batch (tolerance: test_dcp's)."""
    saved = world2.run(save_then_continue, str(tmp_path), stop=3, total=5)[0]
    (path,) = list_checkpoints(tmp_path / "ckpt")
    ends = world1.run(load_and_continue, str(path), total=5)
    _assert_bitwise(saved["at_save"], ends[0]["loaded"])  # resharding moves values, it does not compute
    torch.testing.assert_close(ends[0]["end"], saved["end"], atol=2e-5, rtol=1e-4)


def load_only(topo, path: str) -> str:
    model, optimizer, scheduler = _build("fsdp", topo.world_size)
    try:
        load_sharded(_run(Path(path).parent.parent, path), model=model, optimizer=optimizer, scheduler=scheduler)
    except RecipeError as err:
        return str(err)
    return "loaded"


def test_a_damaged_or_missing_shard_is_refused_on_every_rank_and_passed_over_by_auto(world2, tmp_path, capsys):
    path = Path(world2.run(train_save_resume, "fsdp", str(tmp_path), stop=1, total=1)[0]["path"])
    assert newest_good(tmp_path) == path == tmp_path / "ckpt" / "step-000001.safetensors"
    shard = sorted(path.with_suffix("").glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40  # a high bit of the last tensor's last float
    shard.write_bytes(bytes(data))
    errors = world2.run(load_only, str(path))
    assert errors[0] == errors[1] and "does not match its checksum" in errors[0], errors
    assert shard.name in errors[0] and "tensor " in errors[0] and "\n" not in errors[0]
    assert newest_good(tmp_path) is None  # --resume auto passes over it, and says why
    said = capsys.readouterr().err
    assert f"skipping {path}, damaged (tensor " in said and "; trying the one before" in said
    shard.write_bytes(bytes(data[:100]))  # truncated
    assert f"shard file {shard.name} is unreadable" in world2.run(load_only, str(path))[0]
    shard.unlink()
    assert f"shard file {shard.name} is missing" in world2.run(load_only, str(path))[0]


def save_nan(topo, run_dir: str) -> str:
    model, optimizer, scheduler = _build("fsdp", topo.world_size)
    with torch.no_grad():
        next(model.parameters()).to_local().fill_(float("nan"))
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler)
    return str(save_sharded(_run(run_dir), **state, progress={"step": 0}, keep=2))


def load_checked(topo, path: str) -> str:
    import core.plugins.checks  # noqa: F401 - the checks plug-in: its READ_CHECKS entry sees every shard file too

    return load_only(topo, path)


def test_a_non_finite_weight_is_refused_with_the_checks_plug_in(world2, tmp_path):
    path = world2.run(save_nan, str(tmp_path))[0]
    error = world2.run(load_checked, path)[0]
    assert "holds a non-finite value (NaN or inf)" in error and "model/blocks.0.tok.weight" in error


def save_steps(topo, run_dir: str, steps: list[int]) -> list[str]:
    model, optimizer, scheduler = _build("tp", topo.world_size)
    for step in steps:
        save_sharded(
            _run(run_dir), model=model, optimizer=optimizer, scheduler=scheduler, progress={"step": step}, keep=2
        )
    return [p.name for p in list_checkpoints(Path(run_dir) / "ckpt")]


def test_keeps_the_newest_and_replaces_a_step_saved_again(world2, tmp_path):
    (tmp_path / "ckpt" / "step-000007").mkdir(parents=True)  # a save killed before its file: the next save cleans it
    names = ["step-000002.safetensors", "step-000003.safetensors"]
    assert world2.run(save_steps, str(tmp_path), [1, 2, 3, 3])[0] == names
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(["step-000002", "step-000003", *names])


@pytest.fixture(scope="module")
def world4():
    with GlooWorld(4, timeout_s=180) as world:
        yield world


@pytest.mark.slow
def test_fsdp_tp_two_by_two_resume_bitwise(world4, tmp_path):
    for result in world4.run(train_save_resume, "fsdp_tp", str(tmp_path), stop=2, total=4):
        _assert_bitwise(result["never_stopped"], result["resumed"])


def save_context(topo, run_dir: str, context: int) -> str:
    model, optimizer, scheduler = _build("fsdp", topo.world_size, context=context)
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler)
    return str(save_sharded(_run(run_dir), **state, progress={"step": 0}, keep=2))


def load_context(topo, path: str, context: int) -> str:
    model, optimizer, scheduler = _build("fsdp", topo.world_size, context=context)
    try:
        load_sharded(_run(Path(path).parent.parent, path), model=model, optimizer=optimizer, scheduler=scheduler)
    except RecipeError as err:
        return str(err)
    return "loaded"


def test_a_checkpoint_of_another_shape_under_the_same_model_is_one_line(world2, tmp_path):
    """A --model whose shapes changed since the save: one line on every rank naming the fix, not DCP's own error."""
    path = world2.run(save_context, str(tmp_path), test_dcp.CONTEXT)[0]
    errors = world2.run(load_context, path, 2 * test_dcp.CONTEXT)
    assert errors[0] == errors[1] and "its tensors do not fit this model" in errors[0], errors
    assert "\n" not in errors[0] and "use the model it saved, or a new --out" in errors[0]
    assert world2.run(load_context, path, test_dcp.CONTEXT) == ["loaded", "loaded"]

"""core/shard_ckpt.py: sharded checkpoints of fully_shard, tensor-parallel, 2-D and pipeline-stage models, in the
kernel's layout: RUN/ckpt/step-N/ shards beside step-N.safetensors.

One gloo world of 2 for the module, one of 1 for resharding 2 -> 1. A run that saves at step K and continues from the
loaded checkpoint in a freshly built model and optimizer must end with the weights and optimizer state of the run that
never stopped, bit for bit, at the same world size; at another world size within float rounding (the gradient sums
run in another order).
"""

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from core.gpt import GPT
from core.kernel.job import RecipeError, RunFolder
from core.kernel.store import newest_good, read_checkpoint
from core.schedules import Stage, root_module
from core.shard import find_blocks
from core.shard_ckpt import load_sharded, save_sharded
from core.tp_plan import gpt_tp_plan
from helpers import checkpoints
from world import GlooWorld

pytestmark = pytest.mark.world
VOCAB, CONTEXT, GLOBAL_BATCH = 32, 16, 8


def _fsdp(model, mesh):
    """fully_shard each block, then the root: the fsdp recipe's lines."""
    for block in find_blocks(model)[1]:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _build(kind: str, world: int, *, lr: float = 1e-2, context: int = CONTEXT):
    """Model (or this rank's pipeline stage), AdamW, cosine schedule: built the same on every call."""
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, context=context, dim=32, heads=2, layers=2)
    if kind == "fsdp":
        _fsdp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    elif kind == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), gpt_tp_plan(model))
    elif kind == "fsdp_tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        _fsdp(parallelize_module(model, mesh["tp"], gpt_tp_plan(model)), mesh["dp"])
    elif kind == "pipeline":
        rank = torch.distributed.get_rank()
        model = Stage({i: model.blocks[i] for i in range(2 * rank, 2 * rank + 2)})  # two blocks a stage
    elif kind == "interleaved":  # two stages per rank, as the interleaved schedules hold them: rank r has r and r+2
        rank = torch.distributed.get_rank()
        model = [Stage({i: model.blocks[i]}) for i in (rank, rank + 2)]  # one block a stage
    params = [p for m in model for p in m.parameters()] if isinstance(model, list) else model.parameters()
    optimizer = torch.optim.AdamW(params, lr=lr)
    return model, optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)


def _root(model):
    """What a checkpoint takes: the model, or one module over a rank's stages (as the pipeline recipe passes it)."""
    return root_module(model) if isinstance(model, list) else model


def _step(kind: str, model, optimizer, scheduler, step: int, *, shares: slice) -> None:
    """One step on the global batch; each data-parallel rank (fsdp, fsdp_tp's dp) takes its rows of it."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, CONTEXT), generator=g)
    if kind in ("pipeline", "interleaved"):  # each stage alone on its own input: its plain tensors are what matter
        hidden = torch.randn(GLOBAL_BATCH, CONTEXT, 32, generator=g)
        stages = model if isinstance(model, list) else [model]
        loss = sum(m(tokens if m.indices[0] == 0 else hidden).square().mean() for m in stages)
    else:
        mine = tokens[shares]
        loss = torch.nn.functional.cross_entropy(model(mine).reshape(-1, VOCAB), mine.roll(-1, 1).reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _full(model, optimizer) -> dict:
    """Weights and optimizer state, gathered whole (a collective), on CPU."""
    model_sd, optim_sd = get_state_dict(_root(model), optimizer, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": v.detach().clone() for k, v in model_sd.items()}
    out |= {f"optim/{k}/{n}": v.clone() for k, s in optim_sd["state"].items() for n, v in s.items()}
    return out


def _shares(kind: str, topo) -> slice:
    """This rank's rows of the global batch: split over the dp ranks (fsdp: all; fsdp_tp: groups of 2)."""
    dp_rank, dp = {"fsdp": (topo.rank, topo.world_size), "fsdp_tp": (topo.rank // 2, topo.world_size // 2)}.get(
        kind, (0, 1)
    )
    per = GLOBAL_BATCH // dp
    return slice(dp_rank * per, (dp_rank + 1) * per)


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


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
    assert [p.name for p in checkpoints(tmp_path / "ckpt")] == ["step-000002.safetensors"]
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


def _reshard(saver, loader, run_dir) -> None:
    saved = saver.run(save_then_continue, str(run_dir), stop=3, total=5)[0]
    (path,) = checkpoints(run_dir / "ckpt")
    assert read_checkpoint(path, tensors=False)[1]["world_size"] == str(saver.world_size)
    ends = loader.run(load_and_continue, str(path), total=5)
    _assert_bitwise(saved["at_save"], ends[0]["loaded"])  # resharding moves values, it does not compute
    torch.testing.assert_close(ends[0]["end"], saved["end"], atol=2e-5, rtol=1e-4)


def test_fsdp_reshards_two_to_one(world2, world1, tmp_path):
    """2 ranks save; 1 rank loads the same values and continues on the same global batch.

    Continuing, one rank sums each gradient in another order than two do; AdamW divides by sqrt(v), which magnifies
    that rounding where a gradient is ~0 (attention key biases: softmax ignores them), so the tolerance is the
    model-parallel tests' (atol 2e-5, rtol 1e-4, lr 1e-3)."""
    _reshard(world2, world1, tmp_path)


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
    import core.plugins.checks  # noqa: F401 - the checks plug-in: its SEAMS["read_checks"] entry sees every shard file too

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
    return [p.name for p in checkpoints(Path(run_dir) / "ckpt")]


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
def test_fsdp_reshards_two_to_four_and_four_to_two(world2, world4, tmp_path):
    _reshard(world2, world4, tmp_path / "two")
    _reshard(world4, world2, tmp_path / "four")


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
    path = world2.run(save_context, str(tmp_path), CONTEXT)[0]
    errors = world2.run(load_context, path, 2 * CONTEXT)
    assert errors[0] == errors[1] and "its tensors do not fit this model" in errors[0], errors
    assert "\n" not in errors[0] and "use the model it saved, or a new --out" in errors[0]
    assert world2.run(load_context, path, CONTEXT) == ["loaded", "loaded"]
